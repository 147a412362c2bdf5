"""A prefill/decode pair's proof in a rehearsal (issue 36), once the router serves:

1. parity: greedy completions through the router equal an aggregated server's (the twin's own
   plan without disaggregation, same image, model and flags) on short and long prompts;
2. transfer: the decode instance's /metrics count those prompts' tokens as external KV transfer,
   with transfers and none failed (served/kv_transfer.py), not recomputed;
3. faults: prefill killed, the router answers 5xx and decode stays healthy; prefill started
   again (the same container, as the kubelet restarts one), the group serves again by itself.

The tiny model (plain Llama) has no sliding or sparse window, so "long" means many KV blocks
(the CPU backend's block is 128 tokens): the longest prompt spans 13. Side effects on
containers come through `Pair` (proofs.py's); HTTP through httpx and served/http_answers'
defensive reading. Waits are bounded and condition-driven: nothing is judged by speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import httpx

from m31ctl import interrupt
from m31ctl.served import http_answers, kv_transfer, prometheus, smoke

SENTENCE = "the model serves tokens on four GPUs with sparse attention and a speculative draft; "
PROMPTS = {
    "short": "hello world, how are you today?",
    "two-blocks": SENTENCE * 12,
    "seven-blocks": "I am a tiny rehearsal model made for m31ctl tests. " * 70,
    "thirteen-blocks": SENTENCE * 110,
}
MAX_TOKENS = 16
POLL_S = 2.0


class Pair(NamedTuple):
    """proofs.py's handles on the pair's containers and addresses."""

    router: str  # base URLs on the rehearsal network
    decode: str
    kill_prefill: Callable[[], str | None]  # None when done, else why not
    start_prefill: Callable[[], str | None]
    # Start the aggregated reference server and wait until it answers: its base URL, or why not.
    start_reference: Callable[[float], tuple[str, str | None]]
    model: str


class Parity(NamedTuple):
    prompt: str  # the prompt's name (PROMPTS)
    prompt_tokens: int
    router_text: str
    reference_text: str

    @property
    def same(self) -> bool:
        return self.router_text == self.reference_text


class PairingOutcome(NamedTuple):
    parity: tuple[Parity, ...]
    transfer: dict[str, Any]  # kv_transfer.KvTransferFacts over the parity prompts, as data
    transfer_verdict: str
    prefill_down_status: int  # the router's answer with prefill killed
    decode_healthy_when_prefill_down: bool
    recovered_after_s: float | None  # from prefill's restart to the router serving again
    failure: str | None  # the first check that failed, in words; None: all passed

    @property
    def ok(self) -> bool:
        return self.failure is None

    def to_json(self) -> dict[str, Any]:
        data = self._asdict()
        data["parity"] = [{**p._asdict(), "same": p.same} for p in self.parity]
        data["ok"] = self.ok
        return data


def _client(base: str, timeout: float) -> httpx.Client:
    return httpx.Client(base_url=base, headers=smoke.auth_headers(), timeout=timeout)


def completion(
    base: str, model: str, prompt: str, timeout: float, max_tokens: int = MAX_TOKENS
) -> http_answers.Answer:
    """One greedy completion, its answer read defensively (served/http_answers.py)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    with _client(base, timeout) as client:
        return http_answers.fetch(client, "POST", "/v1/completions", body, limit_s=timeout)


def text_and_tokens(answer: http_answers.Answer) -> tuple[str, int] | None:
    """The completion's text and prompt tokens; None unless a 200 with both."""
    data = http_answers.as_object(answer.data)
    choices = http_answers.as_list(data.get("choices"))
    usage = http_answers.as_object(data.get("usage"))
    text = http_answers.as_str(http_answers.as_object(choices[0]).get("text")) if choices else None
    tokens = http_answers.as_int(usage.get("prompt_tokens"))
    if answer.status != 200 or text is None or tokens is None:
        return None
    return text, tokens


def transfer_facts(decode: str, timeout: float) -> kv_transfer.KvTransferFacts:
    with _client(decode, timeout) as client:
        return kv_transfer.facts_of(prometheus.scrape(client))


def health(base: str, timeout: float) -> http_answers.Answer:
    with _client(base, timeout) as client:
        return http_answers.fetch(client, "GET", "/health", parse=False, limit_s=timeout)


