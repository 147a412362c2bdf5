"""The kubelet's prober: a probe's action run as the kubelet runs it, HTTP GET to the pod's IP
and the probe's port, a TCP connection to it, or exec inside the container with the probe's
timeout (`docker exec`, also the preStop hook's, termination.py). When each probe is due, and what
its passes make of the pod (started, ready), is the kubelet's (kubelet.py, Kubelet.probe_once)."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from m31ctl import interrupt
from m31ctl.rehearsal.docker_verbs import Ran, decoded
from m31ctl.rehearsal.pods import Probe
from m31ctl.runtime import engine_api
from m31ctl.runtime.engine_api import refusals


def http_probe(ip: str, probe: Probe, timeout: float) -> tuple[bool, str]:
    """HTTP GET as the kubelet sends it: 200-399 passes; no credentials (a probe carries none)."""
    url = f"http://{ip}:{probe.port}{probe.path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return 200 <= answer.status < 400, f"HTTP {answer.status}"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return False, str(exc)[:200]


def tcp_probe(ip: str, probe: Probe, timeout: float) -> tuple[bool, str]:
    """tcpSocket as the kubelet opens it (pkg/probe/tcp): the connection made passes, nothing is
    sent; a port that answers HTTP 404 to `GET /` is alive (the router's front)."""
    try:
        socket.create_connection((ip, probe.port), timeout=timeout).close()
        return True, "connected"
    except OSError as exc:
        return False, str(exc)[:200]


def exec_in(client: Any, container: str, argv: Sequence[str], timeout: float) -> Ran:
    """`docker exec` with a timeout: the command's exit code and output; Ran(124, ...) when it
    did not end within `timeout` (the command runs on in the container, as it did when the
    timed-out CLI was killed). The Engine API's exec has no timeout of its own: it runs in a
    daemon thread and is waited for with interrupt.join, which Ctrl-C ends at once."""
    box: list[Ran] = []

    def run() -> None:
        try:
            with refusals() as refused:
                made = client.api.exec_create(container, list(argv))
                out, err = client.api.exec_start(made["Id"], demux=True)
                code = client.api.exec_inspect(made["Id"]).get("ExitCode")
                box.append(Ran(int(code if code is not None else -1), decoded(out), decoded(err)))
            if refused.reason is not None:  # not running, or gone: the CLI's exit 1 with the engine's words
                box.append(Ran(1, "", refused.reason))
        except Exception as exc:  # the engine's connection: a failed probe, not a crash
            box.append(Ran(1, "", engine_api.reason(exc)))

    thread = threading.Thread(target=run, name="m31ctl exec", daemon=True)
    thread.start()
    interrupt.join(thread, timeout)
    if not box:
        return Ran(124, "", f"docker exec timed out after {timeout:g} s")
    return box[0]


def exec_probe(client: Any, container: str, probe: Probe) -> tuple[bool, str]:
    done = exec_in(client, container, probe.command, timeout=probe.timeout_s)
    return done.ok, f"exit {done.code}" + (f": {done.err.strip()[-200:]}" if done.err.strip() else "")
