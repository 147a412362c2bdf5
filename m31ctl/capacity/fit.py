"""Capacity figures for a resolved plan, and comparisons across recipes and dtypes."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from m31ctl.capacity.geometry import checkpoint_weights, config_geometry, facts_geometry, local_config
from m31ctl.capacity.memory import (
    GIB,
    INDEXER_AUTO_DTYPE,
    Fit,
    MemoryInputs,
    Sharding,
    Weights,
    longest_context,
    resident_sequences,
    split_weights,
)
from m31ctl.capacity.reserve import plan_reserve
from m31ctl.deployment import Deployment
from m31ctl.errors import InputError
from m31ctl.plan import Plan
from m31ctl.plan.catalog import ModelFacts, get_model
from m31ctl.plan.settings import Parallelism

REFERENCE_MODEL = "minimax-m3.1-flash"
# vLLM's block sizes when the plan leaves it to the engine: the CPU platform picks 128
# (vllm/platforms/cpu.py), CacheConfig's default elsewhere is 16.
DEFAULT_BLOCK_SIZE = {"cpu": 128}
ENGINE_DEFAULT_BLOCK_SIZE = 16
CPU_KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # GiB; vLLM's CPU backend (vllm/platforms/cpu.py)


def profile_layouts(deployment: Deployment) -> dict[str, Sharding]:
    """The recipe's profiles that change the memory layout, by profile name: each profile's
    parallelism over the recipe's, completed by the settings schema's own defaults."""
    plan = deployment.plan
    layouts: dict[str, Sharding] = {}
    prefix = "parallelism."
    base = {k.removeprefix(prefix): s.value for k, s in plan.recipe.layer.items() if k.startswith(prefix)}
    for name, option in plan.recipe.profiles.items():
        if option.unsupported:
            continue
        values = {k.removeprefix(prefix): s.value for k, s in option.layer.items() if k.startswith(prefix)}
        par = Parallelism.model_validate({**base, **values})
        layout = Sharding(
            tensor=par.tensor, data=par.data, expert=par.expert, decode_context=par.decode_context
        )
        # Profiles that share a memory layout would repeat a row.
        if layout not in layouts.values():
            layouts[name] = layout
    return layouts


def plan_layout(deployment: Deployment) -> Sharding:
    p = deployment.plan.settings.parallelism
    return Sharding(
        tensor=p.tensor, data=p.data, expert=p.expert, decode_context=p.decode_context, pipeline=p.pipeline
    )


def _weights(plan: Plan, model: ModelFacts) -> Weights:
    requantized = plan.settings.moe.expert_requantization
    reference = get_model(REFERENCE_MODEL)
    reference_dense = None
    if model.id != reference.id:
        reference_dense = split_weights(
            reference.checkpoint_gb,
            reference.params_total_b,
            reference.expert_weights,
            reference.dense_weights,
        ).dense_bytes
    return split_weights(
        model.checkpoint_gb,
        model.params_total_b,
        model.expert_weights,
        model.dense_weights,
        loaded_expert_format=None if requantized == "none" else requantized,
        reference_dense_bytes=reference_dense,
    )


def memory_inputs(
    deployment: Deployment, model: ModelFacts | None = None, kv_dtype: str | None = None
) -> MemoryInputs:
    """The model's inputs for this plan. `model`/`kv_dtype` replace the plan's for a comparison
    row; a comparison row's indexer cache takes the row's dtype (the launch post compares
    "NVFP4 attention and indexer caches" with FP8 ones)."""
    plan = deployment.plan
    settings = plan.settings
    own = model is None or model.id == plan.model.id
    model = model or plan.model
    config = local_config(deployment.model.host_path) if own else None
    if config is not None:
        geometry = config_geometry(config, model.display_name)
        dense, experts = checkpoint_weights(config.parent)
        weights = Weights(float(dense), float(experts))
    else:
        geometry = facts_geometry(model)
        weights = _weights(plan, model)
    dtype = kv_dtype or settings.cache.kv_dtype
    if dtype == "auto":  # vLLM's auto stores the KV cache in the model's dtype
        dtype = geometry.dtype
    indexer = kv_dtype or settings.cache.indexer_dtype
    if indexer == "auto":
        indexer = INDEXER_AUTO_DTYPE
    vendor = plan.hardware.vendor
    block_size = settings.cache.block_size or DEFAULT_BLOCK_SIZE.get(vendor, ENGINE_DEFAULT_BLOCK_SIZE)
    return MemoryInputs(
        memory_per_gpu_bytes=plan.hardware.memory_per_gpu_bytes,
        gpu_memory_utilization=settings.serving.gpu_memory_utilization,
        runtime_reserve_gib=_reserve_gib(deployment, config),
        weights=weights,
        geometry=geometry,
        kv_dtype=dtype,
        indexer_dtype=indexer,
        block_size=block_size,
        kv_space_bytes=None if deployment.vendor.gpus else _cpu_kv_space(plan),
        published_kv_bytes_per_token=None if config else model.published_kv_bytes_per_token.get(dtype),
    )


def _reserve_gib(deployment: Deployment, config: Path | None) -> float:
    """capacity.runtime_reserve_gib as set; where it is the built-in default and the checkpoint's
    config.json is on this host, for a GPU plan, vLLM's reserve modelled from its parts
    (capacity/reserve.py: activation peak, non-torch memory, CUDA graph pool)."""
    plan = deployment.plan
    setting = plan.settings.capacity.runtime_reserve_gib
    source = plan.provenance.get("capacity.runtime_reserve_gib")
    if config is None or not deployment.vendor.gpus or (source is not None and source.layer != "defaults"):
        return setting
    modelled = plan_reserve(config, deployment)
    return setting if modelled is None else modelled.total_gib


def _cpu_kv_space(plan: Plan) -> int | None:
    raw = plan.settings.runtime.env.get(CPU_KV_SPACE_ENV)
    if raw is None or raw == "":
        return None
    try:
        return int(raw) * GIB
    except ValueError:
        raise InputError(
            f"runtime.env.{CPU_KV_SPACE_ENV}={raw!r} is not a whole number of GiB",
            where=str(plan.provenance.get(f"runtime.env.{CPU_KV_SPACE_ENV}") or "runtime.env"),
        ) from None


def plan_fit(deployment: Deployment, context: int | None = None) -> Fit:
    return resident_sequences(
        memory_inputs(deployment),
        plan_layout(deployment),
        context or deployment.plan.settings.serving.max_model_len,
    )


def plan_longest_context(deployment: Deployment, sequences: int) -> int:
    return longest_context(memory_inputs(deployment), plan_layout(deployment), sequences)


class ComparisonRow(NamedTuple):
    model: str
    kv_dtype: str
    layout: str
    fit: Fit


def comparison(deployment: Deployment, context: int, layouts: dict[str, Sharding]) -> list[ComparisonRow]:
    """Resident sequences for the plan's model and its comparison models, for every cache dtype
    the recipe allows, in every layout, on this hardware."""
    plan = deployment.plan
    rows = []
    planned = memory_inputs(deployment).kv_dtype
    fitting = {name: layout for name, layout in layouts.items() if layout.gpus <= plan.hardware.count}
    for model in [plan.model, *(get_model(m) for m in plan.model.compare_with)]:
        # The plan's own cache dtype first, then the others the launch post compares.
        dtypes = sorted(model.published_kv_bytes_per_token or [planned], key=lambda d: (d != planned, d))
        for dtype in dtypes:
            if not _recipe_allows_kv(plan, dtype):
                continue
            inputs = memory_inputs(deployment, model, dtype)  # one per model and dtype: layouts share it
            for name, layout in fitting.items():
                fit = resident_sequences(inputs, layout, context)
                label = f"{name} ({layout.label()}{', ' + fit.moe if fit.moe else ''})"
                rows.append(ComparisonRow(model.display_name, dtype, label, fit))
    return rows


def _recipe_allows_kv(plan: Plan, dtype: str) -> bool:
    return all(rule.allows(dtype) for rule in plan.recipe.rules if rule.key == "cache.kv_dtype")


def capacity_warning(deployment: Deployment) -> str | None:
    """Why the plan's max_model_len / max_num_seqs cannot all be resident, if they cannot."""
    fit = plan_fit(deployment)
    serving = deployment.plan.settings.serving
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


