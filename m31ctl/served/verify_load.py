"""verify's load: one point of bench's sweep (`vllm bench serve`, the engine's own, with the plan's
`verify` settings), its pass marks gating, and the regression against an earlier report.

The figures are read through figures.VLLM_KEY, as bench reads its points, so verify's check ids
and the keys its report keeps are the ones saved reports and CI read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from m31ctl.plan import Plan
from m31ctl.runtime.load_run import BenchRunner
from m31ctl.served import figures, sweep
from m31ctl.served.verified import VerifyReport

# The load's pass marks: (the figure's one name, the verify setting that sets the mark); the
# check's id and the figure are read through figures.VLLM_KEY, as bench reads its points.
PASS_MARKS = (
    ("ttft_p99_ms", "ttft_p99_ms"),
    ("tpot_p99_ms", "tpot_p99_ms"),
    ("output_tok_s", "min_output_throughput"),
)
# What report.bench keeps of vLLM's result, under vLLM's own keys (CI and baselines read them).
BENCH_FIGURES = (
    "completed", "failed", "duration_s", "request_throughput", "request_goodput", "output_tok_s",
    "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_p99_ms", "itl_p99_ms", "e2el_p99_ms",
)  # fmt: skip


def check_load(plan: Plan, base: str, bench: BenchRunner, report: VerifyReport) -> None:
    """One point of bench's sweep: the plan's verify settings as `vllm bench serve` arguments
    (sweep.bench_args, vLLM's random prompts), its figures read as bench reads a point."""
    v = plan.settings.verify
    limits = tuple(
        figures.Limit(key, value)
        for key, value in (("ttft_p99_ms", v.ttft_p99_ms), ("tpot_p99_ms", v.tpot_p99_ms))
        if value
    )
    dataset = sweep.random_dataset(v.input_len, v.output_len)
    try:
        result = bench(sweep.bench_args(plan, base, dataset, v.requests, v.concurrency, 0, limits))
    except Exception as exc:  # the benchmark could not run: a failed gate, with its reason
        report.check("load", False, f"vllm bench serve did not run: {str(exc)[-300:]}")
        return
    kept = [figures.VLLM_KEY[figure] for figure in BENCH_FIGURES]
    report.bench = {key: result.get(key) for key in kept if key in result}
    completed = result.get(figures.VLLM_KEY["completed"]) or 0
    failed = result.get(figures.VLLM_KEY["failed"]) or 0
    report.check(
        "load", completed == v.requests and not failed, f"{completed} of {v.requests} requests completed"
    )
    for figure, setting in PASS_MARKS:
        name, limit, key = figures.check_id(figure), getattr(v, setting), figures.VLLM_KEY[figure]
        lower_is_better = not figures.BETTER_HIGHER[figure]
        measured = figures.measured(result, figure)
        shown = f"{measured:.4g}" if measured is not None else "not measured"
        if limit is None:
            report.check(name, None, f"{key} {shown} (no pass mark set: verify.{setting})")
            continue
        ok = measured is not None and (measured <= limit if lower_is_better else measured >= limit)
        sign = "<=" if lower_is_better else ">="
        report.check(name, ok, f"{key} {shown} (pass mark {sign} {limit:g})")


def check_regression(report: VerifyReport, baseline: Mapping[str, Any], tolerance: float) -> None:
    old = baseline.get("bench") or {}
    new = report.bench or {}

    def key(figure: str) -> str:
        return figures.VLLM_KEY[figure]

    worse, compared = figures.worse(
        lambda f: old.get(key(f)), lambda f: new.get(key(f)), figures.VERIFY_REGRESSION, tolerance, key
    )
    if not compared:
        report.check("regression", None, "the baseline and this run share no benchmark figures")
        return
    report.check(
        "regression",
        not worse,
        "; ".join(worse)
        if worse
        else f"{', '.join(map(key, compared))} within {tolerance:.0%} of the baseline",
    )
