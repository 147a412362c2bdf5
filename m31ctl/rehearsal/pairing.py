"""A prefill/decode pair's proof in a rehearsal (issue 36), once the router serves:

1. transfer: the decode instance's /metrics count the prompts' tokens as external KV transfer,
   with transfers and none failed (served/kv_transfer.py), not recomputed;
2. parity: greedy completions through the router equal the prefill role's own, asked directly
   (a request without kv_transfer_params is prefill's alone, served start to end: the reference
   verify's pd-parity uses, docs/decisions.md), on short and long prompts;
3. the router's front (issue 49): a completion without the key is 401, worker management
   (registering an address that is no role) is 404 with the key or without, and the router's own
   list of workers, read on its loopback inside its container as an operator would, is unchanged;
4. faults: prefill killed (its container ended), the router answers 5xx, decode answers
   /health and no KV moved; prefill started again (the same container in the same pod, as the
   kubelet restarts one), it answers /health, the router serves again by itself and the answer's
   KV came over the wire from the restarted prefill.

The tiny model (plain Llama) has no sliding or sparse window, so "long" means many KV blocks
(the CPU backend's block is 128 tokens): the longest prompt spans 13. Side effects on
containers come through `Pair` (proofs.py's); HTTP through httpx and served/http_answers'
defensive reading. Every step is judged by state (an answer, a role's /health, decode's
transfer counters), and each wait is bounded by a clock of the plan (PairClocks): a request
that gets no answer is asked again until that clock runs out, never judged by one client
timeout, so a slow host takes longer and reads the same.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import httpx

from m31ctl import interrupt
from m31ctl.redact import API_KEY_ENV
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
# vllm-router's own counts (vllm_router/router_args.py 0.1.17, not rendered): a worker is taken
# out after this many failed health checks in a row, and back after this many passed.
ROUTER_HEALTH_FAILURES = 3
ROUTER_HEALTH_SUCCESSES = 2


class PairClocks(NamedTuple):
    """How long each step of the faults may take, from the plan's clocks (the twin's
    Deployment, read once by prepared.pair_clocks): never a figure of how fast this host is."""

    # The router answers with prefill down: at once when prefill's pod refuses the connection,
    # else once its health checks take prefill out (failures x (interval + timeout)).
    router_down_s: float
    # A role answers /health: the router's own health-check timeout, which it holds them to.
    health_s: float
    # Prefill started again answers /health: its readiness wait (the timeline's ready_s, what
    # its startup probe allows).
    prefill_ready_s: float
    # The router takes prefill back once it answers: successes x (interval + timeout).
    router_back_s: float


class Pair(NamedTuple):
    """proofs.py's handles on the pair's containers and addresses."""

    router: str  # base URLs on the rehearsal network
    decode: str
    prefill: str
    kill_prefill: Callable[[], str | None]  # None once its container has ended, else why not
    start_prefill: Callable[[], str | None]
    model: str
    clocks: PairClocks
    # The router's own list of workers (its /list_workers on the loopback of its container, which
    # the front does not expose), or why it could not be read.
    router_workers: Callable[[], tuple[str, str | None]] = lambda: ("", "not asked")


class Parity(NamedTuple):
    prompt: str  # the prompt's name (PROMPTS)
    prompt_tokens: int
    router_text: str
    reference_text: str  # the prefill role's own answer, asked directly

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
    # How long the router took to answer with prefill down (None: not asked, or no answer).
    prefill_down_answer_s: float | None = None
    prefill_restarted: bool = False  # the recovery step ran (prefill was started again)
    # Decode's counters over the recovery: the answer's KV came from the restarted prefill.
    recovery_transfer_verdict: str = ""
    # The front's answers: {what was asked: HTTP status}, in the order asked (guard()).
    front: tuple[tuple[str, int], ...] = ()

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


class Waited(NamedTuple):
    answer: http_answers.Answer  # the last answer (status 0: none came)
    after_s: float  # from the wait's start to that answer
    ok: bool  # it passed the wait's test


def wait_for(
    ask: Callable[[float], http_answers.Answer], passes: Callable[[http_answers.Answer], bool], bound_s: float
) -> Waited:
    """Ask until an answer passes, or `bound_s` runs out. Each ask may take what is left of the
    bound (its client timeout); an answer that does not pass is asked again POLL_S later."""
    started = time.monotonic()
    while True:
        left = bound_s - (time.monotonic() - started)
        answer = ask(max(left, 1.0))
        after = round(time.monotonic() - started, 1)
        if passes(answer):
            return Waited(answer, after, True)
        if time.monotonic() - started + POLL_S >= bound_s:
            return Waited(answer, after, False)
        interrupt.sleep(POLL_S)  # Ctrl-C and SIGTERM end the wait here


def answered(answer: http_answers.Answer) -> bool:
    return answer.status != 0


def healthy(answer: http_answers.Answer) -> bool:
    return answer.status == 200


def serving(answer: http_answers.Answer) -> bool:
    return text_and_tokens(answer) is not None


def prove(
    pair: Pair, timeout: float = 120.0, progress: Callable[[str], None] = lambda _: None
) -> PairingOutcome:
    """The proofs, in order; the first that fails is the outcome's failure (what came before it
    is reported as measured). `timeout`: each request while the pair serves with nothing killed."""
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
        outcome = parity(pair, outcome, answers, timeout)
        same = sum(p.same for p in outcome.parity)
        progress(f"parity with the prefill role alone: {same} of {len(outcome.parity)} prompts equal")
    if outcome.failure is None:
        outcome = guard(pair, outcome, timeout)
        progress(front_line(outcome))
    if outcome.failure is None:
        outcome = faults(pair, outcome)
        progress(fault_line(outcome))
    return outcome


# An address no role has (TEST-NET-1, RFC 5737): what someone who reached the router's port would
# register to receive the users' prompts and the roles' key.
UNREGISTERED = "http://192.0.2.1:8000"


def _posted_status(base: str, path: str, key: str | None, timeout: float, body: dict[str, Any]) -> int:
    """POST with exactly the Authorization given (None: none), not the proof's own key: the
    status (0: no answer)."""
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=base, headers=headers, timeout=timeout) as client:
        return http_answers.fetch(client, "POST", path, body, parse=False, limit_s=timeout).status


def guard(pair: Pair, outcome: PairingOutcome, timeout: float) -> PairingOutcome:
    """The router's front admits the API with the key alone and worker management never: an
    unregistered address offered without the key and with it is refused (404), decode cannot be
    taken out, and the router's own list of workers is what it was, so no prompt can reach it."""
    before, why = pair.router_workers()
    if why is not None:
        return outcome._replace(failure=f"the router's own list of workers could not be read: {why}")
    key = os.environ.get(API_KEY_ENV) or None  # the rehearsal's, set while it runs (cluster.py)
    completion_body = {"model": pair.model, "prompt": PROMPTS["short"], "max_tokens": 1}
    asks: list[tuple[str, str, str | None, dict[str, Any], int]] = []  # what, path, key, body, due
    if key is not None:  # the roles (and so the front) want the key
        asks += [
            ("completion with no key", "/v1/completions", None, completion_body, 401),
            ("completion with a wrong key", "/v1/completions", "wrong", completion_body, 401),
        ]
    for label, sent in (("no key", None), ("the key", key)):
        asks += [
            (f"/add_worker with {label}", f"/add_worker?url={UNREGISTERED}", sent, {}, 404),
            (f"/remove_worker with {label}", f"/remove_worker?url={pair.decode}", sent, {}, 404),
        ]
    answered = [
        (what, _posted_status(pair.router, path, sent, timeout, body), due)
        for what, path, sent, body, due in asks
    ]
    outcome = outcome._replace(front=tuple((what, status) for what, status, _ in answered))
    wrong = [f"{what}: HTTP {status}, not {due}" for what, status, due in answered if status != due]
    if wrong:
        return outcome._replace(failure="the router's front: " + "; ".join(wrong))
    after, why = pair.router_workers()
    if why is not None or after != before or UNREGISTERED in after:
        return outcome._replace(
            failure=f"the router's workers changed behind the front: {before!r}, then {after!r} {why or ''}"
        )
    return outcome


