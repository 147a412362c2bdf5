"""Memory model: what each rank allocates, and how many sequences the engine will hold.

Per rank:  KV space = memory x gpu_memory_utilization - weights held by that rank - runtime reserve
           (or the explicit KV space of vLLM's CPU backend, VLLM_CPU_KVCACHE_SPACE).
Per token a rank stores, for each layer, K and V for max(1, kv_heads // TP) heads (vLLM replicates
KV heads when TP exceeds them) and, on MSA sparse layers, one indexer key vector (replicated on
every TP rank). Decode context parallelism (DCP) splits the tokens of replicated caches.
vLLM sizes the cache in blocks: blocks = KV space // (block_size x bytes per token), and a request
of L tokens takes cdiv(L, block_size) of them (v1/core/kv_cache_utils.py). The published
basis is the launch post's accounting: main attention only, spread evenly over the TP group.
docs/capacity.md derives every input and says which are measured, published or assumed.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from m31ctl.errors import InputError

GIB = 1024**3

# Bits per weight including block scales. NVFP4: 4 bits + an FP8 scale per 16 values = 4.5
# (the launch post); MXFP8: 8 bits + an E8M0 scale per 32 values = 8.25 (OCP MX spec).
BITS_PER_WEIGHT = {"nvfp4": 4.5, "mxfp8": 8.25, "fp8": 8.0, "bf16": 16.0}

# Bytes per cached value. NVFP4 is 4 bits plus an FP8 scale per 16 values: 72 bytes per 128
# values, which is how the launch post's 34,560 bytes a token come out (60 x 2 x 4 x 72).
CACHE_BYTES_PER_VALUE = {"nvfp4": 0.5625, "fp8": 1.0, "bf16": 2.0, "fp16": 2.0, "fp32": 4.0}

# vLLM's default for "auto" on MiniMax-M3's indexer cache (models/minimax_m3/nvidia/model.py:
# attention_config.resolve_indexer_kv_dtype("bf16")).
INDEXER_AUTO_DTYPE = "bf16"


class GeometryOrigin(NamedTuple):
    """Which geometry sized the KV cache, as the capacity tables name it: whose, what it is,
    where it was read, and which of its facts no one has published."""

    model: str = ""  # the model it sizes (a display name)
    name: str = ""  # what it is: "MiniMax-M3-preview's (...)", "the checkpoint's own"
    source: str = ""  # where it was read: recipes/models.yaml, or the checkpoint's config.json
    unpublished: tuple[str, ...] = ()  # facts no one has published, as name=value

    @property
    def published(self) -> bool:
        return not self.unpublished

    def label(self) -> str:
        text = f"{self.name} geometry ({self.source})"
        if self.unpublished:
            text += f"; unpublished for {self.model}: {', '.join(self.unpublished)}"
        return text


class Geometry(NamedTuple):
    """What sizes the KV cache, from recipes/models.yaml or a local model's config.json."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # the model dtype: what an "auto" cache stores
    sparse_layers: int = 0  # layers with an indexer key cache (MSA)
    indexer_dim: int = 0
    # The speculative draft's own KV cache, in the same pool and dtype (vLLM's draft inherits
    # the main cache dtype unless the speculative config sets kv_cache_dtype; m31ctl sets none).
    draft_layers: int = 0
    draft_kv_heads: int = 0
    draft_head_dim: int = 0
    origin: GeometryOrigin = GeometryOrigin()  # which geometry this is, for the capacity tables

    @property
    def name(self) -> str:
        return self.origin.label()


