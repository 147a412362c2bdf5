"""`m31ctl bench`: find the server and its benchmark runner (as verify does), run the sweep with
progress (rich on a terminal, JSON lines with --json), then print, plot and write what it found."""

from __future__ import annotations

import math
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from m31ctl.errors import ExitCode, InputError

if TYPE_CHECKING:
    from m31ctl.bench.sweep import Event, Runner, Sweep
    from m31ctl.plan import Plan


class BenchOptions(NamedTuple):
    url: str | None
    name: str | None
    runtime: str | None
    bench_python: str | None
    concurrency: str
    workload: str
    slo: str | None
    requests: int | None
    output_len: int | None
    seed: int
    plot: Path | None
    write_profile: Path | None
    output: Path | None
    baseline: Path | None
    tolerance: float
    as_json: bool


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


def run_bench(plan: Plan, opts: BenchOptions) -> int:
    from m31ctl.bench import figures, sweep, workloads
    from m31ctl.bench.server import HttpServer

    concurrencies = parse_concurrency(opts.concurrency)
    if opts.workload not in workloads.WORKLOADS:
        raise InputError(
            f"unknown --workload {opts.workload!r}", hint=f"choose one of: {', '.join(workloads.WORKLOADS)}"
        )
    for flag, value in (("--requests", opts.requests), ("--output-len", opts.output_len)):
        if value is not None and value < 1:
            raise InputError(f"{flag} {value} must be at least 1")
    if not (0 <= opts.tolerance < math.inf):
        raise InputError(f"--tolerance {opts.tolerance:g} must be a non-negative fraction", hint="e.g. 0.25")
    slo = figures.parse_slo(opts.slo) if opts.slo is not None else ()
    if opts.plot is not None:
        from m31ctl.cli.figure import check_path

        check_path(opts.plot)
    baseline = _read_baseline(opts.baseline, opts.workload) if opts.baseline is not None else None
    request = sweep.SweepRequest(
        "", opts.workload, concurrencies, opts.requests, opts.output_len, slo, opts.seed
    )
    with tempfile.TemporaryDirectory(prefix="m31ctl-bench-") as tmp:
        workdir = Path(tmp)
        workdir.chmod(0o755)  # a sibling container's benchmark reads the datasets
        base, server_hash, runner = _endpoint(plan, opts, workdir)
        server = HttpServer(base, plan.settings.model.served_name)
        progress = _Progress(opts.as_json)
        try:
            found = sweep.run(plan, request._replace(base=base), server, runner, workdir, progress.on_event)
        finally:
            progress.close()
            server.close()
    return _finish(plan, opts, found, server_hash, baseline)


def _endpoint(plan: Plan, opts: BenchOptions, workdir: Path) -> tuple[str, str | None, Runner]:
    """The endpoint, the plan hash its server runs (None for --url), and the benchmark runner:
    the engine's own Python (the native runtime's, or --bench-python) or its image."""
    from m31ctl.runtime import load_run, running_server

    runtime: str | None = None
    server_hash: str | None = None
    if opts.url is not None:
        base = opts.url.rstrip("/")
    else:
        server = running_server(opts.name, opts.runtime)
        base, server_hash, runtime = str(server.endpoint), server.plan_hash, server.runtime
    if opts.bench_python:
        return base, server_hash, load_run.native_bench(opts.bench_python)
    if runtime is not None:
        from m31ctl.deployment import derive
        from m31ctl.runtime import get_runtime

        # The dataset m31ctl wrote is read at the same path by the engine's benchmark.
        return base, server_hash, get_runtime(runtime).bench_runner(derive(plan), shared=(str(workdir),))
    raise InputError(
        "--url needs --bench-python: a Python with vLLM, to run vllm bench serve",
        hint="or bench the server m31ctl runs (--name)",
    )


def _read_baseline(path: Path, workload: str) -> list[dict[str, Any]]:
    """An earlier report's points; one of another workload compares nothing alike (exit 2)."""
    import json

    from m31ctl.inputs import read_text

    try:
        data = json.loads(read_text(path, "baseline report"))
    except ValueError as exc:
        raise InputError(f"not a bench report: {exc}", where=str(path)) from None
    if not isinstance(data, dict) or not isinstance(data.get("points"), list):
        raise InputError("not a bench report (no points)", where=str(path), hint="m31ctl bench -o writes one")
    if data.get("workload") != workload:
        raise InputError(
            f"the baseline measured workload {data.get('workload')!r}; this run measures {workload!r}",
            where=str(path),
            hint="compare runs of the same --workload",
        )
    return [p for p in data["points"] if isinstance(p, dict)]


