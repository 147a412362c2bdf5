"""A sweep's figures: one Point per concurrency from `vllm bench serve`'s saved result, the
serving frontier, the SLO and the operating point it picks. Pure: data in, data out.

Per-user speed is 1000 / mean TPOT (the decode speed one user sees once tokens flow, the
usual "interactivity" axis; the mean, as a stream whose tokens arrive in one burst has a TPOT
near 0, and where most do, as on a loaded CPU, the median is one of them); per-GPU throughput is all tokens processed, input and output, per
second and per GPU of the plan. A point whose requests did not all complete is measured and
shown, but is not an operating point: it is never on the frontier and never picked.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from m31ctl.bench.metrics import SpecFigures
from m31ctl.errors import InputError


class Point(NamedTuple):
    concurrency: int
    requests: int
    completed: int
    failed: int
    duration_s: float
    mean_input_tokens: float
    mean_output_tokens: float
    tok_s_per_user: float
    output_tok_s: float
    total_tok_s: float
    tok_s_per_gpu: float
    output_tok_s_per_gpu: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    e2el_p99_ms: float | None
    request_throughput: float
    # vLLM's --goodput: requests per second that met every per-request SLO limit (None: no SLO).
    request_goodput: float | None
    spec: SpecFigures | None = None
    error: str | None = None  # why the benchmark did not run (then nothing was measured)
    run_s: float = 0.0  # the `vllm bench serve` process's wall time, its start-up included

    @property
    def complete(self) -> bool:
        return self.completed == self.requests and not self.failed

    @property
    def goodput_share(self) -> float | None:
        if self.request_goodput is None or not self.request_throughput:
            return None
        return round(self.request_goodput / self.request_throughput, 4)

    def to_json(self) -> dict[str, Any]:
        data = self._asdict()
        data["spec"] = self.spec._asdict() if self.spec else None
        data["goodput_share"] = self.goodput_share
        return data


def _number(result: Mapping[str, Any], key: str) -> float | None:
    value = result.get(key)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def failed_point(concurrency: int, requests: int, error: str) -> Point:
    """A point whose benchmark did not run: every request counted as failed."""
    return point_from_result(concurrency, requests, {"failed": requests}, 1, None)._replace(error=error)


def point_from_result(
    concurrency: int, requests: int, result: Mapping[str, Any], gpus: int, spec: SpecFigures | None
) -> Point:
    """One point from the JSON `vllm bench serve --save-result` writes."""
    completed = int(result.get("completed") or 0)
    output = _number(result, "output_throughput") or 0.0
    total = _number(result, "total_token_throughput") or 0.0
    median_tpot = _number(result, "median_tpot_ms") or _number(result, "p50_tpot_ms")
    mean_tpot = _number(result, "mean_tpot_ms") or median_tpot
    # One output token per request has no decode phase: then the output rate over the users.
    per_user = 1000.0 / mean_tpot if mean_tpot else output / max(1, min(concurrency, completed))
    per = max(1, gpus)
    return Point(
        concurrency=concurrency,
        requests=requests,
        completed=completed,
        failed=int(result.get("failed") or 0),
        duration_s=round(_number(result, "duration") or 0.0, 3),
        mean_input_tokens=round((result.get("total_input_tokens") or 0) / max(1, completed), 1),
        mean_output_tokens=round((result.get("total_output_tokens") or 0) / max(1, completed), 1),
        tok_s_per_user=round(per_user, 3),
        output_tok_s=round(output, 3),
        total_tok_s=round(total, 3),
        tok_s_per_gpu=round(total / per, 3),
        output_tok_s_per_gpu=round(output / per, 3),
        ttft_p50_ms=_number(result, "p50_ttft_ms") or _number(result, "median_ttft_ms"),
        ttft_p99_ms=_number(result, "p99_ttft_ms"),
        tpot_p50_ms=median_tpot,
        tpot_p99_ms=_number(result, "p99_tpot_ms"),
        e2el_p99_ms=_number(result, "p99_e2el_ms"),
        request_throughput=round(_number(result, "request_throughput") or 0.0, 4),
        request_goodput=_number(result, "request_goodput"),
        spec=spec,
    )


# --- the SLO ------------------------------------------------------------------------------------
class Limit(NamedTuple):
    key: str  # as the user wrote it: ttft_p99_ms
    value: float

    @property
    def upper(self) -> bool:
        """An upper bound (latencies), or a lower one (speeds)."""
        return SLO_KEYS[self.key][1]

    def measured(self, point: Point) -> float | None:
        value = getattr(point, SLO_KEYS[self.key][0])
        return float(value) if value is not None else None

    def describe(self, point: Point) -> str:
        """`p99 TTFT 812 ms > 500 ms` (or <= when it holds)."""
        label, unit = SLO_KEYS[self.key][2], SLO_KEYS[self.key][3]
        value = self.measured(point)
        if value is None:
            return f"{label} not measured"
        holds = self.holds(point)
        sign = ("<=" if holds else ">") if self.upper else (">=" if holds else "<")
        return f"{label} {value:.4g} {unit} {sign} {self.value:g} {unit}"

    def holds(self, point: Point) -> bool:
        value = self.measured(point)
        if value is None:
            return False
        return value <= self.value if self.upper else value >= self.value

    def excess(self, point: Point) -> float:
        """How far the point is from meeting this limit, as a ratio (<= 1: it holds)."""
        value = self.measured(point)
        if value is None:
            return math.inf
        if self.upper:
            return value / self.value
        return self.value / value if value > 0 else math.inf


# key -> (Point attribute, upper bound, label, unit)
SLO_KEYS: dict[str, tuple[str, bool, str, str]] = {
    "ttft_p50_ms": ("ttft_p50_ms", True, "p50 TTFT", "ms"),
    "ttft_p99_ms": ("ttft_p99_ms", True, "p99 TTFT", "ms"),
    "tpot_p50_ms": ("tpot_p50_ms", True, "p50 TPOT", "ms"),
    "tpot_p99_ms": ("tpot_p99_ms", True, "p99 TPOT", "ms"),
    "e2el_p99_ms": ("e2el_p99_ms", True, "p99 end-to-end latency", "ms"),
    "min_tok_s_per_user": ("tok_s_per_user", False, "per-user speed", "tok/s"),
}


def parse_slo(text: str) -> tuple[Limit, ...]:
    """`ttft_p99_ms=500,tpot_p99_ms=50` -> limits, in the order given."""
    limits: dict[str, Limit] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        key, sep, raw = part.partition("=")
        key = key.strip()
        if key not in SLO_KEYS:
            raise InputError(f"--slo: unknown key {key!r}", hint=f"use {', '.join(SLO_KEYS)}")
        try:
            value = float(raw) if sep else math.nan
        except ValueError:
            value = math.nan
        if not (0 < value < math.inf):
            raise InputError(f"--slo {key}: {raw!r} is not a positive number", hint=f"e.g. {key}=500")
        if key in limits:
            raise InputError(f"--slo {key} is given twice")
        limits[key] = Limit(key, value)
    if not limits:
        raise InputError("--slo is empty", hint="e.g. --slo ttft_p99_ms=500,tpot_p99_ms=50")
    return tuple(limits.values())


def goodput_args(slo: Sequence[Limit]) -> list[str]:
    """vLLM's --goodput takes per-request limits on ttft, tpot and e2el (ms): each gets the
    tightest limit the SLO sets on it, whatever its percentile."""
    tightest: dict[str, float] = {}
    for limit in slo:
        metric = limit.key.split("_", 1)[0]
        if metric in ("ttft", "tpot", "e2el"):
            tightest[metric] = min(limit.value, tightest.get(metric, math.inf))
    return [f"{metric}:{value:g}" for metric, value in tightest.items()]


def violations(point: Point, slo: Sequence[Limit]) -> list[str]:
    """What keeps the point from being an operating point under the SLO (empty: it qualifies)."""
    missing = point.failed or max(0, point.requests - point.completed)
    found = [] if point.complete else [f"{missing} of {point.requests} requests failed"]
    return found + [limit.describe(point) for limit in slo if not limit.holds(point)]


# --- the frontier and the pick ------------------------------------------------------------------
def frontier(points: Iterable[Point]) -> tuple[int, ...]:
    """Concurrencies of the complete points that no other complete point beats on both per-user
    speed and per-GPU throughput (at least as good on both, better on one)."""
    valid = [p for p in points if p.complete]

    def beaten(p: Point) -> bool:
        return any(
            q.tok_s_per_user >= p.tok_s_per_user
            and q.tok_s_per_gpu >= p.tok_s_per_gpu
            and (q.tok_s_per_user > p.tok_s_per_user or q.tok_s_per_gpu > p.tok_s_per_gpu)
            for q in valid
        )

    return tuple(sorted(p.concurrency for p in valid if not beaten(p)))


class Neighbour(NamedTuple):
    concurrency: int
    reason: str


class Choice(NamedTuple):
    """The operating point, or (point None) the closest one when no point meets the SLO."""

    point: Point | None
    reason: str
    neighbours: tuple[Neighbour, ...] = ()
    closest: Point | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "concurrency": self.point.concurrency if self.point else None,
            "reason": self.reason,
            "neighbours": [n._asdict() for n in self.neighbours],
            "closest": self.closest.concurrency if self.closest else None,
        }


def pick(points: Sequence[Point], slo: Sequence[Limit]) -> Choice:
    """The highest per-GPU throughput among the points that meet the SLO (every point that
    completed, without one), with why each neighbour in concurrency was not chosen."""
    ordered = sorted(points, key=lambda p: p.concurrency)
    meeting = [p for p in ordered if not violations(p, slo)]
    if not meeting:
        if not ordered:
            return Choice(None, "no points were measured")
        closest = min(ordered, key=lambda p: (_distance(p, slo), -p.tok_s_per_gpu))
        why = "; ".join(violations(closest, slo))
        what = "no point meets the SLO" if slo else "no point completed all its requests"
        return Choice(None, f"{what}; closest: concurrency {closest.concurrency} ({why})", closest=closest)
    best = max(meeting, key=lambda p: (p.tok_s_per_gpu, -p.concurrency))
    basis = "meets the SLO" if slo else "no SLO given"
    reason = f"highest per-GPU throughput ({best.tok_s_per_gpu:.4g} tok/s/GPU) of the points; {basis}"
    at = ordered.index(best)
    neighbours = tuple(
        Neighbour(p.concurrency, _why_not(p, best, slo))
        for p in (ordered[at - 1 : at] + ordered[at + 1 : at + 2])
    )
    return Choice(best, reason, neighbours)


def _distance(point: Point, slo: Sequence[Limit]) -> float:
    if not point.complete:
        return math.inf
    return max((limit.excess(point) for limit in slo), default=0.0)


def _why_not(point: Point, best: Point, slo: Sequence[Limit]) -> str:
    failing = violations(point, slo)
    if failing:
        return "fails: " + "; ".join(failing)
    return (
        f"meets the SLO at {point.tok_s_per_gpu:.4g} tok/s/GPU, below {best.tok_s_per_gpu:.4g}"
        if slo
        else f"{point.tok_s_per_gpu:.4g} tok/s/GPU, below {best.tok_s_per_gpu:.4g}"
    )


# --- against an earlier sweep -------------------------------------------------------------------
# (figure, higher is better), compared point by point at equal concurrency.
REGRESSION_FIGURES = (
    ("tok_s_per_gpu", True),
    ("tok_s_per_user", True),
    ("ttft_p99_ms", False),
    ("tpot_p99_ms", False),
)


def regressions(
    points: Sequence[Point], baseline: Sequence[Mapping[str, Any]], tolerance: float
) -> tuple[tuple[str, ...], int]:
    """(what got worse than the baseline by more than `tolerance`, how many points compared)."""
    earlier = {int(p["concurrency"]): p for p in baseline if isinstance(p.get("concurrency"), int)}
    worse: list[str] = []
    compared = 0
    for point in points:
        old = earlier.get(point.concurrency)
        if old is None:
            continue
        compared += 1
        for key, higher_is_better in REGRESSION_FIGURES:
            before, now = old.get(key), getattr(point, key)
            if not isinstance(before, (int, float)) or now is None or before <= 0:
                continue
            change = (now - before) / before
            if (change < -tolerance) if higher_is_better else (change > tolerance):
                worse.append(
                    f"concurrency {point.concurrency}: {key} {before:.4g} -> {now:.4g} ({change:+.0%})"
                )
    return tuple(worse), compared
