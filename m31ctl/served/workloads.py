"""The sweep's workloads, made from prompt material shipped in the package (material/, written
for m31ctl), seeded, with no download. Each becomes the JSONL of `vllm bench serve --dataset-name
custom` ({"prompt", "output_tokens"} per line), sent as one user message to the chat endpoint,
where the server applies the model's chat template.

- chat: questions and requests people send an assistant; some carry background paragraphs so
  that inputs spread around the plan's verify.input_len.
- agentic: sessions of an operations agent. Every prompt starts with the same long system
  prompt and tool manual; each later turn of a session repeats the session so far and appends
  one more action and tool result, so the shared prefix grows turn by turn (what prefix caching
  serves in agent traffic). Turns go out round-robin across sessions, as agents take turns.
- long-context: a long document of numbered sections, then a question about it; inputs fill
  the plan's max_model_len less the (short) output, measured by the server's tokenizer.

Token counts come from a Meter: the server's own /tokenize where it answers (exact, chat
template included), else an estimate from characters.
"""

from __future__ import annotations

import functools
import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from m31ctl.errors import InputError

WORKLOADS = ("chat", "agentic", "long-context")
MATERIAL = Path(__file__).resolve().parent / "material"
LONG_CONTEXT_OUTPUT = 64  # long inputs, short answers: long-context traffic is prefill-bound
FALLBACK_CHARS_PER_TOKEN = 2.5  # without /tokenize: below English's ~4 for most tokenizers, so safe


class Request(NamedTuple):
    prompt: str
    output_tokens: int


class Workload(NamedTuple):
    name: str
    requests: tuple[Request, ...]
    sessions: int  # agentic: the sessions the requests belong to; otherwise one per request

    def jsonl(self) -> str:
        """vLLM's custom dataset: one JSON object per line."""
        return "".join(
            json.dumps({"prompt": r.prompt, "output_tokens": r.output_tokens}, ensure_ascii=False) + "\n"
            for r in self.requests
        )


