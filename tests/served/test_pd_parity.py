"""verify's pd-parity (m31ctl/served/pd_parity.py, issue 49): the router's greedy completions
against the prefill role's alone, at prompt lengths past MiniMax-M3's sparse window.

The fakes answer at the HTTP seam as the real pair did: tests/fixtures/pd/parity-capture.json
is vLLM 0.32's CPU build behind vllm-router 0.1.17 (tests/runtime/test_launch_pd.py's group):
/tokenize's shape, a token-id completion's (`token_ids` with return_token_ids) on prefill alone
and through the router, and the 400 of a prompt past max_model_len. The decode's counters are
the names and labels of tests/fixtures/pd/decode-metrics.txt, moved by each routed request as
NIXL moves whole blocks of every layer (served/kv_transfer.py)."""

from __future__ import annotations

import contextlib
import copy
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from m31ctl.checks import CheckStatus
from m31ctl.deployment import Deployment, derive
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.rehearsal.make_tiny_m3 import TEXT_CONFIG
from m31ctl.served import kv_transfer, pd_parity, verify
from m31ctl.served.verified import VerifyReport

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CAPTURE = json.loads((FIXTURES / "pd" / "parity-capture.json").read_text())
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 2048,
    "vocab_size": 512, "intermediate_size": 512, "torch_dtype": "bfloat16",
}  # fmt: skip


def _plan(tmp_path: Path, config: dict[str, Any], hardware: str = "cpu", *sets: str) -> Deployment:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(config))
    variant = "pd" if hardware == "cpu" else None
    extra = () if hardware == "cpu" else ("disaggregation.enabled=true",)
    request = PlanRequest(simulated(hardware), variant=variant, sets=(f"model.path={model}", *extra, *sets))
    return derive(resolve(request))


