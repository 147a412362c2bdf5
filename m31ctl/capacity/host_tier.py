"""The prefix cache's host tier (cache.cpu_offload_gib): what vLLM 0.32's native KV offloading
holds, where its memory lives, and whether a host has that memory.

Read in vLLM 0.32 (docs/capacity.md, "The host tier"):

- `--kv-offloading-size N` is N GiB per engine, summed over the engine's workers
  (`config/cache.py` CacheConfig.kv_offloading_size: "When TP > 1, this is the total buffer size
  summed across all TP ranks"; `config/vllm.py` _post_init_kv_transfer_config turns it into the
  connector's `cpu_bytes_to_use`). Each data-parallel rank is an engine of its own (its own
  engine_id, `v1/kv_offload/config.py`) with its own N.
- The tier holds every KV cache group of the pool, the sparse indexer's with the main cache: a
  worker's bytes per block are the whole GPU allocation over its blocks
  (`distributed/kv_transfer/kv_connector/v1/offloading/config.py` build_offloading_config,
  worker_kv_bytes_per_block), so a token costs the tier what it costs the GPU pool.
- `v1/kv_offload/cpu/spec.py` CPUOffloadingSpec.__init__: chunks = N bytes // (worker bytes per
  block x workers, rounded up to a page); each worker owns 1/workers of every chunk.
- Where: on CUDA, one file per engine in /dev/shm (`v1/kv_offload/cpu/shared_offload_region.py`
  SharedOffloadRegion, `/dev/shm/vllm_offload_{engine_id}.mmap`), refused at start when /dev/shm
  has less free space (`check_shm_free_space`), and pinned whole by every worker
  (`cpu/gpu_worker.py` pin_mmap_region); on ROCm, each worker's own pinned tensor of its share.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from m31ctl.capacity.fit import memory_inputs, plan_layout
from m31ctl.capacity.memory import GIB, TokenBytes, token_bytes
from m31ctl.deployment import Deployment
from m31ctl.errors import HostPreconditionError, InputError
from m31ctl.hardware import Platform
from m31ctl.units import parse_size

# vLLM rounds each chunk up to the page size (CPUOffloadingSpec.BLOCK_SIZE_ALIGNMENT = mmap.PAGESIZE).
PAGE = 4096
TIB = 1024 * GIB


class HostTier(NamedTuple):
    """One plan's host tier: per engine, per rank and per host."""

    gib_per_engine: float  # cache.cpu_offload_gib, vLLM's --kv-offloading-size
    engine_ranks: int  # the workers an engine's size is split over (TP x PP)
    engines: int  # data-parallel engines in all
    engines_per_host: int  # engines with workers on one host
    ranks_per_host: int  # GPUs the layout uses on one host
    in_shm: bool  # CUDA: one /dev/shm region per engine, which every worker pins
    bytes_per_token: TokenBytes  # per rank, main + indexer: what the GPU pool stores
    tokens_per_engine: int  # tokens the tier of one engine holds (whole blocks)
    prefixes_per_engine: int  # whole prefixes of `context` tokens one engine's tier holds
    context: int

    @property
    def bytes_per_engine(self) -> float:
        return self.gib_per_engine * GIB

    @property
    def bytes_per_rank(self) -> float:
        return self.bytes_per_engine / self.engine_ranks

    @property
    def bytes_per_host(self) -> float:
        """Host memory the tier pins on each host. The CUDA region is one file per engine on
        every host it has a worker on, pinned whole; ROCm's is each worker's share."""
        if self.in_shm:
            return self.bytes_per_engine * self.engines_per_host
        return self.bytes_per_rank * self.ranks_per_host

    def spelled(self) -> str:
        """'cache.cpu_offload_gib=512 x 2 engines = 1 TiB of host memory on each host'."""
        head = f"cache.cpu_offload_gib={self.gib_per_engine:g}"
        if self.in_shm:
            count, noun = self.engines_per_host, "engine"
        else:
            head += f" / {self.engine_ranks} ranks of an engine"
            count, noun = self.ranks_per_host, "rank"
        return f"{head} x {count} {noun}{'s' if count != 1 else ''} = {size_text(self.bytes_per_host)}"


def host_tier(deployment: Deployment, context: int | None = None) -> HostTier | None:
    """The plan's host tier at `context` (the plan's max_model_len by default); None without one."""
    plan = deployment.plan
    gib = plan.settings.cache.cpu_offload_gib
    if gib is None:
        return None
    context = context or plan.settings.serving.max_model_len
    inputs = memory_inputs(deployment)
    sharding = plan_layout(deployment)
    per_token = token_bytes(inputs, sharding)
    ranks = sharding.tensor * sharding.pipeline
    block = inputs.block_size
    chunk = math.ceil(ranks * block * per_token.total / PAGE) * PAGE
    chunks = int(gib * GIB) // chunk
    layout = deployment.layout
    return HostTier(
        gib_per_engine=gib,
        engine_ranks=ranks,
        engines=sharding.data,
        engines_per_host=layout.data_local,
        ranks_per_host=layout.gpus_per_node,
        in_shm=deployment.vendor.platform is Platform.CUDA,
        bytes_per_token=per_token,
        tokens_per_engine=chunks * block,
        prefixes_per_engine=chunks // math.ceil(context / block),
        context=context,
    )


