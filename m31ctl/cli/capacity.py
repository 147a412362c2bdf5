"""`m31ctl capacity`: the plan's fit, the longest context, and a comparison table."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m31ctl.capacity.fit import (
    ComparisonRow,
    comparison,
    default_context,
    plan_fit,
    plan_layout,
    plan_longest_context,
    profile_layouts,
    within_limit,
)
from m31ctl.capacity.host_tier import HostTier, host_tier, tier_line
from m31ctl.capacity.memory import GIB, Fit, parse_context
from m31ctl.cli.figure import check_path
from m31ctl.cli.output import console, emit, text_view
from m31ctl.cli.plot import draw
from m31ctl.cli.screen import print_paragraph, print_table
from m31ctl.cli.views import capacity_line, fit_json, geometry_line, sensitivity_line
from m31ctl.deployment import Deployment


@dataclass(frozen=True)
class LongestContext:
    """`--sequences N`: the longest context N sequences hold (memory's answer, capped at `limit`)."""

    sequences: int
    tokens: int
    memory_tokens: int
    limit_tokens: int
    limit_source: str


@dataclass(frozen=True)
class CapacityShown:
    """capacity's result: the plan's fit at the context asked, the longest context for
    --sequences, and how the recipes' profiles and cache dtypes compare."""

    deployment: Deployment
    context: int
    fit: Fit
    longest: LongestContext | None
    rows: list[ComparisonRow]
    plot: Path | None
    # A P/D group's roles, each on its own layout: (role, its fit at the context).
    roles: tuple[tuple[str, Fit], ...] = ()
    # The prefix cache's host tier (cache.cpu_offload_gib) at the context; None without one.
    tier: HostTier | None = None

    def to_json(self) -> dict[str, Any]:
        plan = self.deployment.plan
        longest = self.longest
        return {
            "hardware": f"{plan.hardware.count}x {plan.hardware.product}",
            "recipe": plan.recipe.recipe,
            "profile": plan.profile,
            "layout": plan_layout(self.deployment).label(),
            "fit": fit_json(self.fit),
            "longest_context": {
                "sequences": longest.sequences,
                "tokens": longest.tokens,
                "memory_tokens": longest.memory_tokens,
                "limit_tokens": longest.limit_tokens,
                "limit_source": longest.limit_source,
            }
            if longest is not None
            else None,
            "comparison": [
                {**fit_json(r.fit), "model": r.model, "kv_dtype": r.kv_dtype, "layout": r.layout}
                for r in self.rows
            ],
            "plot": str(self.plot) if self.plot else None,
            "roles": {role: fit_json(fit) for role, fit in self.roles} or None,
            "host_tier": _tier_json(self.tier, self.fit) if self.tier else None,
        }


def _tier_json(tier: HostTier, fit: Fit) -> dict[str, Any]:
    """The host tier beside the GPU's pool: tokens and prefixes per engine and in all, bytes a
    token a rank (main + indexer, as the GPU pool stores them), host memory a rank and a host."""
    per_token = tier.bytes_per_token
    return {
        "gib_per_engine": tier.gib_per_engine,
        "engines": tier.engines,
        "engine_ranks": tier.engine_ranks,
        "context": tier.context,
        "tokens_per_engine": tier.tokens_per_engine,
        "tokens": tier.tokens_per_engine * tier.engines,
        "prefixes_per_engine": tier.prefixes_per_engine,
        "prefixes": tier.prefixes_per_engine * tier.engines,
        "gpu_kv_cache_tokens_per_engine": fit.kv_cache_tokens,
        "kv_bytes_per_token": {
            "per_gpu": True,
            "main_attention": round(per_token.main_attention, 2),
            "indexer": round(per_token.indexer, 2),
            "total": round(per_token.total, 2),
        },
        "host_memory_per_rank_gib": round(tier.bytes_per_rank / GIB, 2),
        "host_memory_per_host_gib": round(tier.bytes_per_host / GIB, 2),
        "in_dev_shm": tier.in_shm,
    }


def run(
    deployment: Deployment, context_text: str | None, sequences: int | None, plot: Path | None, as_json: bool
) -> None:
    # No --context: the default the plan can serve (never a refusal of a flag nobody typed).
    context = parse_context(context_text) if context_text is not None else default_context(deployment)
    limit, limit_source = within_limit(deployment, context, context_text or str(context))
    if plot is not None:
        check_path(plot)
    fit = plan_fit(deployment, context)
    longest = None
    if sequences is not None:
        memory_longest = plan_longest_context(deployment, sequences)
        # What memory would hold is not what the engine serves: one sequence is at most `limit` long.
        longest = LongestContext(sequences, min(memory_longest, limit), memory_longest, limit, limit_source)
    rows = comparison(deployment, context, profile_layouts(deployment))
    if plot is not None:
        draw(deployment, profile_layouts(deployment), plot, sensitivity_line(fit), max_context=limit)
    # Each P/D role's own capacity: prefill's KV tokens are the prompt tokens it holds in flight
    # until decode has pulled them; decode's sequences are what stays resident while it generates.
    group = deployment.disaggregated
    roles = (
        tuple(
            (role.kv_transfer.role.value, plan_fit(role, context)) for role in group.roles if role.kv_transfer
        )
        if group
        else ()
    )
    tier = host_tier(deployment, context)
    emit(CapacityShown(deployment, context, fit, longest, rows, plot, roles, tier), as_json)


@text_view(CapacityShown)
def _capacity_text(shown: CapacityShown) -> None:
    from rich.text import Text  # lazy: rich is start-up cost that --json never needs

    plan, fit, longest = shown.deployment.plan, shown.fit, shown.longest
    out = console()
    hw = plan.hardware
    print_paragraph(
        out,
        f"{hw.count}x {hw.product}, recipe {plan.recipe.recipe}, profile {plan.profile} ({fit.layout}), "
        f"{plan.model.display_name}, {plan.settings.cache.kv_dtype} KV cache",
    )
    print_paragraph(out, capacity_line(fit))
    print_paragraph(out, geometry_line(fit.geometry))
    if fit.fits:
        per_token = fit.kv_bytes_per_token
        print_paragraph(
            out,
            f"per GPU: weights {fit.weights_per_gpu_bytes / 1e9:.1f} GB, KV budget "
            f"{fit.kv_budget_per_gpu_bytes / 1e9:.1f} GB; per token {per_token.total:,.0f} bytes "
            f"(main attention {per_token.main_attention:,.0f} + indexer {per_token.indexer:,.0f}), "
            f"{fit.kv_bytes_per_sequence / 1e9:.2f} GB a sequence",
        )
    if shown.tier is not None:
        print_paragraph(out, tier_line(shown.tier, fit.kv_cache_tokens))
    for band in (sensitivity_line(fit), sensitivity_line(fit, published=True)):
        if band:
            print_paragraph(out, band)
    if longest is not None:
        capped = (
            f" (memory would hold {longest.memory_tokens:,}; {longest.limit_source})"
            if longest.memory_tokens > longest.limit_tokens
            else ""
        )
        noun = "sequence" if longest.sequences == 1 else "sequences"
        print_paragraph(
            out, f"longest context for {longest.sequences} {noun}: {longest.tokens:,} tokens{capped}"
        )
    for role, role_fit in shown.roles:
        print_paragraph(out, _role_line(role, role_fit, shown.context))
    rows = [
        [Text(r.model), Text(r.kv_dtype), Text(r.layout), str(r.fit.sequences), _basis(r.fit)]
        for r in shown.rows
    ]
    print_table(
        out,
        f"Resident sequences at {shown.context} tokens",
        ["model", "KV cache", "layout", "sequences", "published basis"],
        rows,
    )
    # Which geometry each model's rows used (the plan's model's is the line above).
    for origin in dict.fromkeys(r.fit.geometry for r in shown.rows if r.fit.geometry != fit.geometry):
        print_paragraph(out, geometry_line(origin))
    if shown.plot:
        print_paragraph(out, f"plot written to {shown.plot}")


def _basis(fit: Fit) -> str:
    return "-" if fit.sequences_published_basis is None else str(fit.sequences_published_basis)


def _role_line(role: str, fit: Fit, context: int) -> str:
    """A P/D role's capacity in the terms of its work."""
    if role == "prefill":
        return (
            f"prefill ({fit.layout}): {fit.kv_cache_tokens:,} KV tokens per engine, the prompt tokens it "
            f"holds in flight until decode pulls them ({fit.sequences} prompts of {context:,})"
        )
    return f"{role} ({fit.layout}): {fit.sequences} sequences of {context:,} tokens stay resident"