class Sharding(NamedTuple):
    """How the model's weights and KV are split over the GPUs, as memory sees it (what the
    Deployment's Layout, in m31ctl/deployment.py, puts where is its own: nodes, hosts, ranks)."""

    tensor: int = 1
    data: int = 1
    expert: bool = False
    decode_context: int = 1
    pipeline: int = 1  # stages: each holds 1/pipeline of the layers (weights and KV)

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipeline * self.data

    @property
    def moe_ranks(self) -> int:
        """The ranks each MoE layer spans: vLLM flattens the MoE's tensor parallelism over
        DP x TP (model_executor/layers/fused_moe/config.py FusedMoEParallelConfig.make), as
        expert parallelism when it is on, as tensor parallelism of every expert when it is not."""
        return self.tensor * self.data

    def moe_label(self) -> str:
        if self.moe_ranks == 1:
            return "MoE unsharded"
        return f"MoE {'EP' if self.expert else 'TP'}{self.moe_ranks}"

    def label(self) -> str:
        if self.data > 1 and self.expert:
            base = f"DEP{self.data}" if self.tensor == 1 else f"TP{self.tensor}xDEP{self.data}"
        elif self.data > 1:
            base = f"TP{self.tensor}xDP{self.data}"
        else:
            base = f"TP{self.tensor}"
        if self.pipeline > 1:
            base = base.replace(f"TP{self.tensor}", f"TP{self.tensor}xPP{self.pipeline}", 1)
        return f"{base}+DCP{self.decode_context}" if self.decode_context > 1 else base


class Weights(NamedTuple):
    """The checkpoint split the way parallelism shards it, in bytes as loaded."""

    dense_bytes: float  # non-expert weights: sharded by TP, replicated across DP
    expert_bytes: float  # routed experts as loaded (after any re-quantization)


class MemoryInputs(NamedTuple):
    memory_per_gpu_bytes: int
    gpu_memory_utilization: float
    runtime_reserve_gib: float
    weights: Weights
    geometry: Geometry
    kv_dtype: str  # resolved: never "auto"
    indexer_dtype: str
    block_size: int
    # The engine's KV space per rank when it is given outright (vLLM's CPU backend:
    # VLLM_CPU_KVCACHE_SPACE GiB); None: derived from memory, utilization, weights, reserve.
    kv_space_bytes: int | None = None
    published_kv_bytes_per_token: int | None = None


class TokenBytes(NamedTuple):
    """Bytes one rank stores for each token it holds, by cache."""

    main_attention: float
    indexer: float

    @property
    def total(self) -> float:
        return self.main_attention + self.indexer


class Band(NamedTuple):
    """The range of one input (others fixed) within which the answer stays the same, and the
    answer just outside it (None where the range reaches the input's limit)."""

    low: float
    high: float
    below: int | None
    above: int | None


class Sensitivity(NamedTuple):
    utilization: Band
    reserve_gib: Band


class Fit(NamedTuple):
    layout: str
    context: int
    weights_per_gpu_bytes: float
    kv_budget_per_gpu_bytes: float
    kv_bytes_per_token: TokenBytes  # per rank
    kv_blocks: int  # per rank (each engine's pool)
    kv_cache_tokens: int  # per engine, as vLLM logs it for max_model_len = context
    sequences: int  # what the engine will hold at this context; 0 when not one fits
    sequences_published_basis: int | None  # the launch post's accounting; None without a figure
    sensitivity: Sensitivity | None  # None when the KV space is given outright
    sensitivity_published_basis: Sensitivity | None
    geometry: GeometryOrigin = GeometryOrigin()  # which geometry sized the cache
    moe: str = ""  # the MoE layout vLLM builds (Sharding.moe_label)

    @property
    def fits(self) -> bool:
        return self.sequences > 0

    @property
    def kv_bytes_per_sequence(self) -> float:
        """What one sequence of `context` tokens costs on each rank of its group."""
        return self.kv_bytes_per_token.total * self.context


def split_weights(
    checkpoint_gb: float,
    params_total_b: float,
    expert_format: str,
    dense_format: str,
    loaded_expert_format: str | None = None,
    reference_dense_bytes: float | None = None,
) -> Weights:
    """Dense and expert bytes of a MoE checkpoint, experts as loaded.

    Solved from the checkpoint size and parameter count when experts and dense weights use
    different formats (M3.1: NVFP4 experts, MXFP8 the rest). A checkpoint stored in one format
    (M3-MXFP8) cannot be split that way: `reference_dense_bytes` (same architecture) gives its
    dense part. `loaded_expert_format` is the format the experts are counted in as loaded when
    the plan assumes the image re-quantizes them (moe.expert_requantization=mxfp8: an assumption
    for a day-zero image; no code path in stock vLLM 0.33 re-quantizes NVFP4 experts at load).
    """
    total = checkpoint_gb * 1e9
    if expert_format == "none":  # a dense model
        return Weights(total, 0.0)
    be = BITS_PER_WEIGHT[expert_format] / 8
    bd = BITS_PER_WEIGHT[dense_format] / 8
    if be != bd:
        dense_params = (total - be * params_total_b * 1e9) / (bd - be)
        dense = dense_params * bd
    elif reference_dense_bytes is not None:
        dense = reference_dense_bytes
    else:
        raise InputError("cannot split a single-format checkpoint into dense and expert parts")
    experts = total - dense
    if loaded_expert_format and loaded_expert_format != expert_format:
        experts *= BITS_PER_WEIGHT[loaded_expert_format] / BITS_PER_WEIGHT[expert_format]
    return Weights(dense, experts)


