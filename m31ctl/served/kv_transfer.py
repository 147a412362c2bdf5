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
(`since`). Pure: text in, typed facts out; the scrape is prometheus.scrape's.
"""

from __future__ import annotations

from typing import NamedTuple

from m31ctl.checks import CheckResult, judged
from m31ctl.served import prometheus

TRANSFERS = "vllm:nixl_xfer_time_seconds_count"
BYTES = "vllm:nixl_bytes_transferred_sum"
FAILED = "vllm:nixl_num_failed_transfers_total"
PROMPT_TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
EXTERNAL = "external_kv_transfer"
LOCAL_COMPUTE = "local_compute"
LOCAL_CACHE_HIT = "local_cache_hit"


class KvTransferFacts(NamedTuple):
    """The transfer counters of one instance, summed over its engines."""

    nixl_exported: bool  # the NIXL metrics are there at all (a NixlConnector is configured)
    transfers: int
    bytes_transferred: float
    failed_transfers: int
    external_prompt_tokens: int  # prompt tokens whose KV a connector brought in
    local_prompt_tokens: int  # prompt tokens this instance computed itself
    cached_prompt_tokens: int  # prompt tokens from its own prefix cache


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
        transfers=int(found.total(TRANSFERS)),
        bytes_transferred=found.total(BYTES),
        failed_transfers=int(found.total(FAILED)),
        external_prompt_tokens=int(by_source.get(EXTERNAL, 0.0)),
        local_prompt_tokens=int(by_source.get(LOCAL_COMPUTE, 0.0)),
        cached_prompt_tokens=int(by_source.get(LOCAL_CACHE_HIT, 0.0)),
    )


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
