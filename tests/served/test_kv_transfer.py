"""The transfer facts of a decode instance's /metrics (m31ctl/served/kv_transfer.py), read from a
real capture: tests/fixtures/pd/decode-metrics.txt is the decode vLLM's /metrics (the CPU build,
NixlConnector kv_consumer, scripts/pd_group.py's flags) after two requests through vllm-router (8
and 901 prompt tokens: all 909 counted as external KV transfer) and then the same two asked of the decode instance directly."""

from __future__ import annotations

from m31ctl.checks import CheckStatus
from m31ctl.served import kv_transfer
from tests.conftest import FIXTURES

CAPTURE = (FIXTURES / "pd" / "decode-metrics.txt").read_text()


def test_the_capture_reads_as_the_engine_counted_it():
    seen = kv_transfer.facts(CAPTURE)
    assert seen == kv_transfer.KvTransferFacts(
        nixl_exported=True,
        transfers=2,
        bytes_transferred=2_359_296.0,
        failed_transfers=0,
        external_prompt_tokens=909,
        local_prompt_tokens=13,
        # The direct requests found the transferred KV in the decode instance's prefix cache.
        cached_prompt_tokens=896,
    )
    # vLLM's own invariant (v1/metrics/stats.py PromptTokenStats): the sources sum to the total.
    total = kv_transfer.prometheus.parse(CAPTURE).total("vllm:prompt_tokens_total")
    assert seen.external_prompt_tokens + seen.local_prompt_tokens + seen.cached_prompt_tokens == total


def test_the_kv_came_over_the_wire():
    verdict = kv_transfer.judge(kv_transfer.facts(CAPTURE))
    assert verdict.came_over_the_wire
    assert "2 NIXL transfers, 2,359,296 bytes, 0 failed" in verdict.reason
    result = kv_transfer.check(kv_transfer.facts(CAPTURE))
    assert result.status == CheckStatus.OK and result.id == "kv-transfer" and not result.remedy


def _edited(old: str, new: str) -> str:
    assert old in CAPTURE
    return CAPTURE.replace(old, new)


def test_a_failed_transfer_fails_the_judgement():
    text = _edited(
        'vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny"} 0.0',
        'vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny"} 1.0',
    )
    verdict = kv_transfer.judge(kv_transfer.facts(text))
    assert not verdict.came_over_the_wire and verdict.reason.startswith("failed transfers: ")
    assert kv_transfer.check(kv_transfer.facts(text)).status == CheckStatus.FAIL


def test_recomputed_prompts_are_not_a_transfer():
    """A decode that recomputed its prompts counts them as local_compute, not external."""
    text = _edited(
        'source="external_kv_transfer"} 909.0',
        'source="external_kv_transfer"} 0.0',
    )
    verdict = kv_transfer.judge(kv_transfer.facts(text))
    assert not verdict.came_over_the_wire and "no prompt token came from the KV transfer" in verdict.reason


def test_an_instance_without_a_connector():
    """An aggregated server's /metrics: no NIXL families at all."""
    text = "\n".join(line for line in CAPTURE.splitlines() if "nixl" not in line) + "\n"
    seen = kv_transfer.facts(text)
    assert not seen.nixl_exported and seen.transfers == 0
    assert "no NixlConnector" in kv_transfer.judge(seen).reason


def test_since_counts_only_what_happened_in_between():
    after = kv_transfer.facts(CAPTURE)
    before = after._replace(transfers=1, bytes_transferred=1_000_000.0, external_prompt_tokens=7)
    between = kv_transfer.since(before, after)
    assert (between.transfers, between.bytes_transferred, between.external_prompt_tokens) == (
        1,
        1_359_296.0,
        902,
    )
    assert not kv_transfer.judge(kv_transfer.since(after, after)).came_over_the_wire  # nothing happened