def front_answers(outcome: PairingOutcome) -> str:
    """What the front answered each ask, in a line ("not asked" before the step ran)."""
    return ", ".join(f"{what} {status}" for what, status in outcome.front) or "not asked"


def front_line(outcome: PairingOutcome) -> str:
    return f"the router's front: {front_answers(outcome)}; the router's workers unchanged"


def fault_line(outcome: PairingOutcome) -> str:
    """The fault steps in a line: what the router answered and when, decode's health, and
    whether prefill was started again at all."""
    down = (
        f"the router answered HTTP {outcome.prefill_down_status} after {outcome.prefill_down_answer_s} s"
        if outcome.prefill_down_status
        else "the router gave no answer"
    )
    if not outcome.prefill_restarted:
        back = "not started again (the step before failed)"
    elif outcome.recovered_after_s is not None:
        back = f"serving again after {outcome.recovered_after_s} s ({outcome.recovery_transfer_verdict})"
    else:
        back = "not serving"
    decode = "healthy" if outcome.decode_healthy_when_prefill_down else "NOT healthy"
    return f"prefill killed: {down}, decode {decode}; prefill back: {back}"


def faults(pair: Pair, outcome: PairingOutcome) -> PairingOutcome:
    """Prefill killed, then started again, each step judged by state within the plan's clocks."""
    clocks = pair.clocks
    before = transfer_facts(pair.decode, clocks.health_s)
    refused = pair.kill_prefill()
    if refused is not None:
        return outcome._replace(failure=f"killing prefill failed: {refused}")
    down = wait_for(
        lambda left: completion(pair.router, pair.model, PROMPTS["two-blocks"], left),
        answered,
        clocks.router_down_s,
    )
    decode = wait_for(lambda left: health(pair.decode, left), healthy, clocks.health_s)
    outcome = outcome._replace(
        prefill_down_status=down.answer.status,
        prefill_down_answer_s=down.after_s if down.ok else None,
        decode_healthy_when_prefill_down=decode.ok,
    )
    if not down.ok:
        return outcome._replace(
            failure=f"prefill killed, the router gave no answer within {clocks.router_down_s:.0f} s (its "
            f"health checks take a worker out in {ROUTER_HEALTH_FAILURES} x (interval + timeout))"
            f"{down.answer.evidence()}"
        )
    if not 500 <= down.answer.status < 600:
        return outcome._replace(
            failure=f"prefill killed, the router answered HTTP {down.answer.status}"
            f"{down.answer.evidence()}, not 5xx"
        )
    if not decode.ok:
        return outcome._replace(
            failure=f"prefill killed, decode's /health answered HTTP {decode.answer.status}"
            f"{decode.answer.evidence()} within {clocks.health_s:.0f} s"
        )
    moved = kv_transfer.since(before, transfer_facts(pair.decode, clocks.health_s))
    if moved.transfers or moved.failed_transfers:
        return outcome._replace(
            failure=f"prefill killed, yet decode counted {moved.transfers} transfers and "
            f"{moved.failed_transfers} failed: the router handed decode a request without its prefill"
        )
    return recovery(pair, outcome._replace(prefill_restarted=True))


