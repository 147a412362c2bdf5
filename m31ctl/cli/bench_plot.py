"""`m31ctl bench --plot`: the measured points, per-user speed against per-GPU throughput, with
the frontier, the SLO's region and the chosen point (matplotlib, optional); with a price, each
point's cost per million output tokens beside its label. `bench compare` draws several sweeps'
frontiers on one such plot (draw_compare)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from m31ctl.cli.figure import pyplot, save
from m31ctl.served.figures import Limit, Point, violations
from m31ctl.served.sweep import Sweep

if TYPE_CHECKING:
    from m31ctl.served.compare import Report
    from m31ctl.served.cost import Costing


def slo_speed_floor(slo: tuple[Limit, ...]) -> tuple[float, str] | None:
    """The per-user speed the SLO implies on the x axis, and how: a TPOT limit of t ms asks for
    at least 1000/t tokens/s per user (the axis is 1000 / mean TPOT, so this is the bound for
    the mean; the limit itself is checked on each point, shown by its marker)."""
    floors: list[tuple[float, str]] = []
    for limit in slo:
        if limit.key.startswith("tpot_"):
            floors.append((1000.0 / limit.value, f"{limit.key} <= {limit.value:g}"))
        elif limit.key == "min_tok_s_per_user":
            floors.append((limit.value, f"{limit.key} >= {limit.value:g}"))
    return max(floors) if floors else None


def draw(sweep: Sweep, title: str, path: Path, costing: Costing | None = None) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(10, 5.5), dpi=110)
    floor = slo_speed_floor(sweep.slo)
    speeds = [p.tok_s_per_user for p in sweep.points] + ([floor[0] * 1.1] if floor else [])
    axis = _speed_axis(ax, speeds)
    if floor is not None:
        ax.axvspan(floor[0], axis.right, color="tab:green", alpha=0.08, label=f"SLO region ({floor[1]})")
    _points(ax, sweep, costing)
    if sweep.choice.point is not None:
        _chosen(ax, sweep.choice.point, axis.share(sweep.choice.point.tok_s_per_user))
    # Room above the points for the chosen point's label.
    ax.set_ylim(0, max([*(p.tok_s_per_gpu for p in sweep.points), 1.0]) * 1.35)
    gpus = f"{sweep.gpus} GPU{'s' if sweep.gpus != 1 else ''}"
    ax.set_ylabel(f"throughput per GPU (input + output tok/s, {gpus})")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    _legend(ax)
    note = "o: meets the SLO; x: does not (or a request failed). Blue: on the frontier."
    if not sweep.slo:
        note = "No SLO given: every complete point qualifies. Blue: on the frontier."
    if costing is not None:
        note += f" Cost per million output tokens at {costing.price.describe()} (GPU rental only)."
    fig.text(0.01, 0.01, note, fontsize=7, ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save(plt, fig, path)


def _legend(ax: Any) -> None:
    """Outside the axes (points may fall in any corner), and only when something is labelled:
    matplotlib warns on an empty legend."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))


def point_label(point: Point, costing: Costing | None) -> str:
    """c=4, and with a price its cost per million output tokens: c=4, 0.41 USD/M"""
    label = f"c={point.concurrency}"
    value = costing.per_million_output(point) if costing is not None else None
    if costing is not None and value is not None:
        label += f", {value:.3g} {costing.price.currency}/M"
    return label


def _points(ax: Any, sweep: Sweep, costing: Costing | None = None) -> None:
    """Every point (o meets the SLO, x does not; blue on the frontier) and the frontier's line."""
    edge = sorted(
        (p for p in sweep.points if p.concurrency in sweep.frontier), key=lambda p: p.tok_s_per_user
    )
    if edge:
        xs, ys = [p.tok_s_per_user for p in edge], [p.tok_s_per_gpu for p in edge]
        ax.plot(xs, ys, "-", color="tab:blue", label="frontier")
    for p in sweep.points:
        ax.scatter(
            [p.tok_s_per_user],
            [p.tok_s_per_gpu],
            s=60,
            marker="x" if violations(p, sweep.slo) else "o",
            color="tab:blue" if p.concurrency in sweep.frontier else "tab:gray",
            zorder=3,
        )
        where = (p.tok_s_per_user, p.tok_s_per_gpu)
        ax.annotate(point_label(p, costing), where, textcoords="offset points", xytext=(6, -12), fontsize=8)


