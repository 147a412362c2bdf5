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
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from m31ctl.errors import InputError
from m31ctl.served.kv_transfer import KvTransferFacts
from m31ctl.served.spec_decode import SpecFigures


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
    # A P/D group's decode counters over the point (served/kv_transfer.py): how its prompts'
    # KV came over the wire; None for one server (no KV connector exported).
    kv_transfer: KvTransferFacts | None = None

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
        data["kv_transfer"] = self.kv_transfer._asdict() if self.kv_transfer else None
        data["goodput_share"] = self.goodput_share
        return data


# Each figure's one name (a Point's field, an SLO key, a verify pass mark, what verify's report
# keeps) -> the key of `vllm bench serve --save-result`'s JSON it is read from
# (vllm/benchmarks/serve.py). No other module spells one of these keys.
VLLM_KEY = {
    "completed": "completed",
    "failed": "failed",
    "duration_s": "duration",
    "output_tok_s": "output_throughput",
    "total_tok_s": "total_token_throughput",
    "ttft_mean_ms": "mean_ttft_ms",
    "ttft_p50_ms": "p50_ttft_ms",
    "ttft_p99_ms": "p99_ttft_ms",
    "tpot_mean_ms": "mean_tpot_ms",
    "tpot_p50_ms": "median_tpot_ms",
    "tpot_p99_ms": "p99_tpot_ms",
    "itl_p99_ms": "p99_itl_ms",
    "e2el_p99_ms": "p99_e2el_ms",
    "request_throughput": "request_throughput",
    "request_goodput": "request_goodput",
}


def check_id(figure: str) -> str:
    """A verify pass mark's check id, from the vLLM key its figure is read from: p99_ttft_ms ->
    ttft-p99, output_throughput -> output-throughput (the ids saved reports and CI read)."""
    words = VLLM_KEY[figure].removesuffix("_ms").split("_")
    if words[0][:1] == "p" and words[0][1:].isdigit():  # a percentile goes last
        words = [*words[1:], words[0]]
    return "-".join(words)


def _number(result: Mapping[str, Any], key: str) -> float | None:
    value = result.get(key)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def measured(result: Mapping[str, Any], figure: str) -> float | None:
    """A figure from vLLM's saved result, by its one name."""
    return _number(result, VLLM_KEY[figure])


def failed_point(concurrency: int, requests: int, error: str) -> Point:
    """A point whose benchmark did not run: every request counted as failed."""
    return point_from_result(concurrency, requests, {"failed": requests}, 1, None)._replace(error=error)


def point_from_result(
    concurrency: int, requests: int, result: Mapping[str, Any], gpus: int, spec: SpecFigures | None
) -> Point:
    """One point from the JSON `vllm bench serve --save-result` writes."""
    completed = int(result.get(VLLM_KEY["completed"]) or 0)
    output = measured(result, "output_tok_s") or 0.0
    total = measured(result, "total_tok_s") or 0.0
    median_tpot = measured(result, "tpot_p50_ms") or _number(result, "p50_tpot_ms")
    mean_tpot = measured(result, "tpot_mean_ms") or median_tpot
    # One output token per request has no decode phase: then the output rate over the users.
    per_user = 1000.0 / mean_tpot if mean_tpot else output / max(1, min(concurrency, completed))
    per = max(1, gpus)
    return Point(
        concurrency=concurrency,
        requests=requests,
        completed=completed,
        failed=int(result.get(VLLM_KEY["failed"]) or 0),
        duration_s=round(measured(result, "duration_s") or 0.0, 3),
        mean_input_tokens=round((result.get("total_input_tokens") or 0) / max(1, completed), 1),
        mean_output_tokens=round((result.get("total_output_tokens") or 0) / max(1, completed), 1),
        tok_s_per_user=round(per_user, 3),
        output_tok_s=round(output, 3),
        total_tok_s=round(total, 3),
        tok_s_per_gpu=round(total / per, 3),
        output_tok_s_per_gpu=round(output / per, 3),
        ttft_p50_ms=measured(result, "ttft_p50_ms") or _number(result, "median_ttft_ms"),
        ttft_p99_ms=measured(result, "ttft_p99_ms"),
        tpot_p50_ms=median_tpot,
        tpot_p99_ms=measured(result, "tpot_p99_ms"),
        e2el_p99_ms=measured(result, "e2el_p99_ms"),
        request_throughput=round(measured(result, "request_throughput") or 0.0, 4),
        request_goodput=measured(result, "request_goodput"),
        spec=spec,
    )


def point_from_json(data: Mapping[str, Any]) -> Point:
    """A point as a bench report holds it (Point.to_json), back; keys a report of an earlier
    m31ctl lacks take their defaults, keys it adds (frontier, goodput_share) are dropped."""
    fields = {key: data[key] for key in Point._fields if key in data}
    missing = [key for key in Point._fields if key not in fields and key not in Point._field_defaults]
    if missing:
        raise ValueError(f"a point lacks {', '.join(missing)}")
    spec = data.get("spec")
    if isinstance(spec, Mapping):
        spec = SpecFigures(**{**spec, "per_position": tuple(spec.get("per_position") or ())})
    fields["spec"] = spec if isinstance(spec, SpecFigures) else None
    transfer = data.get("kv_transfer")
    fields["kv_transfer"] = KvTransferFacts(**transfer) if isinstance(transfer, Mapping) else None
    return Point(**fields)


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


