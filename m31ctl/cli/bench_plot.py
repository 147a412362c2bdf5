"""`m31ctl bench --plot`: the measured points, per-user speed against per-GPU throughput, with
the frontier, the SLO's region and the chosen point (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from m31ctl.bench.figures import Limit, Point
from m31ctl.bench.sweep import Sweep
from m31ctl.cli.figure import pyplot, save


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


def draw(sweep: Sweep, title: str, path: Path) -> None:
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(10, 5.5), dpi=110)
    right = max([*(p.tok_s_per_user for p in sweep.points), 1.0]) * 1.15
    floor = slo_speed_floor(sweep.slo)
    if floor is not None:
        right = max(right, floor[0] * 1.1)
        ax.axvspan(floor[0], right, color="tab:green", alpha=0.08, label=f"SLO region ({floor[1]})")
    _points(ax, sweep)
    if sweep.choice.point is not None:
        _chosen(ax, sweep.choice.point, right)
    ax.set_xlim(0, right)
    # Room above the points for the chosen point's label.
    ax.set_ylim(0, max([*(p.tok_s_per_gpu for p in sweep.points), 1.0]) * 1.35)
    ax.set_xlabel("per-user speed (output tok/s per user = 1000 / mean TPOT)")
    gpus = f"{sweep.gpus} GPU{'s' if sweep.gpus != 1 else ''}"
    ax.set_ylabel(f"throughput per GPU (input + output tok/s, {gpus})")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    # Outside the axes: points may fall in any corner.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    note = "o: meets the SLO; x: does not (or a request failed). Blue: on the frontier."
    if not sweep.slo:
        note = "No SLO given: every complete point qualifies. Blue: on the frontier."
    fig.text(0.01, 0.01, note, fontsize=7, ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    save(plt, fig, path)


def _points(ax: Any, sweep: Sweep) -> None:
    """Every point (o meets the SLO, x does not; blue on the frontier) and the frontier's line."""
    from m31ctl.bench.figures import violations

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
        ax.annotate(f"c={p.concurrency}", where, textcoords="offset points", xytext=(6, -12), fontsize=8)


def _chosen(ax: Any, chosen: Point, right: float) -> None:
    where = (chosen.tok_s_per_user, chosen.tok_s_per_gpu)
    ax.scatter(*where, s=220, facecolors="none", edgecolors="tab:red", linewidths=2, zorder=4, label="chosen")
    # The label above the point, aligned away from the nearer side so it stays inside.
    share = chosen.tok_s_per_user / right
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