def _chosen(ax: Any, chosen: Point, share: float) -> None:
    """The chosen point ringed and labelled; `share`: how far along the x axis it lies (0 to 1)."""
    where = (chosen.tok_s_per_user, chosen.tok_s_per_gpu)
    ax.scatter(*where, s=220, facecolors="none", edgecolors="tab:red", linewidths=2, zorder=4, label="chosen")
    # The label above the point, aligned away from the nearer side so it stays inside.
    align = "left" if share < 0.35 else "right" if share > 0.65 else "center"
    ax.annotate(
        f"chosen: concurrency {chosen.concurrency}\n"
        f"{chosen.tok_s_per_gpu:.4g} tok/s/GPU, {chosen.tok_s_per_user:.4g} tok/s/user",
        where,
        textcoords="offset points",
        xytext=(0, 30),
        ha=align,
        fontsize=8,
        color="tab:red",
        arrowprops={"arrowstyle": "->", "color": "tab:red"},
    )


# One colour a report, in order (matplotlib's default cycle, named so the legend and lines agree).
COMPARE_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def draw_compare(reports: Sequence[Report], title: str, path: Path) -> None:
    """Each report's points and frontier on one plot, one colour each; its best point at the
    verdict's SLO ringed."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 5.5), dpi=110)
    measured = [p for r in reports for p in r.points if p.complete]
    top = max([*(p.tok_s_per_gpu for p in measured), 1.0]) * 1.25
    for index, report in enumerate(reports):
        colour = COMPARE_COLOURS[index % len(COMPARE_COLOURS)]
        edge = sorted(
            (p for p in report.points if p.concurrency in report.frontier), key=lambda p: p.tok_s_per_user
        )
        if edge:
            ax.plot(
                [p.tok_s_per_user for p in edge],
                [p.tok_s_per_gpu for p in edge],
                "-",
                color=colour,
                label=report.label,
            )
        for p in report.points:
            if not p.complete:
                continue
            ax.scatter([p.tok_s_per_user], [p.tok_s_per_gpu], s=50, color=colour, zorder=3)
            where = (p.tok_s_per_user, p.tok_s_per_gpu)
            ax.annotate(
                point_label(p, report.costing),
                where,
                textcoords="offset points",
                xytext=(6, -12 if index % 2 == 0 else 6),  # alternate sides: nearby runs' labels
                fontsize=7,
                color=colour,
            )
        best = report.choice.point
        if best is not None:
            where = (best.tok_s_per_user, best.tok_s_per_gpu)
            ax.scatter(*where, s=220, facecolors="none", edgecolors=colour, linewidths=2, zorder=4)
    _speed_axis(ax, [p.tok_s_per_user for p in measured])
    ax.set_ylim(0, top)
    ax.set_ylabel("throughput per GPU (input + output tok/s)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    _legend(ax)
    fig.text(
        0.01,
        0.01,
        "Lines: each report's frontier. Rings: each report's best point at the verdict's SLO. "
        "Labels: concurrency (and cost per million output tokens where priced).",
        fontsize=7,
        ha="left",
        va="bottom",
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save(plt, fig, path)


# Per-user speeds spanning more than this factor get a logarithmic axis: a stream whose tokens
# arrive in one burst (a CPU rehearsal's, a mean TPOT near 0) is 100x faster than the rest, and a
# linear axis would crowd every other point against zero.
LOG_SPAN = 30.0


class SpeedAxis(NamedTuple):
    left: float
    right: float
    log: bool

    def share(self, speed: float) -> float:
        """Where `speed` lies along the axis, 0 (left) to 1 (right)."""
        if self.log:
            return math.log(max(speed, self.left) / self.left) / math.log(self.right / self.left)
        return speed / self.right


def _speed_axis(ax: Any, speeds: list[float]) -> SpeedAxis:
    """The per-user speed axis: from 0, or logarithmic when the speeds span more than LOG_SPAN."""
    positive = [s for s in speeds if s > 0] or [1.0]
    low, high = min(positive), max(positive)
    label = "per-user speed (output tok/s per user = 1000 / mean TPOT)"
    if high / low > LOG_SPAN:
        axis = SpeedAxis(low / 1.5, high * 1.5, True)
        ax.set_xscale("log")
        label += ", log scale"
    else:
        axis = SpeedAxis(0.0, high * 1.15, False)
    ax.set_xlim(axis.left, axis.right)
    ax.set_xlabel(label)
    return axis
