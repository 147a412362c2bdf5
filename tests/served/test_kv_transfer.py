"""The transfer facts of a decode instance's /metrics (m31ctl/served/kv_transfer.py), read from a
real capture: tests/fixtures/pd/decode-metrics.txt is the decode vLLM's /metrics (the CPU build,
NixlConnector kv_consumer, scripts/pd_group.py's flags) after two requests through vllm-router (8
and 901 prompt tokens: all 909 counted as external KV transfer) and then the same two asked of the decode instance directly."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from m31ctl.capacity.fit import memory_inputs, plan_fit, plan_layout
from m31ctl.capacity.memory import token_bytes
from m31ctl.checks import CheckStatus
from m31ctl.deployment import Deployment, derive
from m31ctl.hardware import simulated
from m31ctl.plan.resolve import PlanRequest, resolve
from m31ctl.rehearsal.make_tiny_model import CONFIG
from m31ctl.served import kv_transfer, verify
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
        block_size=128,  # vllm:cache_config_info: the CPU platform's block (vllm/platforms/cpu.py)
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
    assert between.block_size == 128  # a fact of the engine, not a counter: the later scrape's
    assert not kv_transfer.judge(kv_transfer.since(after, after)).came_over_the_wire  # nothing happened


# The bytes a token (served/kv_transfer.py judge_bytes), calibrated on the same capture: the
# rehearsal's pd plan over the tiny Llama's own config.json, its decode role's figure as verify
# reads it (kv_transfer.per_token: capacity's plan_fit, per rank, times the ranks that pull).


@pytest.fixture(scope="module")
def pd_group(tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    """The cpu recipe's pd plan over a folder holding the tiny Llama's config.json."""
    model = tmp_path_factory.mktemp("tiny-config")
    (model / "config.json").write_text(
        json.dumps({**CONFIG, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    return derive(resolve(PlanRequest(simulated("cpu"), variant="pd", sets=(f"model.path={model}",))))


@pytest.fixture(scope="module")
def decode_role(pd_group: Deployment) -> Deployment:
    assert pd_group.disaggregated is not None
    return pd_group.disaggregated.decode


def _buckets(name: str) -> dict[float, float]:
    found = kv_transfer.prometheus.parse(CAPTURE).samples[name]
    return {float(s.labels["le"]): s.value for s in found}


def test_the_captured_bytes_are_whole_blocks_of_every_layer_to_the_byte(decode_role: Deployment):
    """What vllm:nixl_bytes_transferred counts, shown on the capture: NIXL's totalBytes of each
    READ (nixl/stats.py record_transfer), the sum of its descriptors, one whole block of every
    registered layer (nixl/base_worker.py register_kv_caches: K and V packed, one region a layer).
    The two requests of 8 and 901 prompt tokens fill cdiv(8, 128) + cdiv(901, 128) = 1 + 8
    blocks of 128 tokens, each token 2 layers x (K, V) x 4 KV heads x 64 dims x 2 bytes."""
    plan = kv_transfer.per_token(decode_role)
    assert plan == kv_transfer.PerToken(main=2048.0, indexer=0.0, ranks=1, block_size=128)
    blocks = [-(-tokens // plan.block_size) for tokens in (8, 901)]
    assert blocks == [1, 8]
    block_bytes = plan.block_size * plan.total
    assert sum(blocks) * block_bytes == kv_transfer.facts(CAPTURE).bytes_transferred == 2_359_296
    # Each transfer on its own, as the histogram put it: 262,144 in (131,072, 524,288], and
    # 2,097,152 in (524,288, 2,097,152] (Prometheus buckets are upper-inclusive).
    buckets = _buckets("vllm:nixl_bytes_transferred_bucket")
    assert (buckets[131072.0], buckets[524288.0], buckets[2097152.0]) == (0.0, 1.0, 2.0)
    assert 131_072 < 1 * block_bytes <= 524_288 < 8 * block_bytes <= 2_097_152
    # The engine's own page: 1 GiB of KV over 4,096 blocks is the same 262,144 bytes a block.
    info = kv_transfer.prometheus.parse(CAPTURE).labels("vllm:cache_config_info")
    assert int(info["kv_cache_memory_bytes"]) // int(info["num_gpu_blocks"]) == block_bytes
    # 2 descriptors a read: NIXL merges a region's contiguous blocks into one (nixl_agent.cpp
    # makeXferReq), leaving one a layer; the bytes are the blocks' all the same.
    descriptors = kv_transfer.prometheus.parse(CAPTURE).total("vllm:nixl_num_descriptors_sum")
    assert descriptors == 2 * CONFIG["num_hidden_layers"]


def test_the_capture_carries_every_cache_of_the_plan(decode_role: Deployment):
    verdict = kv_transfer.judge_bytes(kv_transfer.facts(CAPTURE), kv_transfer.per_token(decode_role))
    # 909 tokens in two requests fill 8 or 9 blocks: 2,048-2,304 bytes a token, the plan's 2,048
    # at the most blocks (the 9 the two requests did fill).
    assert verdict == (
        True,
        "2,359,296 bytes over 909 external prompt tokens (8-9 blocks of 128) = 2,048-2,304 bytes a "
        "token over 1 decode rank; the plan's main 2,048",
    )
    result = kv_transfer.check_bytes(kv_transfer.facts(CAPTURE), kv_transfer.per_token(decode_role))
    assert result.status == CheckStatus.OK and result.id == "kv-transfer-bytes" and not result.remedy


def _with_indexer(decode_role: Deployment, indexer_dim: int) -> kv_transfer.PerToken:
    """The decode role's figure had its model an indexer key cache on both layers (MiniMax-M3's
    MSA layers): capacity's token_bytes on the tiny geometry with sparse layers added."""
    inputs = memory_inputs(decode_role)
    sparse = inputs._replace(geometry=inputs.geometry._replace(sparse_layers=2, indexer_dim=indexer_dim))
    per_rank = token_bytes(sparse, plan_layout(decode_role))
    return kv_transfer.per_token(decode_role)._replace(main=per_rank.main_attention, indexer=per_rank.indexer)


