"""Prefill/decode disaggregation for real, natively (issue 36): a prefill vLLM and a decode vLLM
(the CPU build) paired by NixlConnector over UCX/TCP, vllm-router in front, an aggregated vLLM
with the same weights and flags as the reference. Greedy output through the router equals the
aggregated server's on short and long prompts; the decode instance's /metrics show the prompts'
KV came over the wire (m31ctl/served/kv_transfer.py); prefill killed, the router answers 5xx
and decode stays healthy; prefill back, the group serves again. tests/pd_group.py starts them.

The tiny model (plain Llama, m31ctl/rehearsal/make_tiny_model.py) has no sliding or sparse
window, so "long" here means many KV blocks (the CPU backend's block is 128 tokens,
platforms/cpu.py): the longest prompt (1,651 tokens) spans 13 of them, the last one partly filled."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from m31ctl.served import kv_transfer
from tests import pd_group

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SENTENCE = "the model serves tokens on four GPUs with sparse attention and a speculative draft; "
PROMPTS = {
    "short": "hello world, how are you today?",
    "two-blocks": SENTENCE * 12,
    "seven-blocks": "I am a tiny rehearsal model made for m31ctl tests. " * 70,
    "thirteen-blocks": SENTENCE * 110,
}
MAX_TOKENS = 16
# Prefill back: the router marks it healthy again within its health checks (every 5 s here, 2
# successes) and its circuit breaker's timeout; a busy machine gets ten minutes.
RECOVERY_S = 600.0


@pytest.fixture(scope="module")
def pd(vllm_py, tmp_path_factory) -> Iterator[tuple[pd_group.Group, dict[str, dict]]]:
    """The group, started, and the aggregated server's answers to PROMPTS (then it is stopped:
    two cores are enough for two vLLMs at a time, not three)."""
    if not pd_group.router_binary().exists():
        pytest.fail(f"{pd_group.router_binary()} is missing: scripts/setup-vllm installs vllm-router")
    work = tmp_path_factory.mktemp("pd")
    model = pd_group.make_tiny_model(work / "tiny-model")
    group = pd_group.Group(model, work / "logs", aggregated=True)
    with group:
        assert group.reference is not None
        references = {}
        for name, prompt in PROMPTS.items():
            answer = pd_group.completion(group.reference.url, prompt, MAX_TOKENS)
            assert answer.status == 200, answer.body[:500]
            references[name] = answer.json()
        group.stop_reference()
        yield group, references


def _text(answer: pd_group.Answer) -> str:
    assert answer.status == 200, answer.body[:500]
    return str(answer.json()["choices"][0]["text"])


def test_router_output_equals_aggregated_and_the_kv_came_over_the_wire(pd):
    group, references = pd
    before = kv_transfer.facts(pd_group.metrics_text(group.decode.url))
    prompt_tokens = 0
    for name, prompt in PROMPTS.items():
        through_router = pd_group.completion(group.router.url, prompt, MAX_TOKENS)
        reference = references[name]
        assert _text(through_router) == reference["choices"][0]["text"], name
        assert through_router.json()["usage"]["prompt_tokens"] == reference["usage"]["prompt_tokens"]
        prompt_tokens += reference["usage"]["prompt_tokens"]
    assert references["thirteen-blocks"]["usage"]["prompt_tokens"] > 12 * 128

    seen = kv_transfer.since(before, kv_transfer.facts(pd_group.metrics_text(group.decode.url)))
    print(f"decode /metrics over {len(PROMPTS)} requests ({prompt_tokens} prompt tokens): {seen}")
    verdict = kv_transfer.judge(seen)
    assert verdict.came_over_the_wire, verdict.reason
    assert seen.transfers >= len(PROMPTS)
    # The decode instance computes only what the transfer did not bring (the prompt's last
    # token, to sample from); an aggregated server would count every prompt token as local.
    assert seen.external_prompt_tokens > seen.local_prompt_tokens
    assert seen.external_prompt_tokens + seen.local_prompt_tokens + seen.cached_prompt_tokens == prompt_tokens

    # A stream passes through the router: the decode instance's tokens, the same greedy text.
    streamed = pd_group.streamed_completion(group.router.url, PROMPTS["seven-blocks"], MAX_TOKENS)
    assert streamed.text == references["seven-blocks"]["choices"][0]["text"]

    # The router's own Prometheus exporter, on the port chosen for it.
    exporter = pd_group.request(f"http://127.0.0.1:{group.router.prometheus_port}/metrics")
    assert exporter.status == 200 and "vllm_router" in exporter.body, exporter.body[:300]


def test_prefill_killed_the_router_answers_5xx_decode_stays_healthy_and_the_group_recovers(pd):
    group, references = pd
    group.prefill.process.kill()
    refused = pd_group.completion(group.router.url, PROMPTS["two-blocks"], MAX_TOKENS)
    print(f"prefill killed: the router answered HTTP {refused.status}: {refused.body[:300]}")
    assert 500 <= refused.status < 600, refused
    assert group.router.process.alive
    assert pd_group.healthy(group.decode.url)
    assert _text(pd_group.completion(group.decode.url, PROMPTS["short"], MAX_TOKENS))

    group.restart_prefill()
    before = kv_transfer.facts(pd_group.metrics_text(group.decode.url))
    answers: list[pd_group.Answer] = []

    def serves_again() -> bool:
        answers.append(pd_group.completion(group.router.url, PROMPTS["thirteen-blocks"], MAX_TOKENS))
        return answers[-1].status == 200

    pd_group.wait_until("the router serving again", serves_again, RECOVERY_S, [group.router.process])
    print(
        f"prefill back: {len(answers)} request(s) until the router served, statuses {[a.status for a in answers]}"
    )
    assert _text(answers[-1]) == references["thirteen-blocks"]["choices"][0]["text"]
    seen = kv_transfer.since(before, kv_transfer.facts(pd_group.metrics_text(group.decode.url)))
    verdict = kv_transfer.judge(seen)
    assert verdict.came_over_the_wire, verdict.reason
    assert pd_group.healthy(group.decode.url)
