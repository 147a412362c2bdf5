"""The Docker Engine edge: the only module that imports the docker SDK, and its one error
boundary. Everything else holds an opaque client and calls the helpers here."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from m31ctl.errors import DockerUnreachable, HostPreconditionError, M31Error, NotReadyError


def connect(timeout: float = 10.0) -> Any:
    """A docker.DockerClient that answered a ping, or DockerUnreachable saying why."""
    import docker
    from docker.errors import DockerException

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
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _hint(exc: Exception) -> str:
    if "Permission denied" in str(exc):
        return "add your user to the docker group, or run as root"
    return "start the daemon (systemctl start docker) or set DOCKER_HOST"


def explanation(exc: Exception) -> str:
    """The Engine's own words for an API error (its JSON 'message'), else the exception text."""
    text = getattr(exc, "explanation", None) or str(exc)
    return str(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)


@contextlib.contextmanager
def engine_boundary(doing: str) -> Iterator[None]:
    """The one place Docker SDK errors become m31ctl errors with documented exit codes:
    a container that vanished under us (removed, or its engine restarted) is a server that
    died (5); a lost connection is an unreachable engine (3); any other refusal by the engine
    is a host precondition (6), with the engine's own message."""
    from docker.errors import APIError, DockerException, NotFound
    from requests.exceptions import ConnectionError as RequestsConnectionError
    from requests.exceptions import ReadTimeout

    try:
        yield
    except M31Error:
        raise
    except NotFound as exc:
        raise NotReadyError(
            f"the container vanished while m31ctl was {doing} ({explanation(exc)[:160]})",
            hint="something removed it; `m31ctl status` shows what is left, and `m31ctl launch` starts it again",
        ) from None
    except APIError as exc:
        raise HostPreconditionError(
            f"the Docker Engine refused while m31ctl was {doing}: {explanation(exc)[:200]}",
            hint="see `docker info` and the engine's log",
        ) from None
    except (RequestsConnectionError, ReadTimeout, DockerException) as exc:
        raise DockerUnreachable(
            f"lost the Docker Engine while {doing}: {_reason(exc)}", hint=_hint(exc)
        ) from None


def find_container(client: Any, name: str) -> Any | None:
    from docker.errors import NotFound

    try:
        return client.containers.get(name)
    except NotFound:
        return None


def is_not_found(exc: BaseException) -> bool:
    from docker.errors import NotFound

    return isinstance(exc, NotFound)


def is_conflict(exc: BaseException) -> bool:
    """The engine refused because the name is taken (HTTP 409): its create-by-name is atomic."""
    from docker.errors import APIError

    return isinstance(exc, APIError) and exc.status_code == 409


def remove_if_present(container: Any) -> None:
    """Force-remove this container (by id); one removed meanwhile is removed all the same."""
    from docker.errors import NotFound

    with contextlib.suppress(NotFound):
        container.remove(force=True)


# What every throwaway container m31ctl creates carries, besides a name of its own: `docker ps
# -a --filter label=io.m31ctl.throwaway` finds any that a killed m31ctl (SIGKILL) left.
THROWAWAY_LABEL = "io.m31ctl.throwaway"


@contextlib.contextmanager
def throwaway(client: Any, purpose: str, **create: Any) -> Iterator[Any]:
    """A container created for a check (`create`: the Engine API's create_container arguments),
    removed whatever happens after the Engine is asked to create it: an error in start or wait,
    a timeout, Ctrl-C. It gets a unique name first, so that even an interrupt that lands while the
    create request is in flight (the Engine made it, its id never reached us) removes it."""
    import uuid

    name = f"m31ctl-{purpose}-{uuid.uuid4().hex[:12]}"
    labels = {**create.pop("labels", {}), THROWAWAY_LABEL: purpose}
    try:
        created = client.api.create_container(name=name, labels=labels, **create)
        yield client.containers.get(created["Id"])
    finally:
        _remove_named(client, name)


def _remove_named(client: Any, name: str) -> None:
    from docker.errors import APIError, NotFound

    try:
        client.api.remove_container(name, force=True)
    except NotFound:
        pass  # never created, or gone already
    except APIError:
        pass  # the engine refuses now (removal already in progress): nothing more to do here


def stop_for_good(container: Any) -> None:
    """Stop a container and take its restart policy away, keeping it and its logs."""
    from docker.errors import APIError

    try:
        container.update(restart_policy={"Name": "no"})
        container.stop(timeout=10)
    except APIError:
        pass  # gone meanwhile, or stopped already: nothing is restarting it


def local_image(client: Any, name: str) -> Any | None:
    from docker.errors import ImageNotFound

    try:
        return client.images.get(name)
    except ImageNotFound:
        return None


def registry_error(client: Any, name: str) -> str | None:
    """None when the image's registry knows it; else what the engine said."""
    from docker.errors import APIError

    try:
        client.api.inspect_distribution(name)
    except APIError as exc:
        return str(exc)
    return None


def api_error_text(exc: BaseException) -> str | None:
    """The text of a Docker API error, or None for any other exception."""
    from docker.errors import APIError

    return explanation(exc) if isinstance(exc, APIError) else None
