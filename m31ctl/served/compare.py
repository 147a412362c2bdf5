"""`m31ctl bench compare`: two or more bench reports side by side. Pure: report data in, a
Comparison out (the CLI reads the files, prints and plots).

Reports are compared point by point at equal concurrency, the first report being the base every
other is measured against, and by their best points at one SLO (the verdict): which run's best
point is better by the objective (per-GPU throughput, or cost per million output tokens), and
by how much. Runs of different workloads or models compare unlike things: refused unless forced.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from m31ctl.errors import InputError
from m31ctl.served import figures
from m31ctl.served.cost import Costing, Price, costing_from_json
from m31ctl.served.figures import THROUGHPUT, Choice, Limit, Objective, Point


class Report(NamedTuple):
    """One bench report as compare reads it (today's format; keys an older report lacks are None)."""

    label: str  # how the output names it: the file's name
    workload: str
    model: str | None  # model.path of the plan it was measured with
    host: str | None  # measured_on
    plan_hash: str | None
    image: str | None
    measured_at: str | None
    gpus: int
    nodes: int
    points: tuple[Point, ...]
    frontier: tuple[int, ...]
    slo: tuple[Limit, ...]  # the SLO the run was given
    costing: Costing | None
    choice: Choice  # its best point at the comparison's SLO (compare() sets it)

    def point(self, concurrency: int) -> Point | None:
        return next((p for p in self.points if p.concurrency == concurrency), None)

    def measured_with(self) -> dict[str, Any]:
        return {
            "report": self.label,
            "host": self.host,
            "plan_hash": self.plan_hash,
            "image": self.image,
            "measured_at": self.measured_at,
            "workload": self.workload,
            "model": self.model,
            "gpus": self.gpus,
            "price": self.costing.price.describe() if self.costing else None,
        }


def _text(data: Mapping[str, Any], key: str) -> str | None:
    value = data.get(key)
    return value if isinstance(value, str) and value else None


def read_report(label: str, data: Any) -> Report:
    """A report from its parsed JSON; not a bench report: bad input naming the file."""
    if not isinstance(data, dict) or not isinstance(data.get("points"), list) or "workload" not in data:
        raise InputError(
            "not a bench report (no workload and points)", where=label, hint="m31ctl bench -o writes one"
        )
    try:
        points = tuple(figures.point_from_json(p) for p in data["points"] if isinstance(p, dict))
    except (TypeError, ValueError) as exc:
        raise InputError(f"a point of this bench report cannot be read: {exc}", where=label) from None
    slo = data.get("slo") if isinstance(data.get("slo"), dict) else {}
    try:
        limits = figures.parse_slo(",".join(f"{k}={v}" for k, v in slo.items())) if slo else ()
    except InputError as exc:
        raise InputError(f"its SLO cannot be read: {exc.message}", where=label) from None
    model = data.get("model")
    gpus = data.get("gpus")
    nodes = (data.get("cost") or {}).get("nodes") if isinstance(data.get("cost"), dict) else None
    nodes = data.get("nodes", nodes)
    return Report(
        label=label,
        workload=str(data["workload"]),
        model=_text(model, "path") if isinstance(model, dict) else None,
        host=_text(data, "measured_on"),
        plan_hash=_text(data, "plan_hash"),
        image=_text(data, "image"),
        measured_at=_text(data, "measured_at"),
        gpus=gpus if isinstance(gpus, int) and gpus > 0 else 1,
        nodes=nodes if isinstance(nodes, int) and nodes > 0 else 1,
        points=points,
        frontier=figures.frontier(points),
        slo=limits,
        costing=costing_from_json(data.get("cost")),
        choice=Choice(None, "not compared"),
    )


def differences(reports: Sequence[Report]) -> list[str]:
    """What makes the reports unlike (different workloads or models), one line each."""
    found: list[str] = []
    facts: tuple[tuple[str, Callable[[Report], str | None]], ...] = (
        ("workload", lambda r: r.workload),
        ("model", lambda r: r.model),
    )
    for what, get in facts:
        values = {r.label: get(r) for r in reports if get(r) is not None}
        if len(set(values.values())) > 1:
            found.append(
                f"different {what}s: " + ", ".join(f"{label} {value!r}" for label, value in values.items())
            )
    return found


# The figures compared point by point: (key, label, unit, higher is better, the point's value).
FIGURES: tuple[tuple[str, str, str, bool, Callable[[Point], float | None]], ...] = (
    ("tok_s_per_user", "per-user speed", "tok/s", True, lambda p: p.tok_s_per_user),
    ("tok_s_per_gpu", "per-GPU throughput", "tok/s/GPU", True, lambda p: p.tok_s_per_gpu),
    ("ttft_p50_ms", "p50 TTFT", "ms", False, lambda p: p.ttft_p50_ms),
    ("ttft_p99_ms", "p99 TTFT", "ms", False, lambda p: p.ttft_p99_ms),
    ("tpot_p50_ms", "p50 TPOT", "ms", False, lambda p: p.tpot_p50_ms),
    ("tpot_p99_ms", "p99 TPOT", "ms", False, lambda p: p.tpot_p99_ms),
)
COST_KEY = "cost_per_million_output"


def figure_values(report: Report, point: Point) -> dict[str, float | None]:
    values: dict[str, float | None] = {
        key: get(point) if point.complete else None for key, *_, get in FIGURES
    }
    values[COST_KEY] = report.costing.per_million_output(point) if report.costing and point.complete else None
    return values


def change(base: float | None, other: float | None) -> float | None:
    """(other - base) / base, or None when either is missing or the base is 0."""
    if base is None or other is None or base == 0:
        return None
    return round((other - base) / base, 4)


class Row(NamedTuple):
    """One concurrency: each report's figures (None where it did not measure that point) and
    each later report's change against the first."""

    concurrency: int
    values: tuple[dict[str, float | None] | None, ...]
    changes: tuple[dict[str, float | None] | None, ...]  # one per report after the first


class ComparisonVerdict(NamedTuple):
    objective: str
    slo: tuple[Limit, ...]
    slo_from: str  # "given", a report's label, or "none"
    best: str | None  # the label of the report whose best point wins
    margin: float | None  # how much better than the first report's best (a fraction), for `best`
    text: str


class Comparison(NamedTuple):
    reports: tuple[Report, ...]
    rows: tuple[Row, ...]
    verdict: ComparisonVerdict
    forced: tuple[str, ...]  # the differences --force let through
    notes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        keys = [key for key, *_ in FIGURES] + [COST_KEY]
        return {
            "reports": [r.measured_with() for r in self.reports],
            "points": [
                {
                    "concurrency": row.concurrency,
                    "values": {r.label: v for r, v in zip(self.reports, row.values, strict=True)},
                    "change_vs": self.reports[0].label,
                    "changes": {r.label: c for r, c in zip(self.reports[1:], row.changes, strict=True)},
                }
                for row in self.rows
            ],
            "figures": keys,
            "best": {
                r.label: {**r.choice.to_json(), "value": _objective_value(self.verdict.objective, r)}
                for r in self.reports
            },
            "verdict": {
                "objective": self.verdict.objective,
                "slo": {limit.key: limit.value for limit in self.verdict.slo},
                "slo_from": self.verdict.slo_from,
                "best": self.verdict.best,
                "margin": self.verdict.margin,
                "text": self.verdict.text,
            },
            "forced": list(self.forced),
            "notes": list(self.notes),
        }


def _objective_value(objective: str, report: Report) -> float | None:
    point = report.choice.point
    if point is None:
        return None
    return _objective_for(objective, report).value(point)


# --pick for compare, as for bench: what the verdict compares.
def _objective_for(name: str, report: Report) -> Objective:
    if name == "cost" and report.costing is not None:
        return report.costing.objective()
    return THROUGHPUT


def compare(
    reports: Sequence[Report],
    slo: tuple[Limit, ...] | None,
    pick: str = "throughput",
    price: Price | None = None,
    force: bool = False,
) -> Comparison:
    """The reports side by side. `slo` None: the first report's own SLO; `price` reprices every
    report (each with its own GPUs and nodes), else each keeps the price it recorded."""
    if len(reports) < 2:
        raise InputError(
            "bench compare needs at least two reports", hint="m31ctl bench compare A.json B.json"
        )
    unlike = differences(reports)
    if unlike and not force:
        raise InputError(
            unlike[0] + " (" + "; ".join(unlike[1:]) + ")" if len(unlike) > 1 else unlike[0],
            hint="compare runs of one workload and model, or pass --force to compare them anyway",
        )
    notes: list[str] = []
    if price is not None:
        reports = [r._replace(costing=Costing(price, r.gpus, r.nodes)) for r in reports]
    if pick == "cost":
        unpriced = [r.label for r in reports if r.costing is None]
        if unpriced:
            raise InputError(
                f"--pick cost needs a price for {', '.join(unpriced)} (its report records none)",
                hint="add --gpu-hour PRICE or --node-hour PRICE",
            )
    if slo is None:
        slo, slo_from = reports[0].slo, (reports[0].label if reports[0].slo else "none")
        others = [r.label for r in reports[1:] if r.slo != reports[0].slo]
        if others:
            notes.append(f"{', '.join(others)} ran with another SLO; the verdict uses {reports[0].label}'s")
    else:
        slo_from = "given"
    chosen = tuple(r._replace(choice=figures.pick(r.points, slo, _objective_for(pick, r))) for r in reports)
    return Comparison(
        chosen, _rows(chosen), _verdict(chosen, slo, slo_from, pick), tuple(unlike), tuple(notes)
    )


def _rows(reports: Sequence[Report]) -> tuple[Row, ...]:
    rows = []
    for concurrency in sorted({p.concurrency for r in reports for p in r.points}):
        values = []
        for report in reports:
            point = report.point(concurrency)
            values.append(figure_values(report, point) if point is not None else None)
        base = values[0]
        changes = tuple(
            None if base is None or other is None else {key: change(base[key], other[key]) for key in base}
            for other in values[1:]
        )
        rows.append(Row(concurrency, tuple(values), changes))
    return tuple(rows)


def _verdict(
    reports: Sequence[Report], slo: tuple[Limit, ...], slo_from: str, pick: str
) -> ComparisonVerdict:
    at = "the SLO " + ",".join(f"{limit.key}={limit.value:g}" for limit in slo) if slo else "no SLO"
    scored = [(r, _objective_for(pick, r)) for r in reports if r.choice.point is not None]
    objective_name = "cost" if pick == "cost" else "throughput"
    if not scored:
        return ComparisonVerdict(
            objective_name, slo, slo_from, None, None, f"no report has a point that meets {at}"
        )
    winner, objective = max(scored, key=lambda item: item[1].rank(item[0].choice.point))  # type: ignore[arg-type]
    base = reports[0]
    best = winner.choice.point
    assert best is not None

    def shown(report: Report) -> str:
        point = report.choice.point
        assert point is not None
        return f"{report.label} (concurrency {point.concurrency}: {_objective_for(pick, report).describe(point)})"

    if base.choice.point is None:
        text = f"at {at}: only {', '.join(shown(r) for r, _ in scored)} meet it; {base.label} has no point that does"
        return ComparisonVerdict(objective_name, slo, slo_from, winner.label, None, text)
    base_value = _objective_for(pick, base).value(base.choice.point)
    win_value = objective.value(best)
    if winner is base or base_value is None or win_value is None:
        others = [r for r, _ in scored if r is not base]
        trail = "; ".join(shown(r) for r in others) or "no other report meets it"
        return ComparisonVerdict(
            objective_name, slo, slo_from, base.label, 0.0, f"at {at}: {shown(base)} is best ({trail})"
        )
    # Better by: throughput higher by this share, cost lower by this share.
    margin = (
        (win_value - base_value) / base_value if pick != "cost" else (base_value - win_value) / base_value
    )
    how = "higher throughput" if pick != "cost" else "cheaper"
    text = f"at {at}: {shown(winner)} beats {shown(base)} by {margin:.1%} ({how})"
    return ComparisonVerdict(objective_name, slo, slo_from, winner.label, round(margin, 4), text)