class Sizing(NamedTuple):
    input_len: int  # chat's typical input (the plan's verify.input_len)
    output_len: int
    max_model_len: int

    def budget(self, output_tokens: int) -> int:
        """Input tokens that fit beside `output_tokens`, with a margin for the count's edges."""
        margin = max(8, self.max_model_len // 100)
        return max(1, self.max_model_len - output_tokens - margin)


class Meter(NamedTuple):
    """Tokens the server counts for a text sent as one user message (chat template included)."""

    overhead: int
    chars_per_token: float
    counter: Callable[[str], int] | None  # exact (the server's /tokenize), or None: estimates only

    @property
    def exact(self) -> bool:
        return self.counter is not None

    def estimate(self, text: str) -> int:
        return self.overhead + math.ceil(len(text) / self.chars_per_token)

    def measure(self, text: str) -> int:
        return self.counter(text) if self.counter is not None else self.estimate(text)


def calibrate(count: Callable[[str], int] | None) -> Meter:
    """A Meter from one sample of the material: the template's overhead and characters per token."""
    if count is None:
        return Meter(16, FALLBACK_CHARS_PER_TOKEN, None)
    memo = functools.lru_cache(maxsize=4096)(count)
    sample = "\n\n".join(_blocks("prose.txt")[:6] + _blocks("chat.txt")[:12])
    overhead = memo("")
    tokens = max(1, memo(sample) - overhead)
    return Meter(overhead, len(sample) / tokens, memo)


@functools.lru_cache(maxsize=8)
def _blocks(name: str) -> list[str]:
    """A material file's paragraphs: blank-line separated, # comment lines dropped."""
    text = (MATERIAL / name).read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    return [block.strip() for block in "\n".join(lines).split("\n\n") if block.strip()]


@functools.lru_cache(maxsize=1)
def _agent() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(system prompt paragraphs, tasks, steps) from material/agent.txt."""
    text = (MATERIAL / "agent.txt").read_text(encoding="utf-8")
    blocks: dict[str, list[str]] = {"system": [], "task": [], "step": []}
    kind = None
    for chunk in text.split("\n=== ")[1:]:
        kind, _, body = chunk.partition("\n")
        body = "\n".join(line for line in body.splitlines() if not line.startswith("#")).strip()
        blocks[kind.strip()].append(body)
    system = tuple(p.strip() for p in "\n\n".join(blocks["system"]).split("\n\n") if p.strip())
    return system, tuple(blocks["task"]), tuple(blocks["step"])


def build(name: str, requests: int, concurrency: int, sizing: Sizing, meter: Meter, seed: int) -> Workload:
    """`requests` prompts of workload `name`. Request i depends only on (seed, i) for chat and
    long-context, so a smaller point's requests are a prefix of a larger one's."""
    if name == "chat":
        return Workload(name, tuple(_chat(i, sizing, meter, seed) for i in range(requests)), requests)
    if name == "long-context":
        return _long_context(requests, sizing, meter, seed)
    if name == "agentic":
        return _agentic(requests, concurrency, sizing, meter, seed)
    raise InputError(f"unknown --workload {name!r}", hint=f"choose one of: {', '.join(WORKLOADS)}")


def _clip(text: str, budget: int, meter: Meter) -> str:
    """A text cut (at a word) to fit `budget` tokens by the meter's estimate."""
    if meter.estimate(text) <= budget:
        return text
    keep = max(1, int((budget - meter.overhead) * meter.chars_per_token))
    return text[:keep].rsplit(" ", 1)[0]


def _chat(i: int, sizing: Sizing, meter: Meter, seed: int) -> Request:
    rng = random.Random(f"{seed}:chat:{i}")
    questions, paragraphs = _blocks("chat.txt"), _blocks("prose.txt")
    question = questions[rng.randrange(len(questions))]
    budget = sizing.budget(sizing.output_len)
    target = min(budget, round(sizing.input_len * rng.uniform(0.5, 1.5)))
    notes: list[str] = []
    while meter.estimate(_with_notes(question, notes)) < target and len(notes) < len(paragraphs):
        notes.append(paragraphs[rng.randrange(len(paragraphs))])
    # Estimates guide; the server's count decides (a note too many is dropped).
    while notes and meter.measure(_with_notes(question, notes)) > budget:
        notes.pop()
    return Request(_clip(_with_notes(question, notes), budget, meter), sizing.output_len)


def _with_notes(question: str, notes: list[str]) -> str:
    if not notes:
        return question
    return "Some background notes first.\n\n" + "\n\n".join(notes) + "\n\nMy question: " + question


def document(i: int, seed: int, size: int) -> str:
    """The long-context workload's request i prompt of about `size` characters (verify's
    pd-parity tokenizes one to the length it needs)."""
    return _long_prompt(i, seed, size)


def _long_prompt(i: int, seed: int, size: int) -> str:
    """Request i's prompt: a document of numbered sections cut at `size` characters (at a word),
    then a question about one of its sections."""
    rng = random.Random(f"{seed}:long-context:{i}")
    paragraphs = _blocks("prose.txt")
    sections: list[str] = []
    length = 0
    while length < size:
        cycle = list(paragraphs)
        rng.shuffle(cycle)  # each pass through the material in a new order
        for text in cycle:
            sections.append(f"Section {len(sections) + 1}.\n{text}")
            length += len(sections[-1]) + 2
    body = "\n\n".join(sections)[:size].rsplit(" ", 1)[0]
    asked = rng.randrange(max(1, body.count("Section "))) + 1
    return (
        f"Document {i + 1}: a collection of notes. Read it, then answer the question after it.\n\n{body}\n\n"
        f"Question: summarise section {asked} in two sentences, then name one other section "
        "that describes a similar situation and say why."
    )


def _long_context(requests: int, sizing: Sizing, meter: Meter, seed: int) -> Workload:
    output = max(1, min(sizing.output_len, LONG_CONTEXT_OUTPUT))
    budget = sizing.budget(output)
    size = max(1, int((budget - meter.overhead) * meter.chars_per_token))
    made: list[Request] = []
    for i in range(requests):
        # The previous request's size is the next one's first guess: about one count each.
        prompt, size = _fit(functools.partial(_long_prompt, i, seed), size, budget, meter)
        made.append(Request(prompt, output))
    return Workload("long-context", tuple(made), requests)


def _fit(make: Callable[[int], str], size: int, budget: int, meter: Meter) -> tuple[str, int]:
    """The longest make(size) found within `budget` tokens by the meter, in a few measured steps
    (each corrects the size by the text's own characters per token); done within 1% of it."""
    best: tuple[str, int] | None = None
    for _ in range(8):
        text = make(size)
        used = meter.measure(text)
        if used <= budget:
            best = (text, size) if best is None or size > best[1] else best
            if budget - used <= max(2, budget // 100):
                break
        per_token = len(text) / max(1, used)
        # Aim a little short of the budget so that the next step lands inside it.
        step = int((budget - used - max(1, budget // 400)) * per_token)
        if step == 0 or size + step < 1:
            break
        size += step
    if best is None:  # even the shortest document is too long: clipped by estimate
        return _clip(make(1), budget, meter), 1
    return best


def _agentic(requests: int, concurrency: int, sizing: Sizing, meter: Meter, seed: int) -> Workload:
    output = sizing.output_len
    budget = sizing.budget(output)
    system_paragraphs, tasks, steps = _agent()
    # The shared prefix: the system prompt, at most half the room, so that sessions can grow.
    system = ""
    for paragraph in system_paragraphs:
        longer = f"{system}\n\n{paragraph}" if system else paragraph
        if meter.measure(longer) > budget // 2:
            break
        system = longer
    system = system or _clip(system_paragraphs[0], budget // 2, meter)
    sessions: list[list[str]] = []
    wanted = math.ceil(requests / max(1, min(concurrency, requests)))
    while sum(map(len, sessions)) < requests:
        sessions.append(_session(len(sessions), system, tasks, steps, wanted, budget, meter, seed))
    ordered = [s[t] for t in range(max(map(len, sessions))) for s in sessions if t < len(s)]
    return Workload("agentic", tuple(Request(p, output) for p in ordered[:requests]), len(sessions))


def _session(
    s: int,
    system: str,
    tasks: tuple[str, ...],
    steps: tuple[str, ...],
    turns: int,
    budget: int,
    meter: Meter,
    seed: int,
) -> list[str]:
    """Session s's prompts, one per turn: each is the previous one plus one more step."""
    rng = random.Random(f"{seed}:agentic:{s}")
    order = list(steps)
    rng.shuffle(order)
    head = f"{system}\n\nSession {s + 1}, ticket {rng.randrange(10000, 99999)}.\nUser: {tasks[(seed + s) % len(tasks)]}"
    prompts = [_clip(head, budget, meter)]
    transcript = head
    for t in range(1, turns):
        transcript += f"\n{order[(t - 1) % len(order)]}"
        prompt = f"{transcript}\nUser: Carry on with the next step."
        if meter.measure(prompt) > budget:
            break
        prompts.append(prompt)
    return prompts
