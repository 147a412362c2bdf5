"""verify's pd-parity: a P/D group answers as one engine would, past MiniMax-M3's sparse window.

The known M3 P/D failure (ROCm/ATOM issue 1368; notes/pd-disaggregation.md "Accuracy trap"): a
pair that does not carry the sparse-attention indexer's key cache with the main KV writes wrong
tokens only once the prompt passes the window the indexer chooses from (sparse_topk_blocks x
sparse_block_size = 16 x 128 = 2,048 tokens for MiniMax-M3, plan/checkpoint_facts.py
`sparse_window`): below it every block is selected and the indexer's keys decide nothing, and
decode's NIXL counters look healthy either way (kv_transfer.py). So the same greedy completions
(temperature 0, a fixed seed, `max_tokens` small, EOS ignored) are asked (a) through the router,
verify's base, and (b) of the prefill role directly, and their token ids compared. (b) is the
reference: in vLLM 0.32's NixlConnector a request without kv_transfer_params is served wholly by
the instance it reaches (nixl/pull_scheduler.py `get_num_new_matched_tokens` returns 0 external
tokens and `request_finished` frees the blocks at once; nixl/base_scheduler.py truncates a
prompt for prefill only under `do_remote_decode`), and the prefill role computes the same
prompt's KV that the router's path sends to decode.

The prompts are token ids (the prefill's own /tokenize of a numbered document of the shipped
prose, cut to the length), so each is exactly the length chosen and both sides read the same
ids: past the window by a block and some (`PAST_WINDOW`), and 8K and 64K where the plan's
max_model_len holds them with the completion. A plan that cannot pass the window (the CPU
rehearsal's 2,048-token models) checks the longest prompt it holds and says the window was not
reached. Each run's document is its own (a nonce heads it), so no prefix cache of an earlier
run answers for this one. Decode's counters around the router's requests weigh the bytes a
prompt token for those prompts (kv_transfer.judge_bytes; long prompts tell main + indexer from
main alone). Every answer is read defensively (http_answers.py): a broken server fails the
check, it does not crash verify.
"""

from __future__ import annotations

import uuid
from typing import Any, NamedTuple

import httpx

from m31ctl.checks import CheckResult, judged
from m31ctl.deployment import Deployment
from m31ctl.plan.checkpoint_facts import Fact, checkpoint_facts
from m31ctl.served import kv_transfer, prometheus, smoke
from m31ctl.served.http_answers import Answer, as_int, as_list, as_object, fetch
from m31ctl.served.verified import VerifyReport
from m31ctl.served.workloads import document

MAX_TOKENS = 16  # tokens compared a prompt: enough to show a divergence, cheap on two CPU cores
SEED = 0
# Past the window by one whole block (the indexer's block) and some: the last blocks of the
# prompt are outside any top-k that covers every block.
PAST_WINDOW = 128 + 64
LONG_PROMPTS = (8_192, 65_536)
LIMIT_S = 600.0  # one completion of a 64K prompt on a slow pair; the CPU pair's 2K take seconds


class Lengths(NamedTuple):
    """The prompt lengths a plan's pd-parity sends, derived once from its facts."""

    prompts: tuple[int, ...]  # prompt tokens, ascending
    window: Fact | None  # the model's sparse window (None: no MSA sparse attention stated)
    room: int  # the longest prompt max_model_len holds with MAX_TOKENS after it

    @property
    def reached(self) -> bool:
        """Whether the longest prompt passes the window."""
        return self.window is not None and self.prompts[-1] > self.window.value

    def said(self) -> str:
        """What the lengths cover, for the check's line: never more than was tested."""
        shown = ", ".join(f"{n:,}" for n in self.prompts)
        if self.window is None:
            return f"prompts of {shown} tokens (the model states no sparse window)"
        if self.reached:
            return f"prompts of {shown} tokens (past the sparse window of {self.window.value:,})"
        return (
            f"prompts of {shown} tokens; the sparse window ({self.window.value:,} tokens) was not reached: "
            f"max_model_len holds at most {self.room:,} prompt tokens before {MAX_TOKENS} completion tokens"
        )


def lengths(deployment: Deployment) -> Lengths:
    """Past the window (window + PAST_WINDOW), then 8K and 64K, each only where max_model_len
    holds it with MAX_TOKENS; where none fits, the longest prompt that does."""
    plan = deployment.plan
    window = checkpoint_facts(plan.settings, plan.model).sparse_window
    room = plan.settings.serving.max_model_len - MAX_TOKENS
    wanted = [window.value + PAST_WINDOW] if window else []
    wanted += [n for n in LONG_PROMPTS if window is None or n > window.value]
    fits = sorted({n for n in wanted if n <= room})
    return Lengths(tuple(fits) or (max(room, 1),), window, room)


class Compared(NamedTuple):
    """One prompt's two completions."""

    prompt_tokens: int
    matched: int  # leading tokens equal
    compared: int  # tokens the shorter completion has
    divergence: str | None  # where and how they part, or None: equal

    def facts(self) -> dict[str, Any]:
        return self._asdict()


def compare(prompt_tokens: int, routed: list[int], alone: list[int]) -> Compared:
    """The router's completion against prefill's alone, token by token."""
    compared = min(len(routed), len(alone))
    matched = next((i for i in range(compared) if routed[i] != alone[i]), compared)
    if matched < compared:
        where = (
            f"completion token {matched + 1} (position {prompt_tokens + matched:,}): "
            f"router {routed[matched]}, prefill alone {alone[matched]}"
        )
    elif len(routed) != len(alone):
        where = f"lengths: router {len(routed)} tokens, prefill alone {len(alone)}"
    else:
        where = None
    return Compared(prompt_tokens, matched, compared, where)