def test_main_alone_fails_naming_the_indexer(decode_role: Deployment):
    """The capture as a pair that moves only the main cache would show it: transfers, external
    prompt tokens and no failures (kv-transfer passes), but 2,048-2,304 bytes a token where the
    plan's main + indexer is 2,048 + 512 (2 layers x 128 dims of bf16 index keys)."""
    plan = _with_indexer(decode_role, indexer_dim=128)
    assert (plan.main, plan.indexer) == (2048.0, 512.0)
    seen = kv_transfer.facts(CAPTURE)
    assert kv_transfer.judge(seen).came_over_the_wire  # the counters still look healthy
    verdict = kv_transfer.judge_bytes(seen, plan)
    assert verdict.ok is False
    assert verdict.reason == (
        "the indexer cache did not come over the wire: 2,359,296 bytes over 909 external prompt "
        "tokens (8-9 blocks of 128) = 2,048-2,304 bytes a token over 1 decode rank; the plan's main "
        "2,048 + indexer 512 = 2,560"
    )
    result = kv_transfer.check_bytes(seen, plan)
    assert result.status == CheckStatus.FAIL and "'Registering layer ...'" in result.remedy


def test_partial_blocks_that_hide_a_small_indexer_skip_and_one_long_prompt_tells():
    """An indexer a ninth of main (the tiny M3's share) hides in the capture's partial blocks:
    the 909 tokens fill 8 or 9 blocks, and 9 x main = 8 x (main + indexer). Skipped, not passed.
    One prompt past the sparse window (2,100 tokens, 17 blocks exactly) tells them apart."""
    plan = kv_transfer.PerToken(main=2048.0, indexer=256.0, ranks=1, block_size=128)
    hidden = kv_transfer.judge_bytes(kv_transfer.facts(CAPTURE), plan)
    assert hidden.ok is None and hidden.reason.startswith("cannot tell main + indexer from main alone: ")
    long = kv_transfer.facts(CAPTURE)._replace(transfers=1, external_prompt_tokens=2100)
    main_only = kv_transfer.judge_bytes(long._replace(bytes_transferred=17 * 128 * 2048.0), plan)
    assert main_only.ok is False and main_only.reason.startswith("the indexer cache did not come over")
    assert "(17 blocks of 128) = 2,048 bytes a token" in main_only.reason
    both = kv_transfer.judge_bytes(long._replace(bytes_transferred=17 * 128 * 2304.0), plan)
    assert both.ok is True


def test_bytes_a_token_are_summed_over_the_ranks_that_pull():
    """Each decode rank reads its own share (a KV head slice of main, its own copy of the
    replicated indexer): the figure is capacity's a rank times TP x PP, and a request makes a
    transfer on every rank. The b300x8 P/D decode (TP4): main 8,640 + indexer 4,320 a rank."""
    group = derive(resolve(PlanRequest(simulated("b300x8"), sets=("disaggregation.enabled=true",))))
    assert group.disaggregated is not None
    plan = kv_transfer.per_token(group.disaggregated.decode)
    assert (plan.main, plan.indexer, plan.ranks, plan.block_size) == (34_560.0, 17_280.0, 4, 128)
    # The same fact `m31ctl capacity` reports for the role (plan_fit's kv_bytes_per_token), per rank.
    per_rank = plan_fit(group.disaggregated.decode).kv_bytes_per_token
    assert (per_rank.main_attention * 4, per_rank.indexer * 4) == (plan.main, plan.indexer)
    assert plan.assumed == ("sparse_layers=60", "indexer_dim=128")  # said in a failure's line
    # One 4,096-token request over 4 ranks: 32 blocks each, all caches.
    seen = kv_transfer.KvTransferFacts(True, 4, 32 * 128 * plan.total, 0, 4096, 0, 0, 128)
    assert kv_transfer.judge_bytes(seen, plan).ok is True
    missing = kv_transfer.judge_bytes(seen._replace(bytes_transferred=32 * 128 * plan.main), plan)
    assert missing.ok is False and missing.reason.endswith("unpublished: sparse_layers=60, indexer_dim=128)")


