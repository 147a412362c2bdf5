"""Doctor checks: independent, time-limited, run concurrently; each says ok/warn/fail/skip.
Their result type is m31ctl/checks.py's, shared with smoke and verify."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from m31ctl.checks import CheckResult, CheckStatus
from m31ctl.deployment import Deployment
from m31ctl.errors import DockerUnreachable, M31Error
from m31ctl.hardware import Hardware
from m31ctl.plan import Plan
from m31ctl.probe import ProbeReport
from m31ctl.probe.snapshot import Runner, run_command
from m31ctl.runtime import get_runtime
from m31ctl.runtime.engine_api import connect
from m31ctl.runtime.gates import CheckId
from m31ctl.runtime.protocol import ScriptRun

__all__ = [
    "Check",
    "CheckContext",
    "CheckResult",
    "CheckStatus",
    "EngineScripts",
    "Outcome",
    "SkipCheck",
    "run_checks",
]

_CONNECT_LOCK = threading.Lock()


class SkipCheck(Exception):
    """Raised inside a check that cannot run here; it reports skip with this reason."""

    def __init__(self, reason: str, remedy: str = "") -> None:
        super().__init__(reason)
        self.remedy = remedy


@dataclass(frozen=True)
class Outcome:
    status: CheckStatus
    message: str
    remedy: str = ""


class EngineScripts(Protocol):
    """What the deep checks need of a runtime (m31ctl.runtime.protocol.Runtime has it): a script run
    with the engine's own Python and the server's settings. Tests pass a replay of captures."""

    def run_engine_script(
        self,
        deployment: Deployment,
        script: Path,
        args: Sequence[str],
        timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> ScriptRun: ...


@dataclass
class CheckContext:
    """What checks may read. Side effects go through these callables, so tests can pass fakes."""

    deployment: Deployment | None
    plan_error: str | None
    probe: ProbeReport
    env: Mapping[str, str]
    run: Runner = run_command
    docker: Callable[[], Any] | None = None  # returns a connected client or raises DockerUnreachable
    # doctor --deep: the runtime (a name in m31ctl.runtime.RUNTIMES) whose engine Python the
    # deep checks run with; None: they are not run.
    deep: str | None = None
    # The runtime the plan is checked for (doctor's --runtime, with or without --deep): the checks
    # a launch by it is not gated on skip. None: --deep's runtime, else docker's gates.
    runtime: str | None = None
    # Overrides the runtime's scripts (tests replay captured probe output through it).
    scripts: EngineScripts | None = None
    # doctor --locked FILE: the lock the lock check compares with, and the -f files that fed the plan.
    lock_path: Path | None = None
    plan_files: tuple[Path, ...] = ()
    # Where the host's /sys and /dev are read (the fabric check): / here, a tree in tests.
    host_root: Path = Path("/")
    # The host --hardware named, where it named one (a plan or not): the messages then point at
    # that host, not at the flag the user already passed.
    named_host: Hardware | None = None
    _memo: dict[str, Any] = field(default_factory=dict, init=False)
    _memo_lock: Any = field(default_factory=threading.Lock, init=False)
    _docker_client: Any = field(default=None, init=False)
    _docker_error: Exception | None = field(default=None, init=False)

    def once(self, key: str, compute: Callable[[], Any]) -> Any:
        """`compute()` once per doctor run, shared by the checks that read it (they run concurrently)."""
        with self._memo_lock:
            if key not in self._memo:
                try:
                    self._memo[key] = (compute(), None)
                except Exception as exc:
                    self._memo[key] = (None, exc)
        value, error = self._memo[key]
        if error is not None:
            raise error
        return value

    @property
    def plan(self) -> Plan | None:
        return self.deployment.plan if self.deployment is not None else None

    def require_deployment(self) -> Deployment:
        """The deployment, for checks that judge it; without one they skip."""
        if self.deployment is None:
            # The first line says why there is none and what to pass (--hardware where it was
            # probed, another host where --hardware named one no recipe serves): not said again.
            raise SkipCheck("needs a plan (none was made: see the first line)")
        return self.deployment

    def require_plan(self) -> Plan:
        return self.require_deployment().plan

    def engine_scripts(self) -> EngineScripts:
        """The runtime --deep names, from the runtime registry (the checks never ask its name)."""
        if self.scripts is not None:
            return self.scripts
        if self.deep is None:
            raise SkipCheck("runs with --deep only")

        return get_runtime(self.deep)

    def engine(self) -> Any:
        """The client for checks that need Docker only as a means: when the Engine is
        unreachable they skip, and the docker check alone reports it."""

        try:
            return self.docker_client()
        except DockerUnreachable:
            raise SkipCheck("needs the Docker Engine (see the docker check)") from None

    def docker_client(self) -> Any:
        """Connect once; every Docker check shares the client (or the error)."""
        with _CONNECT_LOCK:
            self._connect()
        if self._docker_error is not None:
            raise self._docker_error
        return self._docker_client

    def _connect(self) -> None:
        if self._docker_client is None and self._docker_error is None:
            try:
                if self.docker is None:
                    self._docker_client = connect(timeout=5)
                else:
                    self._docker_client = self.docker()
            except Exception as exc:
                self._docker_error = exc


@dataclass(frozen=True)
class Check:
    id: CheckId
    title: str
    fn: Callable[[CheckContext], Outcome]
    timeout_s: float = 5.0
    deep: bool = False  # needs the image and the GPUs: `doctor --deep` only
    locked: bool = False  # compares with a lock file: `--locked FILE` only
    # Whether the check has anything to judge in this deployment (None: no plan); one that has
    # not is left out of the report, e.g. the KV fabric's check from a plan that moves no KV.
    applies: Callable[[Deployment | None], bool] = field(default=lambda _deployment: True)


def run_checks(checks: Sequence[Check], ctx: CheckContext, workers: int = 8) -> list[CheckResult]:
    """Run all checks concurrently; a check that raises or overruns fails alone."""
    results: dict[CheckId, CheckResult] = {}
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="doctor")
    started = {c.id: time.monotonic() for c in checks}
    futures = {c.id: pool.submit(_timed, c, ctx) for c in checks}
    for check in checks:
        deadline = started[check.id] + check.timeout_s
        try:
            results[check.id] = futures[check.id].result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            results[check.id] = CheckResult(
                check.id.value,
                check.title,
                CheckStatus.FAIL,
                f"no answer within {check.timeout_s:g} s",
                "see what hangs; rerun",
                check.timeout_s,
            )
    pool.shutdown(wait=False, cancel_futures=True)
    return [results[c.id] for c in checks]


def _timed(check: Check, ctx: CheckContext) -> CheckResult:
    start = time.monotonic()
    try:
        outcome = check.fn(ctx)
    except SkipCheck as skip:
        outcome = Outcome(CheckStatus.SKIP, str(skip), skip.remedy)
    except Exception as exc:
        message = exc.message if isinstance(exc, M31Error) else f"{type(exc).__name__}: {exc}"
        remedy = (
            (exc.hint or "") if isinstance(exc, M31Error) else "this is a bug in the check; please report it"
        )
        outcome = Outcome(CheckStatus.FAIL, message, remedy)
    return CheckResult(
        check.id.value, check.title, outcome.status, outcome.message, outcome.remedy, time.monotonic() - start
    )