@pytest.fixture(scope="module")
def cpu_pair(tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    """The cpu recipe's pd plan over the tiny Llama the real group serves (no sparse attention)."""
    return _plan(tmp_path_factory.mktemp("llama"), TINY_LLAMA)


@pytest.fixture(scope="module")
def gpu_pair() -> Deployment:
    """A 256K MiniMax-M3.1 P/D plan (the checkpoint not on this host: recipes/models.yaml)."""
    return derive(resolve(PlanRequest(simulated("b300x8"), sets=("disaggregation.enabled=true",))))


def test_the_window_is_the_models_top_k_blocks(gpu_pair: Deployment):
    chosen = pd_parity.lengths(gpu_pair)
    assert gpu_pair.plan.settings.serving.max_model_len == 262_144
    assert chosen.window is not None and chosen.window.value == 16 * 128
    assert "sparse_topk_blocks" in chosen.window.source and "sparse_block_size" in chosen.window.source
    assert chosen.prompts == (2_048 + 192, 8_192, 65_536) and chosen.reached


def test_the_cpu_pair_checks_the_longest_prompt_it_holds(cpu_pair: Deployment, tmp_path: Path):
    assert pd_parity.lengths(cpu_pair).prompts == (2_048 - pd_parity.MAX_TOKENS,)
    assert "states no sparse window" in pd_parity.lengths(cpu_pair).said()
    # The tiny M3 (make_tiny_m3.py's config: the real window, 2,048 positions served) cannot pass it.
    tiny_m3 = _plan(tmp_path, {"architectures": ["MiniMaxM3SparseForCausalLM"], "text_config": TEXT_CONFIG})
    chosen = pd_parity.lengths(tiny_m3)
    assert (
        chosen.window is not None and chosen.window.value == 2_048 and "config.json" in chosen.window.source
    )
    assert chosen.prompts == (2_032,) and not chosen.reached
    assert "the sparse window (2,048 tokens) was not reached" in chosen.said()


def test_a_plan_that_holds_8k_but_not_64k(tmp_path: Path):
    plan = _plan(tmp_path, {"architectures": ["MiniMaxM3SparseForCausalLM"], "text_config": TEXT_CONFIG}, "b300x8",
                 "serving.max_model_len=16384")  # fmt: skip
    assert pd_parity.lengths(plan).prompts == (2_240, 8_192)


class Pair:
    """What the fake pair does: prefill's answers, the router's, decode's counters."""

    def __init__(self, per_token: float, block: int) -> None:
        self.per_token, self.block = per_token, block
        self.diverge_past: int | None = None  # the router writes another token past this prompt length
        self.router_status = 200
        self.prefill_status = 200
        self.transfers = 0
        self.bytes = 0.0
        self.external = 0
        self.routed: list[int] = []

    def tokenize(self, body: dict[str, Any]) -> tuple[int, Any]:
        text = str(body["prompt"])
        ids = [sum(map(ord, text[i : i + 4])) % 500 for i in range(0, len(text), 4)]  # 4 characters a token
        answer = dict(CAPTURE["tokenize"], tokens=ids, count=len(ids))
        return 200, answer

    def complete(self, body: dict[str, Any], routed: bool) -> tuple[int, Any]:
        prompt = body["prompt"]
        status = self.router_status if routed else self.prefill_status
        if status != 200:
            return status, CAPTURE["too_long"]["body"]
        answer = copy.deepcopy(CAPTURE["router" if routed else "prefill_alone"])
        choice = answer["choices"][0]
        choice["prompt_token_ids"] = prompt
        ids = list(choice["token_ids"])[: body["max_tokens"]]
        if routed:
            self.routed.append(len(prompt))
            self.transfers += 1
            self.external += len(prompt)
            self.bytes += -(-len(prompt) // self.block) * self.block * self.per_token
            if self.diverge_past is not None and len(prompt) > self.diverge_past:
                ids[3] = 9
        choice["token_ids"] = ids
        answer["usage"]["prompt_tokens"] = len(prompt)
        return 200, answer

    def metrics(self) -> str:
        labels = 'engine="0",model_name="tiny"'
        return (
            f"vllm:nixl_xfer_time_seconds_count{{{labels}}} {float(self.transfers)}\n"
            f"vllm:nixl_bytes_transferred_sum{{{labels}}} {self.bytes}\n"
            f"vllm:nixl_num_failed_transfers_total{{{labels}}} 0.0\n"
            f'vllm:prompt_tokens_by_source_total{{{labels},source="external_kv_transfer"}} {float(self.external)}\n'
            f'vllm:cache_config_info{{block_size="{self.block}",cache_dtype="auto",{labels}}} 1.0\n'
        )


def _handler(pair: Pair, role: str) -> type[BaseHTTPRequestHandler]:
    class Role(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            if self.path == "/metrics" and role == "decode":
                self._send(200, pair.metrics().encode())
            else:
                self._send(404, b"{}")

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/tokenize" and role == "prefill":
                status, answer = pair.tokenize(body)
            elif self.path == "/v1/completions" and role in ("prefill", "router"):
                status, answer = pair.complete(body, routed=role == "router")
            else:
                status, answer = 404, {}
            self._send(status, json.dumps(answer).encode())

        def _send(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return Role


@contextlib.contextmanager
def _serving(pair: Pair) -> Iterator[dict[str, str]]:
    servers = {
        role: ThreadingHTTPServer(("127.0.0.1", 0), _handler(pair, role))
        for role in ("router", "prefill", "decode")
    }
    for server in servers.values():
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield {role: f"http://127.0.0.1:{s.server_address[1]}" for role, s in servers.items()}
    finally:
        for server in servers.values():
            server.shutdown()
            server.server_close()


def _pair_of(deployment: Deployment) -> Pair:
    plan = kv_transfer.per_token(deployment.answering_engine)
    return Pair(plan.total, plan.block_size)


def _checked(deployment: Deployment, pair: Pair) -> tuple[dict[str, Any], VerifyReport]:
    report = VerifyReport("router", deployment.plan.hash)
    with _serving(pair) as url, httpx.Client(base_url=url["decode"]) as metrics:
        pd_parity.check(deployment, url["router"], url["prefill"], metrics, report)
    return {c.id: c for c in report.checks}, report


def test_parity_past_the_window_passes_with_every_cache_weighed(gpu_pair: Deployment):
    pair = _pair_of(gpu_pair)
    checks, report = _checked(gpu_pair, pair)
    assert checks["pd-parity"].status == CheckStatus.OK, checks["pd-parity"]
    assert checks["pd-parity"].message == (
        "prompts of 2,240, 8,192, 65,536 tokens (past the sparse window of 2,048): "
        "tokens equal through the router and on prefill alone 16/16, 16/16, 16/16"
    )
    assert pair.routed == [2_240, 8_192, 65_536]  # exactly the lengths chosen, as token ids
    assert checks["pd-parity-bytes"].status == CheckStatus.OK, checks["pd-parity-bytes"]
    assert "indexer" in checks["pd-parity-bytes"].message
    facts = report.facts["pd_parity"]
    assert facts["window_reached"] and facts["sparse_window"] == 2_048
    assert [c["matched"] for c in facts["compared"]] == [16, 16, 16]
    assert facts["kv_transfer"]["external_prompt_tokens"] == 2_240 + 8_192 + 65_536


def test_a_divergence_past_the_window_fails_with_its_position(gpu_pair: Deployment):
    pair = _pair_of(gpu_pair)
    pair.diverge_past = 2_048
    checks, report = _checked(gpu_pair, pair)
    parity = checks["pd-parity"]
    assert parity.status == CheckStatus.FAIL
    assert "16/16" not in parity.message.split("alone ")[1].split(";")[0]
    assert (
        "at 2,240 prompt tokens they part at completion token 4 (position 2,243): router 9, prefill alone 8"
        in (parity.message)
    )
    assert "indexer" in parity.remedy
    assert report.facts["pd_parity"]["compared"][0]["divergence"].startswith("completion token 4")


def test_the_cpu_pair_says_it_did_not_pass_the_window(cpu_pair: Deployment):
    checks, report = _checked(cpu_pair, _pair_of(cpu_pair))
    assert checks["pd-parity"].status == CheckStatus.OK, checks["pd-parity"]
    assert checks["pd-parity"].message.startswith(
        "prompts of 2,032 tokens (the model states no sparse window)"
    )
    assert report.facts["pd_parity"]["window_reached"] is False


@pytest.mark.parametrize("broken", ["router", "prefill"])
def test_an_error_of_either_side_fails_cleanly(cpu_pair: Deployment, broken: str):
    pair = _pair_of(cpu_pair)
    if broken == "router":
        pair.router_status = 500
    else:
        pair.prefill_status = 400
    checks, _ = _checked(cpu_pair, pair)
    parity = checks["pd-parity"]
    assert parity.status == CheckStatus.FAIL
    who = (
        "the router, 2,032-token prompt: HTTP 500"
        if broken == "router"
        else "prefill alone, 2,032-token prompt: HTTP 400"
    )
    assert who in parity.message and "maximum context length" in parity.message, parity.message
    assert "pd-parity-bytes" not in checks and not parity.remedy


def test_a_bare_url_skips_saying_why(cpu_pair: Deployment):
    report = VerifyReport("router", cpu_pair.plan.hash)
    pd_parity.check(cpu_pair, "http://127.0.0.1:9", None, None, report)
    (parity,) = report.checks
    assert parity.status == CheckStatus.SKIP and "names no prefill role" in parity.message


def test_verify_of_a_pd_group_runs_pd_parity(cpu_pair: Deployment):
    """verify.run with the group's addresses (Target.prefill_base): the check is in its report;
    the router's other paths 404 here (verify's function checks fail, not this test's)."""
    pair = _pair_of(cpu_pair)
    with _serving(pair) as url:
        report = verify.run(
            cpu_pair, url["router"], engine_base=url["decode"], prefill_base=url["prefill"],
            server_plan_hash=None, bench=None,
        )  # fmt: skip
    checks = {c.id: c for c in report.checks}
    assert checks["pd-parity"].status == CheckStatus.OK, checks["pd-parity"]
    assert checks["kv-transfer"].status == CheckStatus.OK, checks["kv-transfer"]