def weights_per_gpu(weights: Weights, layout: Sharding) -> float:
    """Dense weights are sharded by TP and replicated on every data-parallel rank; the experts
    are spread over all DP x TP ranks whether or not expert parallelism is on: vLLM flattens the
    MoE's tensor parallelism across DP x TP (FusedMoEParallelConfig.make), holding whole experts
    per rank under EP and a 1/(DP x TP) slice of every expert without. Pipeline stages hold
    their own layers."""
    dense = weights.dense_bytes / layout.tensor
    experts = weights.expert_bytes / layout.moe_ranks
    return (dense + experts) / layout.pipeline


def kv_budget_per_gpu(
    inputs: MemoryInputs,
    layout: Sharding,
    *,
    utilization: float | None = None,
    reserve_gib: float | None = None,
) -> float:
    if inputs.kv_space_bytes is not None:
        return float(inputs.kv_space_bytes)
    util = inputs.gpu_memory_utilization if utilization is None else utilization
    reserve = inputs.runtime_reserve_gib if reserve_gib is None else reserve_gib
    return inputs.memory_per_gpu_bytes * util - weights_per_gpu(inputs.weights, layout) - reserve * GIB


def token_bytes(inputs: MemoryInputs, layout: Sharding) -> TokenBytes:
    """Bytes one rank stores for each token of a sequence its group serves."""
    g = inputs.geometry
    tp, dcp = layout.tensor, layout.decode_context
    # vLLM stores max(1, kv_heads // tp) heads per rank (models/minimax_m3/nvidia/model.py, as
    # every GQA model): TP beyond the KV head count leaves tp // kv_heads copies of each head.
    heads_per_rank = max(1, g.kv_heads // tp)
    main_copies = max(1, tp // g.kv_heads)
    # The indexer key cache has one head (common/indexer.py), so every TP rank holds a copy.
    indexer_copies = tp
    # Decode context parallelism removes copies: the ranks that hold the same cache split its
    # tokens (vLLM's DCP "eliminates KV cache redundancy"; its per-layer replica count,
    # v1/core/kv_cache_utils.py _layer_tp_replicas). A cache with no copies is not split.
    # Pipeline stages hold their own layers' caches: 1/pipeline of them each (even split).
    main = (
        g.layers / layout.pipeline * 2 * heads_per_rank * g.head_dim * CACHE_BYTES_PER_VALUE[inputs.kv_dtype]
    )
    indexer = g.sparse_layers / layout.pipeline * g.indexer_dim * CACHE_BYTES_PER_VALUE[inputs.indexer_dtype]
    # The draft runs with the target's TP (draft_tensor_parallel_size defaults to it) and keeps
    # its K/V in the same pool, in the main cache's dtype.
    draft = 0.0
    if g.draft_layers and g.draft_kv_heads:
        draft_heads = max(1, g.draft_kv_heads // tp)
        draft = g.draft_layers * 2 * draft_heads * g.draft_head_dim * CACHE_BYTES_PER_VALUE[inputs.kv_dtype]
    main = main + draft
    return TokenBytes(main / min(dcp, main_copies), indexer / min(dcp, indexer_copies))


def _blocks(budget: float, block_bytes: float) -> int:
    return max(0, math.floor(budget / block_bytes)) if budget > 0 else 0


def resident_sequences(inputs: MemoryInputs, layout: Sharding, context: int) -> Fit:
    if context < 1:
        raise InputError("context length must be at least 1 token")
    per_token = token_bytes(inputs, layout)
    block_bytes = inputs.block_size * per_token.total
    budget = kv_budget_per_gpu(inputs, layout)
    blocks = _blocks(budget, block_bytes)
    per_request = math.ceil(context / inputs.block_size)
    concurrency = blocks / per_request
    sequences = math.floor(concurrency) * layout.data
    given = inputs.kv_space_bytes is not None
    published_need = (
        context * inputs.published_kv_bytes_per_token / (layout.tensor * layout.pipeline)
        if inputs.published_kv_bytes_per_token
        else None
    )
    return Fit(
        layout=layout.label(),
        context=context,
        weights_per_gpu_bytes=weights_per_gpu(inputs.weights, layout),
        kv_budget_per_gpu_bytes=budget,
        kv_bytes_per_token=per_token,
        kv_blocks=blocks,
        kv_cache_tokens=int(concurrency * context),
        sequences=sequences,
        sequences_published_basis=published_basis(inputs, layout, context, budget),
        sensitivity=None if given else _sensitivity(inputs, layout, per_request * block_bytes),
        sensitivity_published_basis=(
            None if given or published_need is None else _sensitivity(inputs, layout, published_need)
        ),
        geometry=inputs.geometry.origin,
        moe=layout.moe_label() if inputs.weights.expert_bytes else "",
    )


def published_basis(inputs: MemoryInputs, layout: Sharding, context: int, budget: float) -> int | None:
    """The launch post's accounting: main attention only, a sequence's KV spread evenly over
    its TP group (no replication, no indexer, no blocks)."""
    if inputs.published_kv_bytes_per_token is None:
        return None
    group_budget = max(budget, 0.0) * layout.tensor * layout.pipeline
    return math.floor(group_budget / (context * inputs.published_kv_bytes_per_token)) * layout.data


def _sensitivity(inputs: MemoryInputs, layout: Sharding, need: float) -> Sensitivity:
    """Solve budget = memory x u - weights - reserve for the budgets at which the count of whole
    requests per rank changes: with `need` bytes of a rank's budget per request, the answer holds
    for budgets in [k x need, (k+1) x need)."""
    memory = inputs.memory_per_gpu_bytes
    weights = weights_per_gpu(inputs.weights, layout)
    reserve = inputs.runtime_reserve_gib * GIB
    k = max(0, math.floor(kv_budget_per_gpu(inputs, layout) / need)) if need else 0
    lo_budget, hi_budget = k * need, (k + 1) * need
    d = layout.data
    u_low = (lo_budget + weights + reserve) / memory
    u_high = (hi_budget + weights + reserve) / memory
    utilization = Band(
        low=round(max(u_low, 0.0), 4),
        high=round(min(u_high, 1.0), 4),
        below=(k - 1) * d if k > 0 and u_low > 0 else None,
        above=(k + 1) * d if u_high <= 1.0 else None,
    )
    usable = memory * inputs.gpu_memory_utilization - weights
    r_high = (usable - lo_budget) / GIB  # more reserve than this: one request fewer
    r_low = (usable - hi_budget) / GIB  # less reserve than this: one request more
    reserve_band = Band(
        low=round(max(r_low, 0.0), 2),
        high=round(r_high, 2),
        below=(k + 1) * d if r_low > 0 else None,
        above=(k - 1) * d if k > 0 else None,
    )
    return Sensitivity(utilization, reserve_band)


def longest_context(inputs: MemoryInputs, layout: Sharding, sequences: int) -> int:
    """The longest context at which `sequences` sequences stay resident (0 if none)."""
    if sequences < 1:
        raise InputError("the number of sequences must be at least 1")
    per_rank = math.ceil(sequences / layout.data)
    block_bytes = inputs.block_size * token_bytes(inputs, layout).total
    blocks = _blocks(kv_budget_per_gpu(inputs, layout), block_bytes)
    blocks_per_request = blocks // per_rank
    return blocks_per_request * inputs.block_size


def parse_context(text: str) -> int:
    """'256k' -> 262144, '1m' -> 1048576, '8192' -> 8192 (binary units: 256K means 262,144)."""
    raw = text.strip().lower()
    scale = {"k": 1024, "m": 1024**2}.get(raw[-1:], 1)
    number = raw[:-1] if scale > 1 else raw
    try:
        value = float(number) * scale
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 1 or value > 2**40:
        raise InputError(
            f"bad context length {text!r}", hint="use a token count from 1 up, such as 262144, 256k or 1m"
        )
    return int(value)
