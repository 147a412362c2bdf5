"""Waiting for a server to become ready, whatever runs it (a container or a native process).

A handle reports the process state and its log; readiness is the same for both:
running -> /health answers 200 -> /v1/models lists the served name. A death while loading
stops the wait at once with the last log lines and a diagnosis.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from m31ctl import interrupt
from m31ctl.errors import NotReadyError, ServerDied
from m31ctl.runtime.exits import explain_exit
from m31ctl.runtime.phases import Phase, latest_phase
from m31ctl.runtime.protocol import PhaseCallback, Reporter

if TYPE_CHECKING:
    import httpx

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


@functools.cache
def _client() -> httpx.Client:
    """One client for every look of this process. httpx.get builds a client, and with it an SSL
    context loading the CA bundle, on every call: 28 ms each, 5.3 s of CPU over a 50 s wait on the
    lent H200 (tests/fixtures/gpu/h200-launch-overhead/), beside an engine that is starting."""
    import httpx  # lazy: httpx costs start-up; stop and logs never ask a server

    return httpx.Client()


def models(base: str, api_key: str | None, timeout: float = 2.0) -> list[str] | None:
    """Served model ids from /v1/models, or None while the server does not answer."""
    import httpx  # lazy, as in _client: its error types only

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = _client().get(f"{base}/v1/models", headers=headers, timeout=timeout)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return [str(m.get("id")) for m in response.json().get("data", [])]
    except ValueError:
        return None


def health(base: str, timeout: float = 2.0) -> int | None:
    import httpx  # lazy, as in _client: its error types only

    try:
        return _client().get(f"{base}/health", timeout=timeout).status_code
    except httpx.HTTPError:
        return None


class Watchdog(NamedTuple):
    """How long the engine's log may stay silent in each phase before the wait stops, and where
    the triage bundle goes (launching.watchdog_for builds it from the plan)."""

    budgets: Mapping[Phase, float]  # seconds of silence allowed in a phase (default_s elsewhere)
    default_s: float
    triage: Callable[[dict[str, Any]], str]  # writes the bundle, returns its path


class _WaitProgress:
    """What the wait has seen so far: phases in order (with when), the log's last change."""

    def __init__(self, report: Reporter, on_phase: PhaseCallback | None) -> None:
        self.start = time.monotonic()
        self.seen: list[Phase] = []
        self.timeline: list[dict[str, Any]] = []
        self.last_log = ""
        self.last_change = self.start
        self.current: Phase | None = None
        self._report = report
        self._on_phase = on_phase

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def read(self, tail: str) -> None:
        """Note the log's tail: when it last changed, and a phase it reached for the first time."""
        now = time.monotonic()
        if tail != self.last_log:
            self.last_log, self.last_change = tail, now
        self.current = latest_phase(tail)
        if self.current is not None and self.current not in self.seen:
            self.seen.append(self.current)
            self.timeline.append({"phase": self.current.value, "elapsed_s": round(now - self.start, 3)})
            self._report(f"phase: {self.current.value} ({now - self.start:.1f} s)")
            self.announce(self.current, now - self.start)

    def announce(self, phase: Phase, elapsed: float) -> None:
        if self._on_phase is not None:
            self._on_phase(phase, elapsed)

    def silent_s(self) -> float:
        return time.monotonic() - self.last_change


def wait_ready(
    handle: ServerHandle,
    base: str,
    served_name: str,
    timeout: float,
    report: Reporter,
    api_key: str | None,
    *,
    on_phase: PhaseCallback | None = None,
    watchdog: Watchdog | None = None,
) -> tuple[dict[str, float], tuple[Phase, ...]]:
    """Poll until /v1/models lists `served_name` (ready), the server dies (NotReadyError with its
    last log lines and a diagnosis), its log makes no progress for the current phase's budget
    (the watchdog: a classified stall and a triage bundle), or `timeout` seconds pass
    (NotReadyError saying how far it got). Returns the timings of each milestone and the
    startup phases seen in the log."""
    progress = _WaitProgress(report, on_phase)
    timings: dict[str, float] = {}
    while True:
        state = handle.state()
        if state.dead:
            died(handle, state)
        tail = handle.log_tail(200)
        progress.read(tail)
        if state.running and _answers(base, served_name, api_key, timings, progress, report):
            timings["ready"] = progress.elapsed()
            progress.announce(Phase.READY, timings["ready"])
            return timings, tuple(progress.seen)
        healthy = "health" in timings
        if watchdog is not None and not healthy:
            current = progress.current
            budget = watchdog.budgets.get(current, watchdog.default_s) if current else watchdog.default_s
            if progress.silent_s() > budget:
                stalled(handle, progress.current, tail, progress.silent_s(), progress.timeline, watchdog)
        if progress.elapsed() > timeout:
            last = progress.seen[-1].value if progress.seen else "none"
            case = (
                "unhealthy: /health answers but /v1/models does not list the model"
                if healthy
                else f"still loading (last phase: {last})"
            )
            raise NotReadyError(
                f"not ready after {timeout:g} s: {case}", hint="raise --timeout, or look at `m31ctl logs`"
            )
        interrupt.sleep(POLL_S)  # Ctrl-C ends the wait here, between looks