def recovery(pair: Pair, outcome: PairingOutcome) -> PairingOutcome:
    """Prefill started again in place: it answers /health within its readiness wait, the router
    serves the longest prompt within its take-back clock after that, and decode's counters show
    that answer's KV came over the wire."""
    clocks = pair.clocks
    before = transfer_facts(pair.decode, clocks.health_s)
    refused = pair.start_prefill()
    if refused is not None:
        return outcome._replace(failure=f"starting prefill again failed: {refused}")
    started = time.monotonic()
    up = wait_for(lambda left: health(pair.prefill, left), healthy, clocks.prefill_ready_s)
    if not up.ok:
        return outcome._replace(
            failure=f"prefill started again did not answer /health within its readiness wait "
            f"({clocks.prefill_ready_s:.0f} s){up.answer.evidence()}"
        )
    back = wait_for(
        lambda left: completion(pair.router, pair.model, PROMPTS["thirteen-blocks"], left),
        serving,
        clocks.router_back_s,
    )
    if not back.ok:
        return outcome._replace(
            failure=f"prefill back (answering /health after {up.after_s} s), the router did not serve "
            f"again within {clocks.router_back_s:.0f} s (its health checks take a worker back in "
            f"{ROUTER_HEALTH_SUCCESSES} x (interval + timeout)): HTTP {back.answer.status}"
            f"{back.answer.evidence()}"
        )
    outcome = outcome._replace(recovered_after_s=round(time.monotonic() - started, 1))
    verdict = kv_transfer.judge(kv_transfer.since(before, transfer_facts(pair.decode, clocks.health_s)))
    outcome = outcome._replace(recovery_transfer_verdict=verdict.reason)
    if not verdict.came_over_the_wire:
        return outcome._replace(
            failure=f"prefill back, the router served, but not over the wire: {verdict.reason}"
        )
    return outcome


def parity(
    pair: Pair, outcome: PairingOutcome, answers: dict[str, tuple[str, int]], timeout: float
) -> PairingOutcome:
    """Each prompt the router answered, asked of the prefill role directly: the same greedy text."""
    found = []
    for name, (router_text, tokens) in answers.items():
        got = text_and_tokens(completion(pair.prefill, pair.model, PROMPTS[name], timeout))
        if got is None:
            return outcome._replace(failure=f"the prefill role asked directly did not answer {name!r}")
        found.append(Parity(name, tokens, router_text, got[0]))
    outcome = outcome._replace(parity=tuple(found))
    differ = [p.prompt for p in found if not p.same]
    if differ:
        return outcome._replace(
            failure=f"greedy output through the router differs from the prefill role's own on {differ}"
        )
    return outcome