class HostMemoryNeed(NamedTuple):
    """What the plan takes of one host's memory for the tier and beside it."""

    tier: HostTier
    shm_bytes: int  # the private /dev/shm the plan sizes (runtime.shm_size); 0 with the host's IPC
    shm_text: str = ""  # runtime.shm_size as written

    @property
    def total(self) -> float:
        """The tier plus the plan's /dev/shm. On CUDA the tier lives in that /dev/shm, so the
        larger of the two; on ROCm it is private memory beside it."""
        if self.tier.in_shm:
            return max(self.tier.bytes_per_host, self.shm_bytes)
        return self.tier.bytes_per_host + self.shm_bytes

    def shm_to_match(self) -> str:
        """' and runtime.shm_size with it' where the tier lives in the plan's /dev/shm."""
        return " and runtime.shm_size with it" if self.tier.in_shm and self.shm_bytes else ""

    def beside(self) -> str:
        """The words for the /dev/shm counted with the tier ('' when none is)."""
        if not self.shm_bytes or (self.tier.in_shm and self.shm_bytes <= self.tier.bytes_per_host):
            return ""
        where = "which holds the tier" if self.tier.in_shm else "beside it"
        return f", with runtime.shm_size={self.shm_text} of /dev/shm {where}"


def host_memory_need(deployment: Deployment) -> HostMemoryNeed | None:
    tier = host_tier(deployment)
    if tier is None:
        return None
    runtime = deployment.plan.settings.runtime
    shm = 0 if runtime.ipc_host else parse_size(runtime.shm_size)
    return HostMemoryNeed(tier, shm, runtime.shm_size)


def largest_tier_gib(need: HostMemoryNeed, memory: float) -> int:
    """The largest whole cache.cpu_offload_gib whose need fits `memory` bytes (0 if none): on CUDA
    with runtime.shm_size lowered to match (what it holds beside the tier kept)."""
    tier = need.tier
    room: float
    per_gib: float
    if tier.in_shm:  # the tier is in the plan's /dev/shm, which shrinks with it to what it holds beside
        room = memory - max(0.0, need.shm_bytes - tier.bytes_per_host)
        per_gib = tier.engines_per_host * GIB
    else:
        room = memory - need.shm_bytes
        per_gib = GIB * tier.ranks_per_host / tier.engine_ranks
    return max(0, math.floor(room / per_gib))


def require_host_memory(deployment: Deployment) -> None:
    """Refuse at plan time a host tier the host cannot hold: the tier and the plan's /dev/shm
    beyond a host memory the --hardware spec declares (exit 6), and on CUDA a private /dev/shm
    (runtime.shm_size) smaller than the tier vLLM puts in it (exit 2: two settings disagree; vLLM
    refuses it at start, after the weights have loaded)."""
    for engine in deployment.engines:
        need = host_memory_need(engine)
        if need is None:
            continue
        _within_declared_memory(engine, need)
        _within_private_shm(need)


def _within_declared_memory(deployment: Deployment, need: HostMemoryNeed) -> None:
    hw = deployment.plan.hardware
    memory = hw.host_memory_bytes
    if memory is None or need.total <= memory:
        return
    tier = need.tier
    largest = largest_tier_gib(need, memory)
    fix = (
        f"lower cache.cpu_offload_gib to at most {largest}{need.shm_to_match()}, or fewer engines on each host"
        if largest
        else "lower runtime.shm_size, or use a host with more memory"
    )
    raise HostPreconditionError(
        f"{tier.spelled()} of host memory{need.beside()}, the {hw.product} host has "
        f"{size_text(memory)} ({hw.source}): vLLM pins the tier in host memory at start",
        hint=fix,
    )


def _within_private_shm(need: HostMemoryNeed) -> None:
    tier = need.tier
    if not tier.in_shm or not need.shm_bytes:
        return
    shm_floor = NCCL_SHM_FLOOR
    if need.shm_bytes >= tier.bytes_per_host + shm_floor:
        return
    wanted = math.ceil((tier.bytes_per_host + need.shm_bytes) / GIB)
    raise InputError(
        f"{tier.spelled()} in /dev/shm (vLLM 0.32 keeps the CUDA tier in "
        f"/dev/shm/vllm_offload_<engine>.mmap), but runtime.shm_size={need.shm_text} "
        "leaves it too little: vLLM refuses to start once the weights have loaded",
        hint=f"--set runtime.shm_size={wanted}g (the tier plus the /dev/shm it has now), "
        "or runtime.ipc_host=true (the host's /dev/shm)",
    )


# What /dev/shm needs beside the tier: NCCL's intra-node buffers and vLLM's message queues
# (doctor's shm check asks a private /dev/shm for at least this much).
NCCL_SHM_FLOOR = GIB


def size_text(size: float) -> str:
    """'4 TiB', '1.5 TiB', '576 GiB': the unit a host's memory is spoken of in."""
    if size >= TIB:
        return f"{size / TIB:.3g} TiB"
    return f"{size / GIB:,.4g} GiB" if size >= GIB else f"{size / 2**20:,.0f} MiB"


def tier_line(tier: HostTier, gpu_tokens: int) -> str:
    """capacity's line for the host tier, beside the GPU's tokens."""
    per_token = tier.bytes_per_token
    where = "in /dev/shm" if tier.in_shm else "pinned by each rank"
    return (
        f"host tier (cache.cpu_offload_gib={tier.gib_per_engine:g} per engine, vLLM's native KV "
        f"offloading): {tier.tokens_per_engine:,} tokens per engine ({tier.prefixes_per_engine:,} "
        f"prefixes of {tier.context:,} tokens) beside the GPU's {gpu_tokens:,}, at "
        f"{per_token.total:,.0f} bytes a token a rank (main attention {per_token.main_attention:,.0f} "
        f"+ indexer {per_token.indexer:,.0f}); {size_text(tier.bytes_per_rank)} a rank, "
        f"{size_text(tier.bytes_per_host)} of host memory on each host, {where}"
    )