class Failed(Exception):
    """An answer pd-parity cannot compare: the check fails with this message."""


def _ids(answer: Answer, who: str) -> list[int]:
    """The completion's token ids (vLLM's return_token_ids), or Failed saying what came."""
    if answer.status != 200:
        raise Failed(f"{who}: HTTP {answer.status}{answer.evidence()}")
    choice = as_object((as_list(answer.obj().get("choices")) or [None])[0])
    ids = [as_int(t) for t in as_list(choice.get("token_ids"))]
    if not ids or any(t is None for t in ids):
        raise Failed(f"{who}: no completion token_ids (return_token_ids){answer.evidence()}")
    return [t for t in ids if t is not None]


def prompt_ids(prefill: Any, served: str, tokens: int, nonce: str) -> list[int]:
    """`tokens` token ids of a numbered document, tokenized by the prefill role (POST
    /tokenize); the document grows until it holds them."""
    size = tokens * 6
    for _ in range(4):
        text = f"Parity check {nonce}, {tokens} tokens.\n\n" + document(0, SEED, size)
        answer = fetch(prefill, "POST", "/tokenize", {"model": served, "prompt": text}, limit_s=LIMIT_S)
        if answer.status != 200:
            raise Failed(f"prefill's /tokenize: HTTP {answer.status}{answer.evidence()}")
        ids = [as_int(t) for t in as_list(answer.obj().get("tokens"))]
        if not ids or any(t is None for t in ids):
            raise Failed(f"prefill's /tokenize sent no token ids{answer.evidence()}")
        if len(ids) >= tokens:
            return [t for t in ids[:tokens] if t is not None]
        size = size * tokens // len(ids) + size
    raise Failed(f"a document of {size:,} characters tokenizes to {len(ids):,} tokens, fewer than {tokens:,}")


def _completion(client: Any, served: str, ids: list[int], who: str) -> list[int]:
    body = {
        "model": served,
        "prompt": ids,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "seed": SEED,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return _ids(fetch(client, "POST", "/v1/completions", body, limit_s=LIMIT_S), who)


def run(deployment: Deployment, router: Any, prefill: Any, metrics: Any) -> tuple[list[Compared], Any]:
    """Each prompt asked of prefill alone, then through the router; decode's counters (through
    `metrics`) around the router's requests. Raises Failed on an answer it cannot compare."""
    served = deployment.plan.settings.model.served_name
    nonce = uuid.uuid4().hex[:12]
    prompts = [prompt_ids(prefill, served, n, nonce) for n in lengths(deployment).prompts]
    before = kv_transfer.facts_of(prometheus.scrape(metrics))
    found = []
    for ids in prompts:
        alone = _completion(prefill, served, ids, f"prefill alone, {len(ids):,}-token prompt")
        routed = _completion(router, served, ids, f"the router, {len(ids):,}-token prompt")
        found.append(compare(len(ids), routed, alone))
    return found, kv_transfer.since(before, kv_transfer.facts_of(prometheus.scrape(metrics)))


def check(
    deployment: Deployment, base: str, prefill_base: str | None, metrics: Any, report: VerifyReport
) -> None:
    """pd-parity (and pd-parity-bytes) of a P/D plan into `report`; skipped, saying why, where
    verify has no prefill role to ask (--url names the router alone)."""
    chosen = lengths(deployment)
    facts: dict[str, Any] = {
        "prompt_tokens": list(chosen.prompts),
        "sparse_window": chosen.window.value if chosen.window else None,
        "sparse_window_source": chosen.window.source if chosen.window else None,
        "window_reached": chosen.reached,
        "max_tokens": MAX_TOKENS,
    }
    report.facts["pd_parity"] = facts
    if prefill_base is None:
        report.check(
            "pd-parity",
            None,
            "could not run: verify was pointed at a URL, which names no prefill role to compare the "
            "router's completions with (verify a group m31ctl runs, by --name)",
        )
        return
    headers = smoke.auth_headers()
    with (
        httpx.Client(base_url=base, headers=headers, timeout=LIMIT_S) as router,
        httpx.Client(base_url=prefill_base, headers=headers, timeout=LIMIT_S) as prefill,
    ):
        try:
            found, seen = run(deployment, router, prefill, metrics)
        except Failed as exc:
            report.checks.append(judged("pd-parity", False, f"{chosen.said()}: {exc}"))
            return
    facts["compared"] = [c.facts() for c in found]
    facts["kv_transfer"] = seen._asdict()
    report.checks.append(_verdict(chosen, found))
    report.checks.append(_bytes(seen, deployment))


_REMEDY = (
    "a pair whose decode writes other tokens than its prefill alone past the sparse window lost "
    "a cache on the way: check that both roles run one vLLM whose KV connector registers the "
    "indexer's layers (see kv-transfer-bytes), and the decode log for NIXL errors"
)


def _verdict(chosen: Lengths, found: list[Compared]) -> CheckResult:
    matched = ", ".join(f"{c.matched}/{c.compared}" for c in found)
    parted = next((c for c in found if c.divergence), None)
    if parted is not None:
        return judged(
            "pd-parity",
            False,
            f"{chosen.said()}: tokens equal through the router and on prefill alone {matched}; "
            f"at {parted.prompt_tokens:,} prompt tokens they part at {parted.divergence}",
            _REMEDY,
        )
    return judged(
        "pd-parity", True, f"{chosen.said()}: tokens equal through the router and on prefill alone {matched}"
    )


def _bytes(seen: kv_transfer.KvTransferFacts, deployment: Deployment) -> CheckResult:
    """kv-transfer-bytes over the parity prompts alone (long ones leave little to partial blocks)."""
    return kv_transfer.check_bytes(
        seen, kv_transfer.per_token(deployment.answering_engine), "pd-parity-bytes"
    )
