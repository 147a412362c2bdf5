"""`m31ctl capacity --plot`: resident sequences against context, per layout (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path

from m31ctl.capacity.fit import ComparisonRow, comparison
from m31ctl.capacity.memory import Sharding
from m31ctl.cli.figure import pyplot, save
from m31ctl.deployment import Deployment

CONTEXTS = [2**k for k in range(13, 21)]  # 8K .. 1M


def draw(
    deployment: Deployment,
    layouts: dict[str, Sharding],
    path: Path,
    note: str | None = None,
    max_context: int | None = None,
) -> None:
    """`note`: the sensitivity line of the plan's own figure, printed under the plot. The contexts
    drawn stop at `max_context`, the longest sequence the plan can serve."""
    plan = deployment.plan
    contexts = [c for c in CONTEXTS if max_context is None or c <= max_context] or CONTEXTS[:1]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    # The comparison's own rows at each context: what the table shows (and what the recipe's
    # rules allow, e.g. no NVFP4 cache on Hopper) is exactly what is drawn.
    series: dict[tuple[str, str, str], list[ComparisonRow]] = {}
    for context in contexts:
        for row in comparison(deployment, context, layouts):
            series.setdefault((row.model, row.kv_dtype, row.layout), []).append(row)
    for (model, dtype, layout), rows in series.items():
        style = "-" if model == plan.model.display_name else "--"
        counts = [r.fit.sequences for r in rows]
        line = ax.plot(contexts, counts, style, marker="o", label=f"{model}, {dtype} KV, {layout}")[0]
        basis = [r.fit.sequences_published_basis for r in rows]
        if all(b is not None for b in basis):
            ax.plot(
                contexts,
                [b or 0 for b in basis],
                ":",
                color=line.get_color(),
                linewidth=1,
                label=f"_basis {model} {dtype} {layout}",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.8)  # 0 (does not fit) falls below the axis
    ax.set_xticks(contexts, [f"{c // 1024}K" for c in contexts])
    ax.set_xlabel("context length (tokens)")
    hw = plan.hardware
    ax.set_title(f"{hw.count}x {hw.product}: resident sequences by context")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_ylabel("resident sequences")
    fig.tight_layout()
    legend = "Markers: what the engine holds; dotted: the launch post's basis (main attention only)."
    fig.subplots_adjust(bottom=0.18)
    fig.text(0.01, 0.01, f"{legend}\n{note}" if note else legend, fontsize=7, ha="left", va="bottom")
    save(plt, fig, path)
