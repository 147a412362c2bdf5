"""The runtime seam: what every way of running a server (a container, a native process, later a
Kubernetes apply) offers to the commands, and the data that crosses it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from m31ctl.deployment import Deployment
from m31ctl.errors import HostPreconditionError
from m31ctl.runtime.gates import CheckId
from m31ctl.runtime.load_run import BenchRunner
from m31ctl.runtime.phases import Phase
from m31ctl.runtime.planrecord import PlanRecord

Reporter = Callable[[str], None]  # progress lines for the user (the CLI decides where they go)

Confirm = Callable[[str], bool]


@dataclass(frozen=True)
class PullEvent:
    """One progress event of an image pull (a layer's bytes so far), for the CLI to draw."""

    layer: str
    current: int
    total: int


PullProgress = Callable[[PullEvent | None], None]  # None: the pull is over


def _no_progress(event: PullEvent | None) -> None:
    del event


PhaseCallback = Callable[[Phase, float], None]
# What a stalled launch's triage bundle adds beyond the log and timeline (deploy: doctor's report).
Diagnostics = Callable[[], dict[str, Any]]


def _no_phase(_phase: Phase, _elapsed: float) -> None:
    pass


@dataclass(frozen=True)
class LaunchOptions:
    """How to launch, beyond the plan: the CLI fills it from flags; tests from code."""

    report: Reporter
    confirm: Confirm
    timeout: float | None = None
    detach: bool = False
    yes: bool = False
    environ: Mapping[str, str] = field(default_factory=dict)
    pull_progress: PullProgress = _no_progress
    # Each startup phase as it begins (name, seconds since the launch began): launch --json
    # prints them as JSON lines for CI logs.
    on_phase: PhaseCallback = _no_phase
    diagnostics: Diagnostics | None = None


@dataclass(frozen=True)
class LaunchResult:
    action: str  # created | recreated | unchanged | adopted
    server: str
    runtime: str
    endpoint: str
    plan_hash: str
    ready: bool
    timings: Mapping[str, float] = field(default_factory=dict)
    phases: tuple[Phase, ...] = ()
    # A blue-green launch's switch (deploy.blue_green): the server replaced, the endpoint move,
    # the gate, the rollback command; None for a launch that replaced nothing beside itself.
    rollout: Replacement | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "server": self.server,
            # The older key, kept for pipelines that read it: it names native servers too.
            "container": self.server,
            "runtime": self.runtime,
            "endpoint": self.endpoint,
            "plan_hash": self.plan_hash,
            "ready": self.ready,
            "phases": [p.value for p in self.phases],
            "timings_s": {k: round(v, 3) for k, v in self.timings.items()},
            "rollout": self.rollout.to_json() if self.rollout is not None else None,
        }


@dataclass(frozen=True)
class Replacement:
    """How a blue-green launch replaced the server that served: `previous` (its name, endpoint
    and plan hash) stopped after the new one passed `gate` (the failed checks' ids, () when it
    passed), or before it started (`downtime_s`: the timeline's start estimate the user
    accepted). `rollback` is the one command that puts the previous plan back."""

    previous: str
    previous_endpoint: str
    previous_plan_hash: str | None
    gpus: tuple[int, ...]  # the host GPU indices the new server took (() on no GPU platform)
    downtime_s: int | None  # None: the new server started beside the old one
    gate: tuple[str, ...]  # the gate's checks that ran (its ids)
    rollback: str

    def to_json(self) -> dict[str, Any]:
        return {
            "previous": {
                "server": self.previous,
                "endpoint": self.previous_endpoint,
                "plan_hash": self.previous_plan_hash,
            },
            "gpus": list(self.gpus),
            "downtime_s": self.downtime_s,
            "gate": list(self.gate),
            "rollback": self.rollback,
        }


