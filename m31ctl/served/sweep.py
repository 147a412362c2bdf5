"""`m31ctl bench`'s sweep: one `vllm bench serve` run (the engine's own benchmark, through the
runner verify uses) per concurrency against the running server, the speculative-decoding
counters read around each run, then the frontier and the operating point.

Side effects stay behind narrow seams: `Server` (the endpoint's /tokenize and /metrics), the
benchmark runner (a callable from `vllm bench serve` arguments to its saved result), and the
directory the datasets are written to. Progress goes out as Events through a callback.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from m31ctl.errors import HostPreconditionError
from m31ctl.plan import Plan
from m31ctl.served import figures, kv_transfer, spec_decode, workloads
from m31ctl.served.figures import THROUGHPUT, Choice, Limit, Objective, Point

Runner = Callable[[list[str]], Mapping[str, Any]]


class Server(Protocol):
    def tokens(self, text: str) -> int | None:
        """Tokens the server counts for `text` as one user message; None: it cannot say."""

    def metrics(self) -> str:
        """The /metrics text ("" when it cannot be read)."""


class SweepRequest(NamedTuple):
    base: str
    workload: str
    concurrencies: tuple[int, ...]
    requests: int | None  # per point; None: 4x the concurrency, at least verify.requests
    output_len: int | None  # None: the plan's verify.output_len
    slo: tuple[Limit, ...]
    gpus: int  # what per-GPU figures divide by: the deployment's serving GPUs (Deployment.serving_gpus)
    seed: int = 0
    objective: Objective = THROUGHPUT  # what the pick maximises among the points meeting the SLO


class Event(NamedTuple):
    """Progress: "start" before a point's run, "point" after it (with the point)."""

    kind: str
    step: int  # 0-based, of `total`
    total: int
    concurrency: int
    elapsed_s: float
    point: Point | None = None


class Sweep(NamedTuple):
    endpoint: str
    plan_hash: str
    workload: str
    gpus: int
    seed: int
    slo: tuple[Limit, ...]
    points: tuple[Point, ...]
    frontier: tuple[int, ...]
    choice: Choice
    commands: tuple[tuple[str, ...], ...]  # each point's `vllm bench serve` arguments
    token_counts: str  # "server" (/tokenize) or "estimated"
    wall_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "plan_hash": self.plan_hash,
            "workload": self.workload,
            "gpus": self.gpus,
            "seed": self.seed,
            "slo": {limit.key: limit.value for limit in self.slo},
            "points": [{**p.to_json(), "frontier": p.concurrency in self.frontier} for p in self.points],
            "frontier": list(self.frontier),
            "choice": self.choice.to_json(),
            "commands": [["vllm", "bench", "serve", *c] for c in self.commands],
            "token_counts": self.token_counts,
            "wall_s": round(self.wall_s, 3),
        }


def requests_for(plan: Plan, concurrency: int, requests: int | None) -> int:
    """Enough requests that the point runs at its concurrency for most of its duration."""
    return requests if requests is not None else max(plan.settings.verify.requests, 4 * concurrency)


def bench_args(
    plan: Plan,
    base: str,
    dataset: Sequence[str],
    requests: int,
    concurrency: int,
    seed: int,
    slo: Sequence[Limit],
) -> list[str]:
    """`vllm bench serve` for one point against the chat endpoint: bench's sweep and verify's
    load both run through this. `dataset` is custom_dataset's or random_dataset's arguments;
    the SLO's limits go to vLLM's --goodput."""
    args = [
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", base,
        "--model", plan.settings.model.served_name, "--tokenizer", plan.settings.model.path,
        *dataset, "--num-prompts", str(requests), "--max-concurrency", str(concurrency),
        "--seed", str(seed), "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
    ]  # fmt: skip
    goodput = figures.goodput_args(slo)
    return args + (["--goodput", *goodput] if goodput else [])


def custom_dataset(path: Path) -> tuple[str, ...]:
    """A workload's JSONL as vLLM's custom dataset, in file order (--disable-shuffle: agentic
    turns go in session order), each request's own output length (-1), sent as chat messages
    (the server applies the template, so the client must not)."""
    return (
        "--dataset-name", "custom", "--dataset-path", str(path), "--custom-output-len", "-1",
        "--skip-chat-template", "--disable-shuffle",
    )  # fmt: skip


