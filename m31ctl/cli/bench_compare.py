"""`m31ctl bench compare A.json B.json [...]`: read bench reports, compare them
(m31ctl/served/compare.py), print what each was measured on, the point by point differences and
the verdict; plot the frontiers together; save the comparison as JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from m31ctl.cli import bench_plot
from m31ctl.cli.bench import PICKS
from m31ctl.cli.figure import check_path
from m31ctl.cli.output import console, emit, json_text, text_view, write_file
from m31ctl.cli.screen import print_paragraph, print_table
from m31ctl.errors import ExitCode, InputError
from m31ctl.inputs import read_json
from m31ctl.redact import redact
from m31ctl.served import compare, figures
from m31ctl.served.compare import COST_KEY, Comparison
from m31ctl.served.cost import parse_price


class CompareOptions(NamedTuple):
    reports: tuple[Path, ...]
    slo: str | None
    pick: str
    gpu_hour: float | None
    node_hour: float | None
    currency: str
    force: bool
    plot: Path | None
    output: Path | None
    as_json: bool


def run_compare(opts: CompareOptions) -> int:
    if opts.pick not in PICKS:
        raise InputError(f"unknown --pick {opts.pick!r}", hint=f"choose one of: {', '.join(PICKS)}")
    slo = figures.parse_slo(opts.slo) if opts.slo is not None else None
    price = parse_price(opts.gpu_hour, opts.node_hour, opts.currency)
    if opts.plot is not None:
        check_path(opts.plot)
    labels = _labels(opts.reports)
    reports = [
        compare.read_report(label, read_json(path, "bench report", hint="m31ctl bench -o writes one"))
        for label, path in zip(labels, opts.reports, strict=True)
    ]
    found = compare.compare(reports, slo, opts.pick, price, opts.force)
    data = found.to_json()
    if opts.plot is not None:
        title = (
            "m31ctl bench compare: "
            + " vs ".join(r.label for r in found.reports)
            + f" ({reports[0].workload})"
        )
        bench_plot.draw_compare(found.reports, title, opts.plot)
        data["plot"] = str(opts.plot)
    if opts.output is not None:
        write_file(opts.output, json_text(data))
    emit(CompareShown(found, data), opts.as_json)
    return int(ExitCode.OK)


def _labels(paths: tuple[Path, ...]) -> list[str]:
    """Each report by its file name, or its path where two share a name."""
    names = [p.name for p in paths]
    return [p.name if names.count(p.name) == 1 else str(p) for p in paths]


def _cell(value: float | None) -> str:
    return "-" if value is None else format(value, ".4g")


def _with_change(value: float | None, delta: float | None) -> str:
    text = _cell(value)
    return text if delta is None else f"{text} ({delta:+.0%})"


class CompareShown(NamedTuple):
    """bench compare's result: the comparison and its JSON (with the plot's path, if drawn)."""

    found: Comparison
    data: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return self.data


@text_view(CompareShown)
def _print(shown: CompareShown) -> None:
    from rich.text import Text  # lazy: rich is start-up cost that --json never needs

    found, data = shown
    out = console()
    seen = [
        [
            Text(r.label),
            Text(r.host or "-"),
            r.plan_hash or "-",
            Text(r.image or "-"),
            Text(r.measured_at or "-"),
            str(r.gpus),
            Text(r.costing.price.describe() if r.costing else "-"),
        ]
        for r in found.reports
    ]
    # A report's name and its date are read whole (a date split at its space reads as two things).
    columns = ["report", "host", "plan", "image", "date", "GPUs", "price"]
    print_table(out, "measured on", columns, seen, names=(0, 4))
    base = found.reports[0].label
    money = sorted({r.costing.price.currency for r in found.reports if r.costing})
    columns = ["conc.", "report", "tok/s/user", "tok/s/GPU", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms"]
    columns.append(f"{'/'.join(money) or 'cost'}/M out")
    rows: list[list[Any]] = []
    for row in found.rows:
        for index, (report, values) in enumerate(zip(found.reports, row.values, strict=True)):
            if values is None:
                rows.append([str(row.concurrency), Text(report.label), *(["-"] * (len(columns) - 2))])
                continue
            delta = row.changes[index - 1] if index else None

            def cell(key: str, values: dict[str, float | None] = values, delta: Any = delta) -> str:
                return _with_change(values[key], delta[key] if delta else None)

            rows.append(
                [
                    str(row.concurrency),
                    Text(report.label),
                    cell("tok_s_per_user"),
                    cell("tok_s_per_gpu"),
                    f"{cell('ttft_p50_ms')} / {cell('ttft_p99_ms')}",
                    f"{cell('tpot_p50_ms')} / {cell('tpot_p99_ms')}",
                    cell(COST_KEY),
                ]
            )
    # Stacked, a record's first cell is a bare concurrency: said with its column's name.
    title = f"point by point (changes against {base})"
    print_table(out, title, columns, rows, names=(1,), labeled_head=True)
    lines = [f"forced: {line}" for line in found.forced] + [f"note: {n}" for n in found.notes]
    lines += [f"best of {r.label}: {r.choice.reason}" for r in found.reports]
    lines.append(f"verdict: {found.verdict.text}")
    if data.get("plot"):
        lines.append(f"plot: {data['plot']}")
    for line in lines:
        print_paragraph(out, redact(line))