@dataclass(frozen=True)
class ServerStatus:
    """One m31ctl server as `status` shows it, whatever runs it."""

    name: str
    runtime: str
    state: str  # running | created | restarting | exited | dead | paused
    plan_hash: str | None
    recipe: str | None
    variant: str | None
    profile: str | None
    endpoint: str | None
    health: int | None = None
    image: str | None = None
    started_at: str | None = None
    restart_count: int = 0
    pid: int | None = None
    # The plan it was launched with (None for a server started before m31ctl recorded it).
    plan: PlanRecord | None = None
    # A P/D role engine's group (the group's own row is the router's): stop and smoke act on
    # the group, status shows each part.
    group: str | None = None
    # The host GPUs it was given by name (UUIDs, render nodes or indices); () where it took the
    # host's first GPUs by count, or none (launch --blue-green places the next beside them).
    gpus: tuple[str, ...] = ()

    @property
    def running(self) -> bool:
        return self.state == "running"

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "runtime": self.runtime,
            "state": self.state,
            "plan_hash": self.plan_hash,
            "recipe": self.recipe,
            "variant": self.variant,
            "profile": self.profile,
            "image": self.image,
            "endpoint": self.endpoint,
            "health": self.health,
            "started_at": self.started_at,
            "restart_count": self.restart_count,
            "pid": self.pid,
            "plan_recorded": self.plan is not None,
            "group": self.group,
            "gpus": list(self.gpus),
        }


@dataclass(frozen=True)
class DryRun:
    """What a launch would start, without starting it."""

    kind: str  # "container" | "process": what the dry run would start, for people
    argv: tuple[str, ...]  # the equivalent command line (docker run ... / python -m ...)
    detail: Mapping[str, Any] = field(default_factory=dict)
    argv_key: str = "command"  # the key `launch --dry-run --json` gives argv under


@dataclass(frozen=True)
class ScriptRun:
    """A script run with the engine's own Python (doctor --deep's probes): what it printed, how it
    ended, and where it ran, in words for the user ("in the engine image", "natively")."""

    exit_code: int | None  # None: killed at its time limit, with every process it started
    stdout: str
    stderr: str
    seconds: float
    where: str

    @property
    def timed_out(self) -> bool:
        return self.exit_code is None


class ScriptUnavailable(HostPreconditionError):
    """The runtime has no engine Python to run a script with here (the image is not present, or
    has no python3): the probe cannot be asked, which is not a finding about the plan."""


class Runtime(Protocol):
    """A way to run the plan's server. Implementations live in this package, one module each,
    and are registered in m31ctl.runtime.RUNTIMES."""

    name: str
    # The doctor checks that gate a launch on this runtime (deploy.py runs them first).
    gates: tuple[CheckId, ...]
    # Whether it launches a P/D group (prefill, decode, router) as one deployment.
    runs_groups: bool

    def dry_run(self, deployment: Deployment) -> DryRun: ...

    def launch(self, deployment: Deployment, options: LaunchOptions) -> LaunchResult:
        """Converge on the plan: create, adopt, leave unchanged, recreate (after confirmation) or
        refuse; then wait until the served model answers unless options.detach."""
        ...

    def servers(self) -> list[ServerStatus]: ...

    def foreign(self, name: str) -> bool:
        """A server by that name exists here and m31ctl did not start it (never touched)."""
        ...

    def logs(self, name: str, follow: bool, tail: int, write: Callable[[str], None]) -> None: ...

    def stop(self, name: str, timeout: int | None, keep: bool, report: Reporter) -> None:
        """Stop the named server; returns only when it no longer runs (else raises)."""
        ...

    def bench_runner(self, deployment: Deployment, shared: Sequence[str] = ()) -> BenchRunner:
        """`vllm bench serve` with this runtime's engine (verify's load, m31ctl bench): the native
        Python, or a sibling container of the engine image. `shared`: host directories the
        benchmark reads (a generated dataset), at the same path wherever it runs."""
        ...

    def engine_identity(self, deployment: Deployment) -> str | None:
        """What names the engine this runtime would run, cheaply (no vLLM import): the image's
        ID, or the native Python with its vLLM's version and place. A deep-check pass is
        remembered under it (m31ctl/doctor/remembered.py); None when it cannot be told."""
        ...

    def run_engine_script(
        self,
        deployment: Deployment,
        script: Path,
        args: Sequence[str],
        timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> ScriptRun:
        """Run a standalone `script` (its folder readable beside it) with the Python the server
        would run on, with the server's settings (in the engine image with launch's GPUs,
        devices, shared memory, ulimits and mounts; or the native runtime's Python with the
        plan's environment) plus `env`. Past `timeout` it is killed with everything it
        started. Raises ScriptUnavailable when there is no engine Python to ask."""
        ...
