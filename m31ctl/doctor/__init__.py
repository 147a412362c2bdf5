"""`m31ctl doctor`: can this host run the plan, and what to fix."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m31ctl.checks import CheckStatus
from m31ctl.deployment import Deployment, derive
from m31ctl.doctor.base import CheckContext, CheckResult, EngineScripts, run_checks
from m31ctl.doctor.checks import all_checks
from m31ctl.doctor.remembered import key_for, remember
from m31ctl.errors import DockerUnreachable, HostPreconditionError, UnsupportedHardware
from m31ctl.hardware import Hardware
from m31ctl.plan import Plan, PlanRequest, resolve
from m31ctl.probe import ProbeReport, detect
from m31ctl.runtime import get_runtime
from m31ctl.runtime.gates import CheckId


@dataclass(frozen=True)
class DoctorReport:
    plan: Plan | None
    plan_error: str | None
    results: tuple[CheckResult, ...]

    @property
    def failed(self) -> bool:
        return any(r.failed for r in self.results)

    def summary(self) -> dict[str, int]:
        counts = {status.value: 0 for status in CheckStatus}
        for r in self.results:
            counts[r.status.value] += 1
        return counts


def plan_for_host(request: PlanRequest | None, probe: ProbeReport) -> tuple[Deployment | None, str | None]:
    """Resolve the plan and its Deployment; a host that cannot have one (no GPU, no recipe) is a
    finding, not a crash. Too few GPUs is not refused here: the gpus check reports it."""
    try:
        return derive(resolve(request or PlanRequest(hardware=probe.hardware))), None
    except (UnsupportedHardware, HostPreconditionError) as exc:
        return None, exc.one_line()


def diagnose(
    request: PlanRequest | None,
    probe: ProbeReport | None = None,
    docker: Callable[[], Any] | None = None,
    deep: str | None = None,
    scripts: EngineScripts | None = None,
    locked: Path | None = None,
    files: tuple[Path, ...] = (),
    runtime: str | None = None,
) -> DoctorReport:
    """Run every check. `docker` connects to the Engine (the default: the local one); `deep` (a
    runtime's name) adds the checks that run the engine's Python on the plan's GPUs, through that
    runtime unless `scripts` stands in for it; `locked` adds the check against that lock file
    (`files`: the -f files that fed the plan); `runtime`: the runtime the plan is checked for
    (checks its launches are not gated on skip)."""
    probe = probe or detect()
    deployment, error = plan_for_host(request, probe)
    ctx = CheckContext(
        deployment=deployment,
        plan_error=error,
        probe=probe,
        env=os.environ,
        docker=docker,
        deep=deep,
        runtime=runtime,
        scripts=scripts,
        lock_path=locked,
        plan_files=files,
        named_host=request.hardware if request is not None and request.hardware.simulated else None,
    )
    checks = [c for c in all_checks(deployment) if (deep or not c.deep) and (locked or not c.locked)]
    plan = deployment.plan if deployment is not None else None
    results = tuple(run_checks(checks, ctx))
    if deep and deployment is not None and scripts is None:
        # A pass here is the same evidence a launch's preflight gathers: the launch after it
        # need not gather it again (doctor/remembered.py).
        key = key_for(get_runtime(deep), deployment, probe.hardware, os.environ)
        if key is not None:
            remember(key, deployment, results)
    return DoctorReport(plan, error, results)


@dataclass(frozen=True)
class PlanDiagnosis:
    """doctor's report on an already-resolved plan, with the probe it ran against."""

    report: DoctorReport
    probe_hardware: Hardware


def diagnose_plan(deployment: Deployment) -> PlanDiagnosis:
    probe = detect()
    ctx = CheckContext(deployment=deployment, plan_error=None, probe=probe, env=os.environ)
    checks = [c for c in all_checks(deployment) if not c.locked]
    report = DoctorReport(deployment.plan, None, tuple(run_checks(checks, ctx)))
    return PlanDiagnosis(report, probe.hardware)


def preflight(
    deployment: Deployment,
    check_ids: tuple[CheckId, ...],
    env: Mapping[str, str],
    probe: ProbeReport | None = None,
    deep: str | None = None,
) -> list[CheckResult]:
    """The doctor's checks that gate a launch (each runtime names its own), plus the deep ones
    (engine and all-reduce on the plan's GPUs, where `deep` says) unless skipped; raises on
    failure, so nothing starts on a host that cannot run the plan."""

    probe = probe or detect()
    ctx = CheckContext(deployment=deployment, plan_error=None, probe=probe, env=env, deep=deep)
    chosen = [c for c in all_checks(deployment) if c.id in check_ids or (deep and c.deep)]
    results = run_checks(chosen, ctx)
    failed = [r for r in results if r.failed]
    docker = next((r for r in failed if r.id == CheckId.DOCKER.value), None)
    if docker is not None:
        raise DockerUnreachable(docker.message, hint=docker.remedy)
    if failed:
        first = failed[0]
        others = (
            f" (and {len(failed) - 1} more: {', '.join(r.id for r in failed[1:])})" if len(failed) > 1 else ""
        )
        raise HostPreconditionError(
            f"preflight check {first.id} failed: {first.message}{others}",
            hint=first.remedy or "run `m31ctl doctor` for the full report",
        )
    return results


def report_json(report: DoctorReport) -> dict[str, object]:
    p = report.plan
    return {
        "plan_hash": p.hash if p else None,
        "recipe": p.recipe.recipe if p else None,
        "plan_error": report.plan_error,
        "checks": [r.to_json() for r in report.results],
        "summary": report.summary(),
        "ok": not report.failed,
    }