def within_limit(deployment: Deployment, context: int, context_text: str) -> tuple[int, str]:
    """The plan's longest sequence and why (context_limit); a --context beyond it is refused."""
    limit, limit_source = context_limit(deployment)
    if context > limit:
        raise InputError(
            f"--context {context_text} ({context:,} tokens) is beyond the {limit:,} positions this plan "
            f"can serve ({limit_source}): vLLM refuses a longer sequence",
            hint=f"ask for at most {limit:,} tokens (--context {_short(limit)})",
        )
    return limit, limit_source


# capacity's context when none is asked for: the launch post's comparison point, or the plan's
# longest sequence where that is shorter (the CPU rehearsal serves 2,048 positions).
DEFAULT_CONTEXT = 256 * 1024


def default_context(deployment: Deployment) -> int:
    return min(DEFAULT_CONTEXT, context_limit(deployment)[0])


def context_limit(deployment: Deployment) -> tuple[int, str]:
    """The longest sequence the plan can serve, and why: its serving.max_model_len, or the
    checkpoint's positions when those are more (a plan may ask capacity about a longer
    max_model_len than it sets, never beyond what vLLM accepts: its max_model_len check against
    max_position_embeddings, engine rule vllm-max-model-len)."""
    plan = deployment.plan
    set_len = plan.settings.serving.max_model_len
    positions = plan.model.limits.max_position_embeddings
    native = int(positions.value) if positions is not None else plan.model.max_context
    if set_len > native:  # RoPE scaling accepted by the plan's rules
        return set_len, f"the plan's serving.max_model_len, {plan.provenance.get('serving.max_model_len')}"
    return native, "the checkpoint's max_position_embeddings"


def _short(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)
