"""`m31ctl doctor`: can this host run the plan, and what to fix."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from m31ctl.doctor.base import CheckResult, Context, run_checks
from m31ctl.doctor.checks import all_checks
from m31ctl.errors import HostPreconditionError, UnsupportedHardware
from m31ctl.plan import Plan, PlanRequest, resolve
from m31ctl.probe import ProbeReport, detect


@dataclass(frozen=True)
class DoctorReport:
    plan: Plan | None
    plan_error: str | None
    results: tuple[CheckResult, ...]

    @property
    def failed(self) -> bool:
        return any(r.status == "fail" for r in self.results)

    def summary(self) -> dict[str, int]:
        counts = {"ok": 0, "warn": 0, "fail": 0, "skip": 0}
        for r in self.results:
            counts[r.status] += 1
        return counts


def plan_for_host(request: PlanRequest | None, probe: ProbeReport) -> tuple[Plan | None, str | None]:
    """Resolve the plan; a host that cannot have one (no GPU, no recipe) is a finding, not a crash."""
    try:
        return resolve(request or PlanRequest(hardware=probe.hardware)), None
    except (UnsupportedHardware, HostPreconditionError) as exc:
        return None, exc.one_line()


def diagnose(
    request: PlanRequest | None,
    probe: ProbeReport | None = None,
    docker: Callable[[], Any] | None = None,
) -> DoctorReport:
    """Run every check. `docker` connects to the Engine (the default: the local one)."""
    probe = probe or detect()
    plan, error = plan_for_host(request, probe)
    ctx = Context(plan=plan, plan_error=error, probe=probe, env=os.environ, docker=docker)
    return DoctorReport(plan, error, tuple(run_checks(all_checks(), ctx)))


def preflight(plan: Plan, probe: ProbeReport | None = None) -> list[CheckResult]:
    """The doctor's checks that gate `launch`; raises on the first class of failure."""
    from m31ctl.doctor.checks import PREFLIGHT
    from m31ctl.errors import DockerUnreachable

    probe = probe or detect()
    ctx = Context(plan=plan, plan_error=None, probe=probe, env=os.environ)
    results = run_checks([c for c in all_checks() if c.id in PREFLIGHT], ctx)
    failed = [r for r in results if r.status == "fail"]
    docker = next((r for r in failed if r.id == "docker"), None)
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


def print_report(report: DoctorReport) -> None:
    from rich.text import Text

    from m31ctl.output import console, table

    out = console()
    if report.plan is None:
        out.print(Text(f"No plan for this host: {report.plan_error}"))
    else:
        p = report.plan
        out.print(
            f"Plan {p.hash}: recipe {p.recipe.recipe}, variant {p.variant}, profile {p.profile}, "
            f"{p.gpus_needed} GPUs"
        )
    colors = {"ok": "green", "warn": "yellow", "fail": "red", "skip": "dim"}
    t = table(None, ["check", "status", "finding", "remedy"])
    for r in report.results:
        t.add_row(r.title, Text(r.status, style=colors[r.status]), Text(r.message), Text(r.remedy))
    out.print(t)
    s = report.summary()
    out.print(f"{s['ok']} ok, {s['warn']} warn, {s['fail']} fail, {s['skip']} skip")


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
