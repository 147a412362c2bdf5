"""`m31ctl capacity --plot`: resident sequences against context, per layout (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path

from m31ctl.capacity import Layout, resident_sequences
from m31ctl.errors import InputError
from m31ctl.plan import Plan
from m31ctl.planning import memory_inputs
from m31ctl.recipes import get_model

CONTEXTS = [2**k for k in range(13, 21)]  # 8K .. 1M


def draw(plan: Plan, layouts: dict[str, Layout], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("--plot needs matplotlib", hint="pip install 'm31ctl[plot]'") from None
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for model in [plan.model, *(get_model(m) for m in plan.model.compare_with)]:
        for dtype in model.kv_bytes_per_token:
            for name, layout in layouts.items():
                if layout.gpus > plan.hardware.count:
                    continue
                inputs = memory_inputs(plan, model, dtype)
                counts = [resident_sequences(inputs, layout, c).sequences for c in CONTEXTS]
                style = "-" if model.id == plan.model.id else "--"
                ax.plot(
                    CONTEXTS,
                    counts,
                    style,
                    marker="o",
                    label=f"{model.display_name}, {dtype} KV, {name} ({layout.label()})",
                )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_ylim(bottom=0.8)  # 0 (does not fit) falls below the axis
    ax.set_xticks(CONTEXTS, [f"{c // 1024}K" for c in CONTEXTS])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("resident sequences")
    hw = plan.hardware
    ax.set_title(f"{hw.count}x {hw.product}: resident sequences by context")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
