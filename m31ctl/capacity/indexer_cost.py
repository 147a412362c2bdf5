"""What a sparse-attention index cache of another dtype costs a plan: each rank's bytes a token
(main attention plus index keys, as capacity/memory.py counts them) and the share of KV tokens
that leaves. Doctor tells it beside the engine's refusal of an FP8 index cache (issue 48)."""

from __future__ import annotations

from m31ctl.capacity.geometry import config_geometry, facts_geometry
from m31ctl.capacity.memory import CACHE_BYTES_PER_VALUE, INDEXER_AUTO_DTYPE
from m31ctl.plan.catalog import ModelFacts
from m31ctl.plan.checkpoint_facts import checkpoint_dir
from m31ctl.plan.settings import PlanSettings


def indexer_cost(settings: PlanSettings, model: ModelFacts, dtype: str) -> str:
    """The plan's index cache against one of `dtype`, in words; "" where the model has no sparse
    layers or a dtype has no known size. The geometry is the checkpoint's config.json when it is
    on this host, else recipes/models.yaml's."""
    directory, _looked = checkpoint_dir(settings)
    geometry = (
        config_geometry(directory / "config.json", model.display_name) if directory else facts_geometry(model)
    )
    spelled = {"auto": geometry.dtype, "fp8_e4m3": "fp8"}
    kv = spelled.get(settings.cache.kv_dtype, settings.cache.kv_dtype)
    now, then = (
        {**spelled, "auto": INDEXER_AUTO_DTYPE}.get(d, d) for d in (settings.cache.indexer_dtype, dtype)
    )
    sizes = [CACHE_BYTES_PER_VALUE.get(d) for d in (kv, now, then)]
    if None in sizes or not geometry.sparse_layers:
        return ""
    value, index_now, index_then = (float(size or 0) for size in sizes)
    tp = settings.parallelism.tensor
    main = geometry.layers * 2 * max(1, geometry.kv_heads // tp) * geometry.head_dim * value
    before = main + geometry.sparse_layers * geometry.indexer_dim * index_now
    after = main + geometry.sparse_layers * geometry.indexer_dim * index_then
    return (
        f"each rank stores {after:,.0f} bytes a token instead of {before:,.0f} "
        f"({geometry.sparse_layers} sparse layers x {geometry.indexer_dim} index values), "
        f"{100 * (1 - before / after):.0f}% fewer KV tokens in the same memory"
    )
