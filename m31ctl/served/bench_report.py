"""`m31ctl bench`'s report from a finished sweep: what `bench compare` checks and shows, the
warnings, the comparison with a baseline, the cost, and the profile layer file's text for the
chosen point. Pure: the CLI writes the files and prints."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from m31ctl.deployment import layout_of
from m31ctl.plan import Plan
from m31ctl.served import figures, profile
from m31ctl.served.cost import Costing
from m31ctl.served.figures import Point
from m31ctl.served.sweep import Sweep


class BenchReport(NamedTuple):
    data: dict[str, Any]  # the JSON report (`bench -o`, the last --json line)
    worse: tuple[str, ...]  # what got worse than the baseline
    profile_text: str | None  # the chosen point as a plan layer file; None: none asked or chosen


def build(
    plan: Plan,
    found: Sweep,
    server_hash: str | None,
    baseline: Sequence[dict[str, Any]] | None,
    tolerance: float,
    costing: Costing | None,
    pick: str,
    when: datetime,
    want_profile: bool,
) -> BenchReport:
    fingerprint = profile.host_fingerprint(plan.hardware)
    report: dict[str, Any] = {
        **found.to_json(),
        # What `bench compare` checks and shows: the same model? measured on what?
        "model": {"path": plan.settings.model.path, "served_name": plan.settings.model.served_name},
        "image": plan.settings.engine.image,
        "nodes": layout_of(plan).nodes,
        "measured_on": fingerprint,
        "measured_at": when.isoformat(timespec="seconds"),
        "server_plan_hash": server_hash,
        "pick": pick,
        "warnings": _warnings(plan, found, server_hash),
    }
    if costing is not None:
        report["cost"] = costing.to_json(found.points, when.date().isoformat())
        for entry, point in zip(report["points"], found.points, strict=True):
            entry["cost"] = costing.figures(point)
    worse: tuple[str, ...] = ()
    if baseline is not None:
        worse, compared = figures.regressions(found.points, baseline, tolerance)
        report["regressions"] = {"compared_points": compared, "worse": list(worse), "tolerance": tolerance}
    chosen = found.choice.point
    text = None
    if want_profile and chosen is not None:
        origin = profile.provenance(fingerprint, when)
        data = plan.settings.parallelism.data
        notes = cost_notes(costing, chosen, when) if costing is not None else ()
        # Never more sequences than the layout's runtime rules allow (the plan would refuse it).
        limit = plan.max_num_seqs_limit
        text = profile.profile_yaml(chosen, found.workload, found.slo, origin, data, notes, limit)
    report["ok"] = chosen is not None and not worse
    return BenchReport(report, worse, text)


def _warnings(plan: Plan, found: Sweep, server_hash: str | None) -> list[str]:
    warnings = []
    if server_hash is not None and server_hash != plan.hash:
        warnings.append(
            f"the server runs plan {server_hash}; the figures are read with plan {plan.hash} (GPU count, max length)"
        )
    method = plan.settings.speculative.method
    silent = [p.concurrency for p in found.points if p.complete and p.spec is None]
    if method != "none" and silent:
        warnings.append(
            f"the plan speculates ({method}) but no drafts were counted on /metrics at concurrency "
            + ", ".join(map(str, silent))
        )
    return warnings


def plottable(found: Sweep) -> bool:
    """Whether a frontier plot would show anything: some point measured something (else the
    reason is each point's error, printed with the table)."""
    return any(p.error is None and p.completed for p in found.points)


def cell(value: float | None, digits: str = ".4g") -> str:
    return "-" if value is None else format(value, digits)


def cost_notes(costing: Costing, chosen: Point, when: datetime) -> tuple[str, ...]:
    """The profile's record of the price it assumed (a comment: the layer holds settings only)."""
    currency = costing.price.currency
    at = costing.per_million_output(chosen)
    return (
        f"cost: assumed {costing.price.describe()} on {when.date().isoformat()}, "
        f"{costing.per_hour:.4g} {currency}/hour for the plan;",
        f"at this point {cell(at)} {currency} per million output tokens (GPU rental only: "
        "no idle time, power or networking).",
    )