def _answers(
    base: str,
    served_name: str,
    api_key: str | None,
    timings: dict[str, float],
    progress: _WaitProgress,
    report: Reporter,
) -> bool:
    """One look at a running server: /health first (once it answers 200, never again), then
    whether /v1/models lists the served name. Milestones go into `timings`."""
    timings.setdefault("running", progress.elapsed())
    if "health" not in timings:
        if health(base) != 200:
            return False
        timings["health"] = progress.elapsed()
        report(f"/health answers 200 ({timings['health']:.1f} s)")
    listed = models(base, api_key)
    if listed is None:
        return False
    timings.setdefault("models_first_answer", progress.elapsed())
    return served_name in listed


def stalled(
    handle: ServerHandle,
    current: Phase | None,
    tail: str,
    silent_s: float,
    timeline: list[dict[str, Any]],
    watchdog: Watchdog,
) -> None:
    """Stop waiting on an engine whose log has not moved for its phase's budget: classify the
    stall from the log, write the triage bundle, and say where it is."""
    cause, remedy = classify_stall(current, tail)
    where = current.value if current else "starting"
    path = watchdog.triage(
        {
            "server": handle.name,
            "phase": where,
            "silent_s": round(silent_s, 1),
            "cause": cause,
            "remedy": remedy,
            "timeline": timeline,
            "log_tail": tail.splitlines()[-200:],
        }
    )
    lines = tuple(tail.rstrip().splitlines()[-LOG_TAIL_ON_FAILURE:])
    raise NotReadyError(
        f"{handle.name} made no progress for {silent_s:.0f} s while {where}: {cause}",
        hint=f"{remedy}; triage bundle: {path}",
        details=("the engine's last log lines:", *("    " + ln for ln in lines)),
    )


def classify_stall(current: Phase | None, tail: str) -> tuple[str, str]:
    last = "\n".join(tail.splitlines()[-30:])
    if _NCCL.search(last):
        return (
            "a collective (NCCL/RCCL) hang: process-group setup or an all-reduce made no progress",
            "rerun with NCCL_DEBUG=INFO; check shm size, P2P/ACS and GPU visibility (`m31ctl doctor`)",
        )
    if current is Phase.DOWNLOADING:
        return (
            "the checkpoint download stalled",
            "check the network path to Hugging Face, HF_TOKEN, and runtime.download_mbps",
        )
    d = explain_exit(tail, None, False)
    if d.known:
        return d.summary, d.remedy
    if current in (Phase.COMPILING, Phase.CUDA_GRAPHS):
        return (
            f"{current.value} made no progress",
            "raise runtime.load_and_compile_s, or serve eagerly (engine.extra_args: --enforce-eager)",
        )
    return (
        f"no progress while {current.value if current else 'starting'}",
        "read the log tail in the bundle; `m31ctl logs` shows the rest",
    )


_NCCL = re.compile(r"NCCL|RCCL|init_process_group|all_reduce|ProcessGroup", re.IGNORECASE)


def died(handle: ServerHandle, state: ProcessState) -> None:
    """Stop waiting: the server is gone. The error carries its last log lines and a diagnosis."""
    if state.vanished:
        raise NotReadyError(
            f"{handle.name} was removed while starting",
            hint="something else removed the " + handle.kind + "; `m31ctl launch` starts it again",
        )
    tail = handle.log_tail(LOG_TAIL_ON_FAILURE)
    d = explain_exit(tail, state.exit_code, state.oom_killed)
    lines = tuple(tail.rstrip().splitlines()[-LOG_TAIL_ON_FAILURE:])
    how = "restarted" if state.restarted else f"exited (code {state.exit_code})"
    raise ServerDied(
        f"{handle.name} {how} while starting: {d.summary}",
        hint=d.remedy,
        details=(f"the {handle.kind} {how} while starting; last log lines:", *("    " + ln for ln in lines)),
    )
