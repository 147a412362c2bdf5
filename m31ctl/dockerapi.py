"""The Docker Engine edge: one place that imports the docker SDK and explains failures."""

from __future__ import annotations

import os
from typing import Any

from m31ctl.errors import DockerUnreachable

OWNER_LABEL = "io.m31ctl.owner"
OWNER = "m31ctl"


def connect(timeout: float = 10.0) -> Any:
    """A docker.DockerClient that answered a ping, or DockerUnreachable saying why."""
    try:
        import docker
        from docker.errors import DockerException
    except ImportError:  # pragma: no cover - a hard dependency
        raise DockerUnreachable("the docker Python package is missing", hint="pip install docker") from None
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except DockerException as exc:
        raise DockerUnreachable(
            f"cannot reach the Docker Engine at {host}: {_reason(exc)}", hint=_hint(exc)
        ) from None
    return client


def _reason(exc: Exception) -> str:
    text = str(exc)
    if "Permission denied" in text:
        return "permission denied on the socket"
    if "No such file" in text or "FileNotFoundError" in text:
        return "no socket (is dockerd running?)"
    if "Connection refused" in text:
        return "connection refused (is dockerd running?)"
    return text.splitlines()[0][:200]


def _hint(exc: Exception) -> str:
    text = str(exc)
    if "Permission denied" in text:
        return "add your user to the docker group, or run as root"
    return "start the daemon (systemctl start docker) or set DOCKER_HOST"
