"""`m31ctl capacity`: the plan's fit, the longest context, and a comparison table."""

from __future__ import annotations

from pathlib import Path

from m31ctl.capacity.fit import comparison, plan_fit, plan_layout, plan_longest_context, profile_layouts
from m31ctl.capacity.model import parse_context
from m31ctl.cli.output import console, emit_json, table
from m31ctl.cli.views import capacity_line, fit_json, sensitivity_line
from m31ctl.deployment import Deployment


def run(
    deployment: Deployment, context_text: str, sequences: int | None, plot: Path | None, as_json: bool
) -> None:
    plan = deployment.plan
    context = parse_context(context_text)
    if plot is not None:
        from m31ctl.cli.figure import check_path

        check_path(plot)
    fit = plan_fit(deployment, context)
    longest = plan_longest_context(deployment, sequences) if sequences is not None else None
    rows = comparison(deployment, context, profile_layouts(deployment))
    if plot is not None:
        from m31ctl.cli.plot import draw

        draw(deployment, profile_layouts(deployment), plot, sensitivity_line(fit))
    if as_json:
        emit_json(
            {
                "hardware": f"{plan.hardware.count}x {plan.hardware.product}",
                "recipe": plan.recipe.recipe,
                "profile": plan.profile,
                "layout": plan_layout(deployment).label(),
                "fit": fit_json(fit),
                "longest_context": {"sequences": sequences, "tokens": longest}
                if sequences is not None
                else None,
                "comparison": [
                    {**fit_json(r.fit), "model": r.model, "kv_dtype": r.kv_dtype, "layout": r.layout}
                    for r in rows
                ],
                "plot": str(plot) if plot else None,
            }
        )
        return
    out = console()
    hw = plan.hardware
    out.print(
        f"{hw.count}x {hw.product}, recipe {plan.recipe.recipe}, profile {plan.profile} ({fit.layout}), "
        f"{plan.model.display_name}, {plan.settings.cache.kv_dtype} KV cache"
    )
    out.print(capacity_line(fit))
    if fit.fits:
        per_token = fit.kv_bytes_per_token
        out.print(
            f"per GPU: weights {fit.weights_per_gpu_bytes / 1e9:.1f} GB, KV budget "
            f"{fit.kv_budget_per_gpu_bytes / 1e9:.1f} GB; per token {per_token.total:,.0f} bytes "
            f"(main attention {per_token.main_attention:,.0f} + indexer {per_token.indexer:,.0f}), "
            f"{fit.kv_bytes_per_sequence / 1e9:.2f} GB a sequence"
        )
    for band in (sensitivity_line(fit), sensitivity_line(fit, published=True)):
        if band:
            out.print(band)
    if longest is not None:
        out.print(f"longest context for {sequences} sequences: {longest} tokens")
    t = table(
        f"Resident sequences at {context} tokens",
        ["model", "KV cache", "layout", "sequences", "published basis"],
    )
    for r in rows:
        basis = r.fit.sequences_published_basis
        t.add_row(r.model, r.kv_dtype, r.layout, str(r.fit.sequences), "-" if basis is None else str(basis))
    out.print(t)
    if plot:
        out.print(f"plot written to {plot}")
