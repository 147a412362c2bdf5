"""What the commands share below the CLI (issue 52): the plan's one Deployment as a command
asks for it (resolved, derived, fitted, its owned flags refused, its argv validated), and results
of no stage of their own. The CLI parses, calls one of these (or a stage's own function) and
prints what it returned."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from m31ctl.deployment import Deployment
    from m31ctl.doctor import DoctorReport
    from m31ctl.plan import PlanRequest


def deployment(request: PlanRequest, validate: bool = True, fit: bool = True) -> Deployment:
    """The request's one Deployment; with `fit`, refused when the hardware cannot hold its layout
    (exit 6, as launch's preflight); refused when engine.extra_args sets a flag m31ctl owns (exit
    2, whatever the command: every engine's argv would carry it); its argv checked against the
    engine's schema unless --no-validate."""
    # lazy: the plan's modules load for a command that plans, not for version's result (Version)
    from m31ctl.deployment import derive, require_fit
    from m31ctl.engine.adapter import build_invocation, refuse_owned_flags
    from m31ctl.plan import resolve

    plan = resolve(request)
    found = derive(plan)
    if fit:
        require_fit(found)
        # lazy: capacity's model loads for a command that plans
        from m31ctl.capacity.host_tier import require_host_memory

        require_host_memory(found)  # the prefix cache's host tier: the host's memory, /dev/shm
    refuse_owned_flags(plan)
    if validate:
        # lazy: the engine's schema check, only when asked for
        from m31ctl.engine.validate import check_plan_engine

        source = plan.provenance.get("engine.extra_args")
        for engine in found.engines:  # a P/D group: each role's engine
            check_plan_engine(
                build_invocation(engine),
                plan.settings.engine.schema_version,
                plan.settings.engine.extra_args,
                str(source) if source else None,
            )
    return found


def doctor_report(
    request: Callable[[], PlanRequest] | None,
    probed_hardware: bool,
    deep: bool,
    locked: Path | None,
    runtime: str,
) -> DoctorReport:
    """doctor's report on this host: for the plan `request` makes (without one, the probed host's
    default plan), on the probed hardware when `probed_hardware` (no --hardware given), with
    `deep` the engine and an all-reduce run on the plan's GPUs in `runtime`."""
    # lazy: doctor's checks and the probe load for doctor alone
    from m31ctl.doctor import diagnose
    from m31ctl.probe import detect
    from m31ctl.runtime import get_runtime

    probe = detect()
    asked = None
    if request is not None:
        asked = request()
        if probed_hardware:
            asked = asked._replace(hardware=probe.hardware)
    get_runtime(runtime)  # an unknown runtime is bad input
    return diagnose(
        asked,
        probe,
        deep=runtime if deep else None,
        locked=locked,
        files=asked.files if asked else (),
        runtime=runtime,
    )


@dataclass(frozen=True)
class Version:
    """version's result."""

    version: str

    def to_json(self) -> dict[str, str]:
        return {"version": self.version}