def _finish(
    plan: Plan,
    opts: BenchOptions,
    found: Sweep,
    server_hash: str | None,
    baseline: list[dict[str, Any]] | None,
) -> int:
    from m31ctl.bench import figures, profile

    fingerprint = profile.host_fingerprint(plan.hardware)
    when = datetime.now(timezone.utc)
    report: dict[str, Any] = {
        **found.to_json(),
        "measured_on": fingerprint,
        "measured_at": when.isoformat(timespec="seconds"),
        "server_plan_hash": server_hash,
        "warnings": [],
    }
    if server_hash is not None and server_hash != plan.hash:
        report["warnings"].append(
            f"the server runs plan {server_hash}; the figures are read with plan {plan.hash} (GPU count, max length)"
        )
    method = plan.settings.speculative.method
    silent = [p.concurrency for p in found.points if p.complete and p.spec is None]
    if method != "none" and silent:
        report["warnings"].append(
            f"the plan speculates ({method}) but no drafts were counted on /metrics at concurrency "
            + ", ".join(map(str, silent))
        )
    worse: tuple[str, ...] = ()
    if baseline is not None:
        worse, compared = figures.regressions(found.points, baseline, opts.tolerance)
        report["regressions"] = {
            "compared_points": compared,
            "worse": list(worse),
            "tolerance": opts.tolerance,
        }
    chosen = found.choice.point
    if opts.write_profile is not None and chosen is not None:
        from m31ctl.cli.output import write_file

        origin = profile.provenance(fingerprint, when)
        data = plan.settings.parallelism.data
        write_file(opts.write_profile, profile.profile_yaml(chosen, found.workload, found.slo, origin, data))
        report["profile"] = str(opts.write_profile)
    if opts.plot is not None:
        from m31ctl.cli import bench_plot

        bench_plot.draw(
            found, f"m31ctl bench: {found.workload} on {fingerprint}, plan {plan.hash}", opts.plot
        )
        report["plot"] = str(opts.plot)
    report["ok"] = chosen is not None and not worse
    if opts.output is not None:
        import json

        from m31ctl.cli.output import write_file
        from m31ctl.redact import redact_data

        write_file(opts.output, json.dumps(redact_data(report), indent=2, sort_keys=True) + "\n")
    if opts.as_json:
        from m31ctl.cli.output import emit_json_line

        emit_json_line(report)  # the last line of the event stream
    else:
        _print(found, report, opts.write_profile is not None)
    return int(ExitCode.OK if report["ok"] else ExitCode.CHECK_FAILED)


def _cell(value: float | None, digits: str = ".4g") -> str:
    return "-" if value is None else format(value, digits)


def point_line(event: Event) -> str:
    p = event.point
    assert p is not None
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
        if not as_json and sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            from m31ctl.cli.output import console

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
        if self.as_json:
            from m31ctl.cli.output import emit_json_line

            data: dict[str, Any] = {
                "event": "point" if event.kind == "point" else "point-start",
                "concurrency": event.concurrency,
                "index": event.step + 1,
                "of": event.total,
                "elapsed_s": round(event.elapsed_s, 3),
            }
            if event.point is not None:
                data["point"] = event.point.to_json()
            emit_json_line(data)
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


def _print(found: Sweep, report: dict[str, Any], profile_asked: bool) -> None:
    from rich.text import Text

    from m31ctl.cli.output import console, table
    from m31ctl.redact import redact

    out = console()
    title = redact(f"bench {found.endpoint}: {found.workload}, plan {found.plan_hash}, {found.gpus} GPU(s)")
    columns = [
        "conc.",
        "done",
        "tok/s/user",
        "tok/s/GPU",
        "output tok/s",
        "TTFT p50/p99 ms",
        "TPOT p50/p99 ms",
    ]
    columns += ["goodput", "accept. len", "frontier"]
    t = table(None, columns)
    chosen = found.choice.point.concurrency if found.choice.point else None
    for p in found.points:
        mark = ("yes" if p.concurrency in found.frontier else "") + (
            " (chosen)" if p.concurrency == chosen else ""
        )
        t.add_row(
            str(p.concurrency),
            f"{p.completed}/{p.requests}",
            _cell(p.tok_s_per_user),
            _cell(p.tok_s_per_gpu),
            _cell(p.output_tok_s),
            f"{_cell(p.ttft_p50_ms)} / {_cell(p.ttft_p99_ms)}",
            f"{_cell(p.tpot_p50_ms)} / {_cell(p.tpot_p99_ms)}",
            "-" if p.goodput_share is None else f"{p.goodput_share:.0%}",
            _cell(p.spec.acceptance_length if p.spec else None),
            mark,
        )
    out.print(Text(title, style="bold"))
    out.print(t)
    lines = [f"choice: {found.choice.reason}"]
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
    if "plot" in report:
        lines.append(f"plot: {report['plot']}")
    lines.append(f"measured on {report['measured_on']} in {found.wall_s:.1f} s")
    for line in lines:
        out.print(Text(redact(line)))
