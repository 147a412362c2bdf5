"""`m31ctl bench`'s sweep: one `vllm bench serve` run (the engine's own benchmark, through the
runner verify uses) per concurrency against the running server, the speculative-decoding
counters read around each run, then the frontier and the operating point.

Side effects stay behind narrow seams: `Server` (the endpoint's /tokenize and /metrics), the
benchmark runner (a callable from `vllm bench serve` arguments to its saved result), and the
directory the datasets are written to. Progress goes out as Events through a callback.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from m31ctl.bench import figures, metrics, workloads
from m31ctl.bench.figures import Choice, Limit, Point
from m31ctl.errors import HostPreconditionError
from m31ctl.plan import Plan

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
    seed: int = 0


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
    plan: Plan, base: str, dataset: Path, requests: int, concurrency: int, req: SweepRequest
) -> list[str]:
    """`vllm bench serve` for one point: the workload's JSONL as vLLM's custom dataset, in file
    order (--disable-shuffle: agentic turns go in session order), each request's own output
    length (-1), sent as chat messages (the server applies the template, so the client must not)."""
    args = [
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", base,
        "--model", plan.settings.model.served_name, "--tokenizer", plan.settings.model.path,
        "--dataset-name", "custom", "--dataset-path", str(dataset), "--custom-output-len", "-1",
        "--skip-chat-template", "--disable-shuffle", "--num-prompts", str(requests),
        "--max-concurrency", str(concurrency), "--seed", str(req.seed), "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
    ]  # fmt: skip
    goodput = figures.goodput_args(req.slo)
    return args + (["--goodput", *goodput] if goodput else [])


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
        args = bench_args(plan, req.base, dataset, len(made.requests), concurrency, req)
        commands.append(tuple(args))
        begun = clock()
        point = _measure(plan, server, runner, args, concurrency, len(made.requests))
        point = point._replace(run_s=round(clock() - begun, 3))
        points.append(point)
        on_event(Event("point", index, total, concurrency, clock() - started, point))
    return Sweep(
        endpoint=req.base,
        plan_hash=plan.hash,
        workload=req.workload,
        gpus=plan.gpus_needed,
        seed=req.seed,
        slo=req.slo,
        points=tuple(points),
        frontier=figures.frontier(points),
        choice=figures.pick(points, req.slo),
        commands=tuple(commands),
        token_counts="server" if meter.exact else "estimated",
        wall_s=clock() - started,
    )


def _measure(
    plan: Plan, server: Server, runner: Runner, args: list[str], concurrency: int, requests: int
) -> Point:
    """One `vllm bench serve` run, with the spec-decode counters read before and after it."""
    before = metrics.spec_counters(server.metrics())
    try:
        result = runner(args)
    except Exception as exc:  # the benchmark could not run: a failed point, with its reason
        return figures.failed_point(concurrency, requests, f"vllm bench serve did not run: {str(exc)[-300:]}")
    spec = metrics.spec_figures(before, metrics.spec_counters(server.metrics()))
    return figures.point_from_result(concurrency, requests, result, plan.gpus_needed, spec)


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
