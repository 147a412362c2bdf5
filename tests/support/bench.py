"""A bench point on fixed figures, for the tests of what bench makes of its points (the frontier,
the SLO pick, the cost)."""

from __future__ import annotations

from typing import Any

from m31ctl.served.figures import Point


def point(concurrency: int, per_user: float, per_gpu: float, **kw: Any) -> Point:
    """A point with the two frontier axes and, by default, latencies that follow from them."""
    values: dict[str, Any] = {
        "concurrency": concurrency,
        "requests": 4 * concurrency,
        "completed": 4 * concurrency,
        "failed": 0,
        "duration_s": 10.0,
        "mean_input_tokens": 1000.0,
        "mean_output_tokens": 256.0,
        "tok_s_per_user": per_user,
        "output_tok_s": per_gpu / 4,
        "total_tok_s": per_gpu,
        "tok_s_per_gpu": per_gpu,
        "output_tok_s_per_gpu": per_gpu / 4,
        "ttft_p50_ms": 50.0 * concurrency,
        "ttft_p99_ms": 100.0 * concurrency,
        "tpot_p50_ms": 1000.0 / per_user,
        "tpot_p99_ms": 1200.0 / per_user,
        "e2el_p99_ms": 5000.0,
        "request_throughput": 1.0,
        "request_goodput": None,
    }
    values.update(kw)
    return Point(**values)