def through_router(pair: Pair, timeout: float) -> tuple[dict[str, tuple[str, int]], str | None]:
    """Every prompt through the router: {name: (text, prompt tokens)}, or the first failure."""
    found: dict[str, tuple[str, int]] = {}
    for name, prompt in PROMPTS.items():
        answer = completion(pair.router, pair.model, prompt, timeout)
        got = text_and_tokens(answer)
        if got is None:
            return found, f"the router answered {name!r} with HTTP {answer.status}{answer.evidence()}"
        found[name] = got
    return found, None


def wait_serving_again(pair: Pair, budget_s: float, timeout: float) -> float | None:
    """Seconds until the router answers the longest prompt again; None within `budget_s`."""
    started = time.monotonic()
    while time.monotonic() - started < budget_s:
        if text_and_tokens(completion(pair.router, pair.model, PROMPTS["thirteen-blocks"], timeout)):
            return round(time.monotonic() - started, 1)
        interrupt.sleep(POLL_S)  # Ctrl-C and SIGTERM end the wait here
    return None


def prove(
    pair: Pair, budget_s: float, timeout: float = 120.0, progress: Callable[[str], None] = lambda _: None
) -> PairingOutcome:
    """The three proofs, in order; the first that fails is the outcome's failure (what came
    before it is reported as measured)."""
    before = transfer_facts(pair.decode, timeout)
    answers, failure = through_router(pair, timeout)
    seen = kv_transfer.since(before, transfer_facts(pair.decode, timeout))
    verdict = kv_transfer.judge(seen)
    progress(
        f"{len(answers)} of {len(PROMPTS)} prompts answered through the router; decode: {verdict.reason}"
    )
    outcome = PairingOutcome((), seen._asdict(), verdict.reason, 0, False, None, failure)
    if failure is None and not verdict.came_over_the_wire:
        outcome = outcome._replace(failure=f"the KV did not come over the wire: {verdict.reason}")
    if outcome.failure is None:
        outcome = faults(pair, outcome, budget_s, timeout)
        progress(
            f"prefill killed: the router answered HTTP {outcome.prefill_down_status}, decode "
            f"{'healthy' if outcome.decode_healthy_when_prefill_down else 'NOT healthy'}; prefill back: "
            + (
                f"serving again after {outcome.recovered_after_s} s"
                if outcome.recovered_after_s
                else "not serving"
            )
        )
    if outcome.failure is None:
        outcome = parity(pair, outcome, answers, budget_s, timeout)
        same = sum(p.same for p in outcome.parity)
        progress(f"parity with the aggregated server: {same} of {len(outcome.parity)} prompts equal")
    return outcome


def faults(pair: Pair, outcome: PairingOutcome, budget_s: float, timeout: float) -> PairingOutcome:
    refused = pair.kill_prefill()
    if refused is not None:
        return outcome._replace(failure=f"killing prefill failed: {refused}")
    down = completion(pair.router, pair.model, PROMPTS["two-blocks"], timeout)
    decode_health = health(pair.decode, timeout)
    decode_ok = decode_health.status == 200
    outcome = outcome._replace(prefill_down_status=down.status, decode_healthy_when_prefill_down=decode_ok)
    if not 500 <= down.status < 600:
        return outcome._replace(
            failure=f"prefill killed, the router answered HTTP {down.status}{down.evidence()}, not 5xx"
        )
    if not decode_ok:
        return outcome._replace(
            failure=f"prefill killed, decode's /health answered HTTP {decode_health.status}{decode_health.evidence()}"
        )
    refused = pair.start_prefill()
    if refused is not None:
        return outcome._replace(failure=f"starting prefill again failed: {refused}")
    recovered = wait_serving_again(pair, budget_s, timeout)
    outcome = outcome._replace(recovered_after_s=recovered)
    if recovered is None:
        return outcome._replace(
            failure=f"prefill back, the router did not serve again within {budget_s:.0f} s"
        )
    return outcome


def parity(
    pair: Pair, outcome: PairingOutcome, answers: dict[str, tuple[str, int]], budget_s: float, timeout: float
) -> PairingOutcome:
    reference, why_not = pair.start_reference(budget_s)
    if why_not is not None:
        return outcome._replace(failure=f"the aggregated reference server: {why_not}")
    found = []
    for name, (router_text, tokens) in answers.items():
        got = text_and_tokens(completion(reference, pair.model, PROMPTS[name], timeout))
        if got is None:
            return outcome._replace(failure=f"the aggregated reference server did not answer {name!r}")
        found.append(Parity(name, tokens, router_text, got[0]))
    outcome = outcome._replace(parity=tuple(found))
    differ = [p.prompt for p in found if not p.same]
    if differ:
        return outcome._replace(
            failure=f"greedy output through the router differs from aggregated on {differ}"
        )
    return outcome