def random_dataset(input_len: int, output_len: int) -> tuple[str, ...]:
    """vLLM's random prompts of a fixed length (verify's load: no workload file to share)."""
    return (
        "--dataset-name",
        "random",
        "--random-input-len",
        str(input_len),
        "--random-output-len",
        str(output_len),
    )


def run(
    plan: Plan,
    req: SweepRequest,
    server: Server,
    runner: Runner,
    workdir: Path,
    on_event: Callable[[Event], None] = lambda _e: None,
    clock: Callable[[], float] = time.monotonic,
) -> Sweep:
    started = clock()
    s = plan.settings
    meter = workloads.calibrate(_counter(server))
    sizing = workloads.Sizing(
        s.verify.input_len, req.output_len or s.verify.output_len, s.serving.max_model_len
    )
    points: list[Point] = []
    commands: list[tuple[str, ...]] = []
    total = len(req.concurrencies)
    for index, concurrency in enumerate(req.concurrencies):
        on_event(Event("start", index, total, concurrency, clock() - started))
        count = requests_for(plan, concurrency, req.requests)
        made = workloads.build(req.workload, count, concurrency, sizing, meter, req.seed)
        dataset = workdir / f"{req.workload}-c{concurrency}.jsonl"
        dataset.write_text(made.jsonl(), encoding="utf-8")
        args = bench_args(
            plan, req.base, custom_dataset(dataset), len(made.requests), concurrency, req.seed, req.slo
        )
        commands.append(tuple(args))
        begun = clock()
        point = _measure(req.gpus, server, runner, args, concurrency, len(made.requests))
        point = point._replace(run_s=round(clock() - begun, 3))
        points.append(point)
        on_event(Event("point", index, total, concurrency, clock() - started, point))
    return Sweep(
        endpoint=req.base,
        plan_hash=plan.hash,
        workload=req.workload,
        gpus=req.gpus,
        seed=req.seed,
        slo=req.slo,
        points=tuple(points),
        frontier=figures.frontier(points),
        choice=figures.pick(points, req.slo, req.objective),
        commands=tuple(commands),
        token_counts="server" if meter.exact else "estimated",
        wall_s=clock() - started,
    )


def _measure(
    gpus: int, server: Server, runner: Runner, args: list[str], concurrency: int, requests: int
) -> Point:
    """One `vllm bench serve` run, with the engine's spec-decode and KV-transfer counters read
    before and after it (the transfer figures only where a NIXL connector exports them)."""
    scraped = server.metrics()
    before, transfers_before = spec_decode.spec_counters(scraped), kv_transfer.facts(scraped)
    try:
        result = runner(args)
    except Exception as exc:  # the benchmark could not run: a failed point, with its reason
        return figures.failed_point(
            concurrency, requests, f"vllm bench serve did not run: {_cause(exc)[-300:]}"
        )
    scraped = server.metrics()
    spec = spec_decode.spec_figures(before, spec_decode.spec_counters(scraped))
    point = figures.point_from_result(concurrency, requests, result, gpus, spec)
    transfers = kv_transfer.since(transfers_before, kv_transfer.facts(scraped))
    return point._replace(kv_transfer=transfers) if transfers.nixl_exported else point


def _cause(exc: Exception) -> str:
    """The exception's message as one line (a runner may raise with the last lines of the
    benchmark's stderr as a list)."""
    first = exc.args[0] if len(exc.args) == 1 else None
    if isinstance(first, (list, tuple)):
        return " ".join(str(line) for line in first) or type(exc).__name__
    return str(exc) or type(exc).__name__


def _counter(server: Server) -> Callable[[str], int] | None:
    """The server's token count, when it gives one (vLLM's /tokenize); else None: estimates."""
    if server.tokens("") is None:
        return None

    def count(text: str) -> int:
        tokens = server.tokens(text)
        if tokens is None:
            raise HostPreconditionError("the server stopped answering /tokenize while the workload was made")
        return tokens

    return count
