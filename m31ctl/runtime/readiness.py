"""Waiting for a server to become ready, whatever runs it (a container or a native process).

A handle reports the process state and its log; readiness is the same for both:
running -> /health answers 200 -> /v1/models lists the served name. A death while loading
stops the wait at once with the last log lines and a diagnosis.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from m31ctl.errors import NotReadyError, ServerDied
from m31ctl.runtime.base import Reporter
from m31ctl.runtime.exits import diagnose, phase

POLL_S = 0.25
LOG_TAIL_ON_FAILURE = 20


@dataclass(frozen=True)
class ProcessState:
    running: bool
    dead: bool  # exited, killed, or restarting after a crash
    exit_code: int | None = None
    oom_killed: bool = False
    restarted: bool = False
    vanished: bool = False  # removed under us (a container deleted during the wait)


class ServerHandle(Protocol):
    name: str
    kind: str  # "container" | "process"

    def state(self) -> ProcessState: ...

    def log_tail(self, lines: int) -> str: ...


def models(base: str, api_key: str | None, timeout: float = 2.0) -> list[str] | None:
    """Served model ids from /v1/models, or None while the server does not answer."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{base}/v1/models", headers=headers, timeout=timeout)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return [str(m.get("id")) for m in response.json().get("data", [])]
    except ValueError:
        return None


def health(base: str, timeout: float = 2.0) -> int | None:
    import httpx

    try:
        return httpx.get(f"{base}/health", timeout=timeout).status_code
    except httpx.HTTPError:
        return None


def wait_ready(
    handle: ServerHandle, base: str, served_name: str, timeout: float, report: Reporter, api_key: str | None
) -> tuple[dict[str, float], tuple[str, ...]]:
    """Poll until /v1/models lists `served_name` (ready), the server dies (NotReadyError with its
    last log lines and a diagnosis), or `timeout` seconds pass (NotReadyError saying how far it
    got). Returns the timings of each milestone and the startup phases seen in the log."""
    start = time.monotonic()
    timings: dict[str, float] = {}
    seen: list[str] = []
    health_ok = False
    while True:
        state = handle.state()
        if state.dead:
            died(handle, state)
        current = phase(handle.log_tail(200))
        if current and current not in seen:
            seen.append(current)
            report(f"phase: {current} ({time.monotonic() - start:.1f} s)")
        if state.running:
            timings.setdefault("running", time.monotonic() - start)
            if not health_ok and health(base) == 200:
                health_ok = True
                timings["health"] = time.monotonic() - start
                report(f"/health answers 200 ({timings['health']:.1f} s)")
            if health_ok:
                listed = models(base, api_key)
                if listed is not None:
                    timings.setdefault("models_first_answer", time.monotonic() - start)
                    if served_name in listed:
                        timings["ready"] = time.monotonic() - start
                        return timings, tuple(seen)
        if time.monotonic() - start > timeout:
            case = (
                "unhealthy: /health answers but /v1/models does not list the model"
                if health_ok
                else f"still loading (last phase: {seen[-1] if seen else 'none'})"
            )
            raise NotReadyError(
                f"not ready after {timeout:g} s: {case}", hint="raise --timeout, or look at `m31ctl logs`"
            )
        time.sleep(POLL_S)


def died(handle: ServerHandle, state: ProcessState) -> None:
    """Stop waiting: the server is gone. The error carries its last log lines and a diagnosis."""
    if state.vanished:
        raise NotReadyError(
            f"{handle.name} was removed while starting",
            hint="something else removed the " + handle.kind + "; `m31ctl launch` starts it again",
        )
    tail = handle.log_tail(LOG_TAIL_ON_FAILURE)
    d = diagnose(tail, state.exit_code, state.oom_killed)
    lines = tuple(tail.rstrip().splitlines()[-LOG_TAIL_ON_FAILURE:])
    how = "restarted" if state.restarted else f"exited (code {state.exit_code})"
    raise ServerDied(
        f"{handle.name} {how} while starting: {d.cause}",
        hint=d.remedy,
        details=(f"the {handle.kind} {how} while starting; last log lines:", *("    " + ln for ln in lines)),
    )