def test_an_engine_that_reports_no_bytes_is_skipped_with_the_reason(decode_role: Deployment):
    text = "\n".join(line for line in CAPTURE.splitlines() if "nixl_bytes_transferred" not in line) + "\n"
    verdict = kv_transfer.judge_bytes(kv_transfer.facts(text), kv_transfer.per_token(decode_role))
    assert verdict == (
        None,
        "the engine reports no bytes for its 2 NIXL transfers (vllm:nixl_bytes_transferred absent or zero)",
    )
    nothing = kv_transfer.since(kv_transfer.facts(CAPTURE), kv_transfer.facts(CAPTURE))
    assert kv_transfer.judge_bytes(nothing, kv_transfer.per_token(decode_role)).ok is None
    # A failed transfer is kv-transfer's failure; its missing bytes name no cache.
    failed = kv_transfer.facts(CAPTURE)._replace(failed_transfers=1, bytes_transferred=1.0)
    verdict = kv_transfer.judge_bytes(failed, kv_transfer.per_token(decode_role))
    assert verdict == (None, "1 transfers failed (see kv-transfer)")


def test_a_server_that_reports_no_count_fails_the_check(decode_role: Deployment):
    """A hostile or broken /metrics: NaN bytes is no figure to pass on."""
    text = _edited(
        'vllm:nixl_bytes_transferred_sum{engine="0",model_name="tiny"} 2.359296e+06',
        'vllm:nixl_bytes_transferred_sum{engine="0",model_name="tiny"} NaN',
    )
    verdict = kv_transfer.judge_bytes(kv_transfer.facts(text), kv_transfer.per_token(decode_role))
    assert verdict == (False, "the engine reports nan bytes transferred: no count")


class _Decode(BaseHTTPRequestHandler):
    """A decode role's /metrics as verify scrapes it: no transfer at the first scrape, the
    capture's after; every other path 404 (verify's function checks fail, which is not this test's)."""

    scrapes = 0

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path != "/metrics":
            self._send(404, b"{}")
            return
        type(self).scrapes += 1
        text = CAPTURE if type(self).scrapes > 1 else "vllm:num_requests_running 0.0\n"
        self._send(200, text.encode())

    def do_POST(self) -> None:
        self._send(404, b"{}")

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def _decode() -> Iterator[str]:
    _Decode.scrapes = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Decode)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_verify_of_a_pd_plan_weighs_the_decodes_bytes(pd_group: Deployment):
    """verify.run of the pd plan: kv-transfer and kv-transfer-bytes from the decode's counters
    between its first and last scrape, the bytes against the decode role's own figure."""
    with _decode() as url:
        report = verify.run(pd_group, url, engine_base=url, server_plan_hash=None, bench=None)
    checks = {c.id: c for c in report.checks}
    assert checks["kv-transfer"].status == CheckStatus.OK
    assert checks["kv-transfer-bytes"].status == CheckStatus.OK, checks["kv-transfer-bytes"]
    assert checks["kv-transfer-bytes"].message.endswith("over 1 decode rank; the plan's main 2,048")
    assert report.facts["kv_transfer"]["bytes_transferred"] == 2_359_296.0


def test_counters_that_are_no_number_fail_the_judgement_not_verify():
    """+Inf transfers or NaN failures (a broken /metrics) read as nothing moved and a failure,
    where int() raised and verify crashed."""
    text = _edited(
        'vllm:nixl_xfer_time_seconds_count{engine="0",model_name="tiny"} 2.0',
        'vllm:nixl_xfer_time_seconds_count{engine="0",model_name="tiny"} +Inf',
    )
    assert kv_transfer.judge(kv_transfer.facts(text)).reason.startswith("no KV transfer happened: ")
    text = _edited(
        'vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny"} 0.0',
        'vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny"} NaN',
    )
    assert kv_transfer.judge(kv_transfer.facts(text)).reason.startswith("failed transfers: ")
