"""Capacity figures for a resolved plan, and comparisons across recipes and dtypes."""

from __future__ import annotations

from dataclasses import dataclass

from m31ctl.capacity.model import (
    Fit,
    Layout,
    MemoryInputs,
    dense_weight_bytes,
    longest_context,
    resident_sequences,
)
from m31ctl.errors import InputError
from m31ctl.plan import Plan
from m31ctl.plan.recipes import ModelFacts, get_model

REFERENCE_MODEL = "minimax-m3.1-flash"


def profile_layouts(plan: Plan) -> dict[str, Layout]:
    """The recipe's profiles that change the memory layout, by profile name."""
    layouts: dict[str, Layout] = {}
    base = plan.recipe.layer
    for name, option in plan.recipe.profiles.items():
        if option.unsupported:
            continue
        values = {key: s.value for key, s in option.layer.items()}
        layout = Layout(
            tensor=values.get("parallelism.tensor", base["parallelism.tensor"].value),
            data=values.get("parallelism.data", 1),
            expert=values.get("parallelism.expert", False),
        )
        # Profiles that share a memory layout (long-context is TP4 too) would repeat a row.
        if layout not in layouts.values():
            layouts[name] = layout
    return layouts


def plan_layout(plan: Plan) -> Layout:
    p = plan.settings.parallelism
    return Layout(tensor=p.tensor, data=p.data, expert=p.expert)


def memory_inputs(plan: Plan, model: ModelFacts | None = None, kv_dtype: str | None = None) -> MemoryInputs:
    model = model or plan.model
    dtype = kv_dtype or plan.settings.cache.kv_dtype
    if dtype == "auto":  # vLLM's auto stores the KV cache in the model's dtype
        dtype = "bf16" if "bf16" in model.kv_bytes_per_token else next(iter(model.kv_bytes_per_token))
    if dtype not in model.kv_bytes_per_token:
        raise InputError(
            f"no KV size is known for {model.display_name} with a {dtype} cache",
            hint=f"known: {', '.join(model.kv_bytes_per_token)}",
        )
    return MemoryInputs(
        memory_per_gpu_bytes=plan.hardware.memory_per_gpu_bytes,
        gpu_memory_utilization=plan.settings.serving.gpu_memory_utilization,
        runtime_reserve_gib=plan.settings.capacity.runtime_reserve_gib,
        checkpoint_bytes=model.checkpoint_gb * 1e9,
        dense_bytes=dense_weight_bytes(model, get_model(REFERENCE_MODEL)),
        kv_bytes_per_token=model.kv_bytes_per_token[dtype],
    )


def plan_fit(plan: Plan, context: int | None = None) -> Fit:
    return resident_sequences(
        memory_inputs(plan), plan_layout(plan), context or plan.settings.serving.max_model_len
    )


def plan_longest_context(plan: Plan, sequences: int) -> int:
    return longest_context(memory_inputs(plan), plan_layout(plan), sequences)


@dataclass(frozen=True)
class ComparisonRow:
    model: str
    kv_dtype: str
    layout: str
    fit: Fit


def comparison(plan: Plan, context: int, layouts: dict[str, Layout]) -> list[ComparisonRow]:
    """Resident sequences for the plan's model and its comparison models, for every cache dtype
    the recipe allows, in every layout, on this hardware."""
    rows = []
    for model in [plan.model, *(get_model(m) for m in plan.model.compare_with)]:
        for dtype in model.kv_bytes_per_token:
            if not _recipe_allows_kv(plan, dtype):
                continue
            for name, layout in layouts.items():
                if layout.gpus > plan.hardware.count:
                    continue
                fit = resident_sequences(memory_inputs(plan, model, dtype), layout, context)
                rows.append(ComparisonRow(model.display_name, dtype, f"{name} ({layout.label()})", fit))
    return rows


def _recipe_allows_kv(plan: Plan, dtype: str) -> bool:
    return all(rule.allows(dtype) for rule in plan.recipe.rules if rule.key == "cache.kv_dtype")


def capacity_warning(plan: Plan) -> str | None:
    """Why the plan's max_model_len / max_num_seqs cannot all be resident, if they cannot."""
    fit = plan_fit(plan)
    serving = plan.settings.serving
    if not fit.fits:
        return (
            f"not even one {serving.max_model_len}-token sequence fits in the KV budget "
            f"({fit.layout}); lower serving.max_model_len or use more GPUs"
        )
    if serving.max_num_seqs is not None and serving.max_num_seqs > fit.sequences:
        return (
            f"serving.max_num_seqs={serving.max_num_seqs} but only {fit.sequences} sequences of "
            f"{serving.max_model_len} tokens fit; long requests will queue or be preempted"
        )
    return None
