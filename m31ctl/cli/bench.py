"""`m31ctl bench`: parse the options and hand them to served/ (bench_run.py: the checks, the
target as verify finds it, the sweep, the report), show progress (rich on a terminal, JSON lines
with --json), then write the files the report names, plot, and print it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from m31ctl.cli import bench_plot
from m31ctl.cli.figure import check_path
from m31ctl.cli.output import console, emit, emit_event, json_text, table, text_view, write_file
from m31ctl.errors import ExitCode, InputError
from m31ctl.redact import redact
from m31ctl.served import bench_run
from m31ctl.served.bench_run import PICKS, BenchRequest, BenchResult
from m31ctl.served.cost import Costing

if TYPE_CHECKING:
    from m31ctl.deployment import Deployment
    from m31ctl.served.figures import Point
    from m31ctl.served.sweep import Event

__all__ = ["PICKS", "parse_concurrency", "run_bench"]  # PICKS: bench compare's --pick too


def parse_concurrency(text: str) -> tuple[int, ...]:
    """`1,4,16` -> (1, 4, 16): positive, distinct, in increasing order."""
    values: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise InputError(f"--concurrency {part!r} is not a positive whole number", hint="e.g. 1,4,16")
        values.add(int(part))
    if not values:
        raise InputError("--concurrency is empty", hint="e.g. 1,4,16")
    return tuple(sorted(values))


def run_bench(
    asked: Callable[[], Deployment], given: bool, request: BenchRequest, *, output: Path | None, as_json: bool
) -> int:
    """`asked()` resolves the plan options (`given`: any were passed); without them, the plan a
    server m31ctl runs was launched with is used, as verify does (served/target.py)."""
    checked = bench_run.check(request)
    if request.plot is not None:
        check_path(request.plot)
    progress = _Progress(as_json)
    try:
        result = bench_run.run(asked, given, request, checked, progress.on_event)
    finally:
        progress.close()
    report = result.report
    if request.profile is not None and result.profile_text is not None:
        write_file(request.profile, result.profile_text)
    if request.plot is not None and report["plot"] is not None:
        title = f"m31ctl bench: {result.found.workload} on {report['measured_on']}, plan {result.plan.hash}"
        bench_plot.draw(result.found, title, request.plot, result.costing)
    if output is not None:
        write_file(output, json_text(report))
    # Under --json the last line of the event stream.
    emit(result, as_json, line=True)
    return int(ExitCode.OK if result.ok else ExitCode.CHECK_FAILED)


def _cell(value: float | None, digits: str = ".4g") -> str:
    return "-" if value is None else format(value, digits)


def point_line(event: Event) -> str:
    p = event.point
    assert p is not None
    if p.error is not None:
        return f"concurrency {p.concurrency}: not measured: {p.error} ({event.elapsed_s:.0f} s)"
    done = f"{p.completed}/{p.requests} requests" + (f", {p.failed} failed" if p.failed else "")
    return (
        f"concurrency {p.concurrency}: {done}, {p.tok_s_per_user:.4g} tok/s/user, {p.tok_s_per_gpu:.4g} tok/s/GPU, "
        f"p99 TTFT {_cell(p.ttft_p99_ms)} ms, p99 TPOT {_cell(p.tpot_p99_ms)} ms ({event.elapsed_s:.0f} s)"
    )


class _Progress:
    """Progress of the sweep: JSON lines (--json), a rich bar on a terminal, else a line a point."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.live: Any = None
        self.task: Any = None
        self.started = False

    def _start(self) -> None:
        """The bar, on a terminal, from the sweep's first event (after the target is found)."""
        self.started = True
        if not self.as_json and sys.stderr.isatty():
            # lazy: rich's progress bar, only on a terminal
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self.live = Progress(
                SpinnerColumn(),
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total} points"),
                TimeElapsedColumn(),
                console=console(stderr=True),
            )
            self.live.start()

    def on_event(self, event: Event) -> None:
        if not self.started:
            self._start()
        if self.as_json:
            data: dict[str, Any] = {
                "concurrency": event.concurrency,
                "index": event.step + 1,
                "of": event.total,
                "elapsed_s": round(event.elapsed_s, 3),
            }
            if event.point is not None:
                data["point"] = event.point.to_json()
            emit_event("point" if event.kind == "point" else "point-start", data)
        elif self.live is not None:
            if self.task is None:
                self.task = self.live.add_task("", total=event.total)
            if event.kind == "start":
                self.live.update(self.task, description=f"concurrency {event.concurrency}: vllm bench serve")
            else:
                self.live.update(self.task, advance=1)
                self.live.console.print(point_line(event), markup=False, highlight=False)
        elif event.kind == "point":
            sys.stderr.write(point_line(event) + "\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()


def _fit_words(t: Any, width: int) -> None:
    """Where the table is wider than the terminal, each column as wide as its longest word
    (header included): a cell then wraps at its spaces, never inside a number or a word. Rich's
    own narrowing evens the columns out and folds a figure mid-number ("355." over "5")."""
    texts = [[str(cell) for cell in (column.header, *column.cells)] for column in t.columns]
    gaps = len(t.columns) - 1
    if sum(max(map(len, cells)) for cells in texts) + gaps <= width:
        return
    for column, cells in zip(t.columns, texts, strict=True):
        column.width = max(len(word) for cell in cells for word in (cell.split() or [""]))


@text_view(BenchResult)
def _print(shown: BenchResult) -> None:
    from rich.text import Text  # lazy: rich is start-up cost that --json never needs

    found, report, profile_asked, costing = shown.found, shown.report, shown.profile_asked, shown.costing
    out = console()
    title = redact(f"bench {found.endpoint}: {found.workload}, plan {found.plan_hash}, {found.gpus} GPU(s)")
    columns = [
        "conc.",
        "done",
        "tok/s per user",
        "tok/s per GPU",
        "output tok/s",
        "TTFT p50/p99 ms",
        "TPOT p50/p99 ms",
    ]
    columns += ["goodput", "accept. len"]
    if costing is not None:
        columns.append(f"{costing.price.currency}/M out")
    columns.append("frontier")
    t = table(None, columns)
    # Eleven columns in 80: one space between columns instead of a ruled box, and each column at
    # least as wide as its longest word (headers included), so a cell wraps at its spaces and never
    # inside a number or a word (rich folds a cell narrower than a word mid-word).
    t.box, t.padding, t.collapse_padding, t.pad_edge = None, (0, 1), True, False
    chosen = found.choice.point.concurrency if found.choice.point else None
    for p in found.points:
        mark = ("yes" if p.concurrency in found.frontier else "") + (
            " (chosen)" if p.concurrency == chosen else ""
        )
        cells = [
            str(p.concurrency),
            f"{p.completed}/{p.requests}",
            _cell(p.tok_s_per_user),
            _cell(p.tok_s_per_gpu),
            _cell(p.output_tok_s),
            f"{_cell(p.ttft_p50_ms)} / {_cell(p.ttft_p99_ms)}",
            f"{_cell(p.tpot_p50_ms)} / {_cell(p.tpot_p99_ms)}",
            "-" if p.goodput_share is None else f"{p.goodput_share:.0%}",
            _cell(p.spec.acceptance_length if p.spec else None),
        ]
        if costing is not None:
            cells.append(_cell(costing.per_million_output(p)))
        t.add_row(*cells, mark)
    _fit_words(t, out.width)
    out.print(Text(title, style="bold"))
    out.print(t)
    lines = _errors(found.points)
    lines += [
        f"KV over NIXL at concurrency {p.concurrency}: {p.kv_transfer.transfers} transfers, "
        f"{p.kv_transfer.bytes_transferred / 1e6:,.1f} MB, {p.kv_transfer.failed_transfers} failed; prompt "
        f"tokens {p.kv_transfer.external_prompt_tokens:,} from prefill, {p.kv_transfer.local_prompt_tokens:,} "
        "computed by decode"
        for p in found.points
        if p.kv_transfer is not None
    ]
    lines.append(f"choice: {found.choice.reason}")
    lines += [f"  concurrency {n.concurrency}: {n.reason}" for n in found.choice.neighbours]
    lines += [f"warning: {w}" for w in report["warnings"]]
    regressions = report.get("regressions")
    if regressions:
        worse = regressions["worse"]
        lines.append(
            "regression: "
            + ("; ".join(worse) if worse else f"none over {regressions['compared_points']} points")
        )
    if profile_asked:
        lines.append(
            f"profile: {report['profile']}"
            if "profile" in report
            else "profile: not written (no operating point)"
        )
    if costing is not None:
        lines.append(_cost_line(costing, found.choice.point))
    if report.get("plot"):
        lines.append(f"plot: {report['plot']}")
    lines.append(f"measured on {report['measured_on']} in {found.wall_s:.1f} s")
    for line in lines:
        out.print(Text(redact(line)))


def _errors(points: tuple[Point, ...]) -> list[str]:
    """Why points were not measured, one line per distinct cause (every point usually shares it)."""
    causes: dict[str, list[int]] = {}
    for p in points:
        if p.error is not None:
            causes.setdefault(p.error, []).append(p.concurrency)
    return [
        f"error: concurrency {', '.join(map(str, at))} not measured: {cause}" for cause, at in causes.items()
    ]


def _cost_line(costing: Costing, chosen: Point | None) -> str:
    money = costing.price.currency
    line = f"cost: {costing.price.describe()} x {costing.rented} = {costing.per_hour:.4g} {money}/hour"
    if chosen is not None:
        tokens = costing.tokens_per_unit(chosen)
        line += (
            f"; at the chosen point {_cell(costing.per_million_output(chosen))} {money} per million output "
            f"tokens, {_cell(costing.per_million_total(chosen))} per million total, "
            f"{_cell(tokens)} tokens per {money}"
        )
    return line + " (GPU rental while busy: no idle time, power or networking)"