class Objective(NamedTuple):
    """What the pick maximises among the points that meet the SLO: `rank` (higher is better),
    shown as `value` in `unit`; `worse` says how a lesser value reads ("below", "above")."""

    label: str
    rank: Callable[[Point], float]
    value: Callable[[Point], float | None]
    unit: str
    worse: str

    def describe(self, point: Point) -> str:
        value = self.value(point)
        return "not measured" if value is None else f"{value:.4g} {self.unit}"


THROUGHPUT = Objective(
    "highest per-GPU throughput", lambda p: p.tok_s_per_gpu, lambda p: p.tok_s_per_gpu, "tok/s/GPU", "below"
)


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


def pick(points: Sequence[Point], slo: Sequence[Limit], objective: Objective = THROUGHPUT) -> Choice:
    """The best point by `objective` (default: the highest per-GPU throughput) among the points
    that meet the SLO (every point that completed, without one), with why each neighbour in
    concurrency was not chosen."""
    ordered = sorted(points, key=lambda p: p.concurrency)
    meeting = [p for p in ordered if not violations(p, slo)]
    if not meeting:
        if not ordered:
            return Choice(None, "no points were measured")
        closest = min(ordered, key=lambda p: (_distance(p, slo), -p.tok_s_per_gpu))
        why = "; ".join(violations(closest, slo))
        what = "no point meets the SLO" if slo else "no point completed all its requests"
        return Choice(None, f"{what}; closest: concurrency {closest.concurrency} ({why})", closest=closest)
    best = max(meeting, key=lambda p: (objective.rank(p), -p.concurrency))
    basis = "meets the SLO" if slo else "no SLO given"
    reason = f"{objective.label} ({objective.describe(best)}) of the points; {basis}"
    at = ordered.index(best)
    neighbours = tuple(
        Neighbour(p.concurrency, _why_not(p, best, slo, objective))
        for p in (ordered[at - 1 : at] + ordered[at + 1 : at + 2])
    )
    return Choice(best, reason, neighbours)


def _distance(point: Point, slo: Sequence[Limit]) -> float:
    if not point.complete:
        return math.inf
    return max((limit.excess(point) for limit in slo), default=0.0)


def _why_not(point: Point, best: Point, slo: Sequence[Limit], objective: Objective) -> str:
    failing = violations(point, slo)
    if failing:
        return "fails: " + "; ".join(failing)
    value, chosen = objective.value(point), objective.value(best)
    if value is None or chosen is None:
        measured = objective.describe(point)
    else:
        measured = f"{value:.4g} {objective.unit}, {objective.worse} {chosen:.4g}"
    return f"meets the SLO at {measured}" if slo else measured


# --- against an earlier run --------------------------------------------------------------------
# Every figure a run is compared on, and whether higher is better: bench compares points at equal
# concurrency on BENCH_REGRESSION, verify its one load point on VERIFY_REGRESSION.
BETTER_HIGHER = {
    "tok_s_per_gpu": True,
    "tok_s_per_user": True,
    "output_tok_s": True,
    "ttft_p99_ms": False,
    "tpot_p99_ms": False,
    "e2el_p99_ms": False,
}
BENCH_REGRESSION = ("tok_s_per_gpu", "tok_s_per_user", "ttft_p99_ms", "tpot_p99_ms")
VERIFY_REGRESSION = ("ttft_p99_ms", "tpot_p99_ms", "e2el_p99_ms", "output_tok_s")


def worse(
    before: Callable[[str], object],
    now: Callable[[str], object],
    figures: Sequence[str],
    tolerance: float,
    label: Callable[[str], str] = str,
) -> tuple[list[str], list[str]]:
    """(the figures worse than before by more than `tolerance`, as `name old -> new (+N%)`; the
    figures both runs have). A figure missing from either run, or of no positive value before,
    is not compared."""
    found: list[str] = []
    compared: list[str] = []
    for name in figures:
        old, new = before(name), now(name)
        if not _is_number(old) or not _is_number(new):
            continue
        assert isinstance(old, (int, float)) and isinstance(new, (int, float))
        compared.append(name)
        if old <= 0:
            continue
        change = (new - old) / old
        if (change < -tolerance) if BETTER_HIGHER[name] else (change > tolerance):
            found.append(f"{label(name)} {old:.4g} -> {new:.4g} ({change:+.0%})")
    return found, compared


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def regressions(
    points: Sequence[Point], baseline: Sequence[Mapping[str, Any]], tolerance: float
) -> tuple[tuple[str, ...], int]:
    """(what got worse than the baseline by more than `tolerance`, how many points compared)."""
    earlier = {int(p["concurrency"]): p for p in baseline if isinstance(p.get("concurrency"), int)}
    found: list[str] = []
    compared = 0
    for point in points:
        old = earlier.get(point.concurrency)
        if old is None:
            continue
        compared += 1
        changed, _ = worse(old.get, point._asdict().get, BENCH_REGRESSION, tolerance)
        found += [f"concurrency {point.concurrency}: {line}" for line in changed]
    return tuple(found), compared
