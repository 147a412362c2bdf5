"""A decode instance's /metrics and the facts that show its prompts' KV came over the wire from
a prefill instance (prefill/decode disaggregation, issue 36), not recomputed locally.

vLLM 0.32 exports, per engine, on the instance that pulls KV (the decode side):

    vllm:nixl_xfer_time_seconds        histogram, one observation per NIXL transfer
                                       (distributed/kv_transfer/kv_connector/v1/nixl/stats.py)
    vllm:nixl_bytes_transferred        histogram of bytes per transfer (same file)
    vllm:nixl_num_failed_transfers     counter: failed transfers, handshakes and notifications
                                       (same file; KV expiry is a separate counter, on prefill)
    vllm:prompt_tokens_by_source       counter {source=local_compute|local_cache_hit|
                                       external_kv_transfer} (v1/metrics/loggers.py,
                                       v1/metrics/stats.py PromptTokenStats: computed +
                                       local_cache_hit + external_kv_transfer = total)

The counters are cumulative since the engine started: a run's own figures are `after - before`
(`since`). Pure: text in, typed facts out, judged against the plan's figure (`per_token`, read
from capacity); the scrape is prometheus.scrape's.

What `vllm:nixl_bytes_transferred` counts (vLLM 0.32 with NIXL 1.5.1; docs/decisions.md "P/D
bytes a token"): one observation per completed NIXL READ handle on the decode
(nixl/base_worker.py `_pop_done_transfers` -> stats.py `record_transfer`: NIXL's
`nixlXferTelemetry.totalBytes`), which is the sum of the local descriptors' lengths of the read
(NIXL src/core/nixl_agent.cpp `makeXferReq`; contiguous blocks merged into one descriptor, bytes
unchanged). A descriptor is one whole block of one registered region: every layer of every
transfer group of the KV cache config is a region (`register_kv_caches`), K and V packed, so a
read of N blocks moves N x the block's bytes of every layer on that decode rank; each decode rank
reads its own share and the engine's histogram sums them. MiniMax-M3's indexer key cache is such
a layer (models/minimax_m3/common/indexer.py `MiniMaxM3IndexerCache.get_kv_cache_spec`:
MLAAttentionSpec, grouped with the main cache's FullAttentionSpec). So the bytes over the prompt
tokens' whole blocks are the capacity model's bytes a token a rank (main + indexer) times the
decode ranks that pull (`judge_bytes`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from m31ctl.capacity.fit import memory_inputs, plan_layout
from m31ctl.capacity.memory import token_bytes
from m31ctl.checks import CheckResult, judged
from m31ctl.deployment import Deployment
from m31ctl.served import prometheus

TRANSFERS = "vllm:nixl_xfer_time_seconds_count"
BYTES = "vllm:nixl_bytes_transferred_sum"
FAILED = "vllm:nixl_num_failed_transfers_total"
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
EXTERNAL = "external_kv_transfer"
LOCAL_COMPUTE = "local_compute"
LOCAL_CACHE_HIT = "local_cache_hit"
CACHE_CONFIG_INFO = "vllm:cache_config_info"  # its block_size label: the KV block NIXL reads whole


class KvTransferFacts(NamedTuple):
    """The transfer counters of one instance, summed over its engines."""

    nixl_exported: bool  # the NIXL metrics are there at all (a NixlConnector is configured)
    transfers: int
    bytes_transferred: float
    failed_transfers: int
    external_prompt_tokens: int  # prompt tokens whose KV a connector brought in
    local_prompt_tokens: int  # prompt tokens this instance computed itself
    cached_prompt_tokens: int  # prompt tokens from its own prefix cache
    block_size: int | None = None  # tokens a KV block, as the engine reports it (None: not reported)


def facts(text: str) -> KvTransferFacts:
    """The transfer facts of a /metrics text (prometheus_client's parser, via prometheus.parse)."""
    return facts_of(prometheus.parse(text))


def facts_of(found: prometheus.ServedMetrics) -> KvTransferFacts:
    by_source: dict[str, float] = {}
    for sample in found.samples.get(PROMPT_TOKENS_BY_SOURCE, ()):
        source = sample.labels.get("source", "")
        by_source[source] = by_source.get(source, 0.0) + sample.value
    return KvTransferFacts(
        nixl_exported=TRANSFERS in found.samples,
        transfers=_count(found.total(TRANSFERS)),
        bytes_transferred=found.total(BYTES),
        failed_transfers=_count(found.total(FAILED), unreadable=1),
        external_prompt_tokens=_count(by_source.get(EXTERNAL, 0.0)),
        local_prompt_tokens=_count(by_source.get(LOCAL_COMPUTE, 0.0)),
        cached_prompt_tokens=_count(by_source.get(LOCAL_CACHE_HIT, 0.0)),
        block_size=_block_size(found),
    )


def _count(value: float, unreadable: int = 0) -> int:
    """A counter as a whole number. One that is no number (NaN, Inf: a broken or hostile
    /metrics) proves nothing moved, and is no "none failed" for the failure counter."""
    return int(value) if math.isfinite(value) else unreadable


def _block_size(found: prometheus.ServedMetrics) -> int | None:
    text = found.labels(CACHE_CONFIG_INFO).get("block_size", "")
    return int(text) if text.isdigit() and int(text) > 0 else None


def since(before: KvTransferFacts, after: KvTransferFacts) -> KvTransferFacts:
    """What happened between two scrapes of the same instance (the counters only grow)."""
    return KvTransferFacts(
        nixl_exported=after.nixl_exported,
        transfers=after.transfers - before.transfers,
        bytes_transferred=after.bytes_transferred - before.bytes_transferred,
        failed_transfers=after.failed_transfers - before.failed_transfers,
        external_prompt_tokens=after.external_prompt_tokens - before.external_prompt_tokens,
        local_prompt_tokens=after.local_prompt_tokens - before.local_prompt_tokens,
        cached_prompt_tokens=after.cached_prompt_tokens - before.cached_prompt_tokens,
        block_size=after.block_size,
    )


class Verdict(NamedTuple):
    came_over_the_wire: bool
    reason: str  # why, in one line, with the figures


def judge(seen: KvTransferFacts) -> Verdict:
    """Did the decode instance's prompts arrive as KV from the prefill instance? Transfers
    happened, none failed, and prompt tokens are counted as external KV transfer (a decode that
    recomputed them counts them as local_compute instead)."""
    figures = (
        f"{seen.transfers} NIXL transfers, {seen.bytes_transferred:,.0f} bytes, {seen.failed_transfers} failed; "
        f"prompt tokens: {seen.external_prompt_tokens} external, {seen.local_prompt_tokens} computed locally"
    )
    if not seen.nixl_exported:
        return Verdict(False, "no NIXL metrics on /metrics: the instance has no NixlConnector")
    if seen.failed_transfers > 0:
        return Verdict(False, f"failed transfers: {figures}")
    if seen.transfers <= 0:
        return Verdict(False, f"no KV transfer happened: {figures}")
    if seen.external_prompt_tokens <= 0:
        return Verdict(False, f"no prompt token came from the KV transfer: {figures}")
    return Verdict(True, figures)


def check(seen: KvTransferFacts) -> CheckResult:
    """The verdict as a server check (verify's and rehearse's shape)."""
    verdict = judge(seen)
    remedy = (
        ""
        if verdict.came_over_the_wire
        else "check both roles' --kv-transfer-config, VLLM_NIXL_SIDE_CHANNEL_HOST/PORT and UCX_TLS, "
        "and the decode log for NIXL errors"
    )
    return judged("kv-transfer", verdict.came_over_the_wire, verdict.reason, remedy)


# The check's one tolerance, below the plan's bytes a token. Both sides are exact where the
# checkpoint is on this host: NIXL counts whole descriptors (integers), and capacity's figure is
# a product of the checkpoint's geometry and exact bytes a value (NVFP4 72 per 128 values, vLLM
# utils/torch_utils.py nvfp4_kv_cache_full_dim). 1% absorbs only rounding; a missing cache is far
# larger: the indexer is 8.6% of the tiny M3's bytes a token (768 of 8,960) and a third of the
# M3.1 recipes' (4,320 of 12,960 at TP4). What is not known exactly (how the prompt tokens fall
# into blocks) is a bound, not a tolerance (`judge_bytes`).
BYTES_TOLERANCE = 0.01


class PerToken(NamedTuple):
    """What the decode engine's pulling ranks hold for one token, by cache: capacity's bytes a
    token a rank (capacity/memory.py token_bytes, of the inputs capacity/fit.py derives) times
    the ranks, each of which reads its own share over NIXL (TP x PP of one engine; a DP rank is
    an engine of its own, and the facts sum the engines)."""

    main: float  # main attention (with the speculative draft's, which shares its pool)
    indexer: float  # the sparse layers' indexer key cache; 0 for a model without one
    ranks: int
    block_size: int  # the plan's KV block (capacity's), where the engine reports none
    assumed: tuple[str, ...] = ()  # geometry facts nobody has published (name=value)

    @property
    def total(self) -> float:
        return self.main + self.indexer


def per_token(engine: Deployment) -> PerToken:
    """The plan's bytes a token for `engine` (a P/D group's decode role), as capacity derives them:
    its inputs and layout (capacity/fit.py memory_inputs, plan_layout) through the one function
    that turns them into bytes a token a rank (capacity/memory.py token_bytes, what plan_fit
    reports as kv_bytes_per_token), without the fit's resident-sequence search."""
    inputs = memory_inputs(engine)
    layout = plan_layout(engine)
    per_rank = token_bytes(inputs, layout)
    ranks = layout.tensor * layout.pipeline
    return PerToken(
        main=per_rank.main_attention * ranks,
        indexer=per_rank.indexer * ranks,
        ranks=ranks,
        block_size=inputs.block_size,
        assumed=inputs.geometry.origin.unpublished,
    )


class BytesVerdict(NamedTuple):
    ok: bool | None  # None: the figures cannot tell (skipped, with why)
    reason: str


def _blocks(seen: KvTransferFacts, block_size: int, ranks: int) -> tuple[int, int]:
    """The fewest and most whole blocks the external prompt tokens can fill. NIXL reads a
    request's blocks whole (pull_worker.py `_read_blocks`, ids from the scheduler's allocation),
    so each request adds cdiv(its tokens, block_size); the requests are not in the counters, but
    each makes at least one transfer on every pulling rank, so there are at most
    transfers // ranks of them, each leaving at most block_size - 1 slots empty."""
    tokens = seen.external_prompt_tokens
    requests = max(1, min(seen.transfers // max(ranks, 1), tokens))
    fewest = -(-tokens // block_size)
    most = min(tokens, (tokens + requests * (block_size - 1)) // block_size)
    return fewest, max(fewest, most)


def judge_bytes(seen: KvTransferFacts, plan: PerToken) -> BytesVerdict:
    """Did every cache come over the wire? The bytes NIXL moved a token (over the whole blocks the
    external prompt tokens fill) against the plan's main + indexer bytes a token: below it fails,
    naming the indexer when main alone fits the figures. Skipped where the engine reports no
    bytes, or where the partial blocks leave both readings possible."""
    if not seen.nixl_exported or seen.transfers <= 0 or seen.external_prompt_tokens <= 0:
        return BytesVerdict(None, "no KV transfer to weigh (see kv-transfer)")
    if seen.failed_transfers > 0:
        # A failed read moved part of its blocks or none: short bytes would blame the wrong cache.
        return BytesVerdict(None, f"{seen.failed_transfers} transfers failed (see kv-transfer)")
    if not math.isfinite(seen.bytes_transferred):
        return BytesVerdict(False, f"the engine reports {seen.bytes_transferred} bytes transferred: no count")
    if seen.bytes_transferred <= 0:
        return BytesVerdict(
            None,
            f"the engine reports no bytes for its {seen.transfers} NIXL transfers "
            "(vllm:nixl_bytes_transferred absent or zero)",
        )
    block = seen.block_size or plan.block_size
    fewest, most = _blocks(seen, block, plan.ranks)
    high, low = seen.bytes_transferred / (fewest * block), seen.bytes_transferred / (most * block)
    measured = f"{low:,.0f}" if most == fewest else f"{low:,.0f}-{high:,.0f}"
    figures = (
        f"{seen.bytes_transferred:,.0f} bytes over {seen.external_prompt_tokens} external prompt tokens "
        f"({_span(fewest, most)} blocks of {block}) = {measured} bytes a token over {plan.ranks} decode "
        f"rank{'s' if plan.ranks > 1 else ''}; the plan's main {plan.main:,.0f}"
        + (f" + indexer {plan.indexer:,.0f} = {plan.total:,.0f}" if plan.indexer else "")
    )
    assumed = f" (capacity's geometry, unpublished: {', '.join(plan.assumed)})" if plan.assumed else ""
    main_fits = low <= plan.main * (1 + BYTES_TOLERANCE) and high >= plan.main * (1 - BYTES_TOLERANCE)
    if high < plan.total * (1 - BYTES_TOLERANCE):
        if plan.indexer and main_fits:
            return BytesVerdict(False, f"the indexer cache did not come over the wire: {figures}{assumed}")
        return BytesVerdict(False, f"fewer bytes than the plan's caches: {figures}{assumed}")
    if plan.indexer and main_fits:
        return BytesVerdict(
            None,
            f"cannot tell main + indexer from main alone: {figures}; the partial blocks of "
            f"up to {seen.transfers // plan.ranks or 1} requests allow both (a longer prompt tells them apart)",
        )
    return BytesVerdict(True, figures)


def _span(fewest: int, most: int) -> str:
    return str(fewest) if fewest == most else f"{fewest}-{most}"


def check_bytes(seen: KvTransferFacts, plan: PerToken, id: str = "kv-transfer-bytes") -> CheckResult:
    """judge_bytes as a server check (verify's shape): kv-transfer-bytes over all of verify's
    requests, pd-parity-bytes over pd-parity's long prompts alone."""
    verdict = judge_bytes(seen, plan)
    remedy = (
        "run both roles on one vLLM whose KV connector registers every cache (vLLM 0.32's "
        "NixlConnector registers the indexer's layers with the main cache's); with "
        "VLLM_LOGGING_LEVEL=DEBUG the decode log names each layer NIXL registers ('Registering "
        "layer ...'), the indexer's among them"
        if verdict.ok is False
        else ""
    )
    return judged(id, verdict.ok, verdict.reason, remedy)
