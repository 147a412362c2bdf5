"""`m31ctl verify`: find the server and its benchmark runner, run the checks, print and save."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from m31ctl.deployment import Deployment
from m31ctl.errors import ExitCode, InputError

if TYPE_CHECKING:
    from m31ctl.checks import CheckResult
    from m31ctl.runtime.load_run import BenchRunner
    from m31ctl.runtime.verify import VerifyReport


class _Target(NamedTuple):
    """What verify checks: the plan, where the server answers, and how to load it."""

    deployment: Deployment
    base: str
    server_hash: str | None  # for verify's own plan check, when the server recorded no plan
    plan_check: CheckResult | None  # the plan check against the server's recorded plan
    bench: BenchRunner | None


def _target(
    asked: Callable[[], Deployment],
    given: bool,
    url: str | None,
    name: str | None,
    runtime: str | None,
    bench_python: str | None,
) -> _Target:
    """The server and its bench runner. A server m31ctl runs is verified against the plan it was
    launched with (recorded with it) unless plan options are given; then against theirs, with the
    settings that differ named. Its runtime supplies the bench runner (its engine's vLLM)."""
    from m31ctl.checks import judged
    from m31ctl.runtime import get_runtime, running_server
    from m31ctl.runtime.load_run import native_bench
    from m31ctl.runtime.planrecord import comparison, recorded_deployment

    chosen = native_bench(bench_python) if bench_python else None
    if url is not None:
        return _Target(asked(), url.rstrip("/"), None, None, chosen)
    server = running_server(name, runtime)
    own: Deployment | None = None
    if server.plan is not None:
        try:
            own = recorded_deployment(server.plan)
        except InputError:
            if not given:
                raise
    deployment = asked() if given or own is None else own
    check = None
    if own is not None:
        ok, message = comparison(server.plan_hash or "?", own.plan, deployment.plan)
        check = judged("plan", ok, message)
    bench = chosen or get_runtime(server.runtime).bench_runner(own or deployment)
    return _Target(deployment, str(server.endpoint), server.plan_hash, check, bench)


def run_verify(
    asked: Callable[[], Deployment],
    given: bool,
    url: str | None,
    name: str | None,
    runtime: str | None,
    bench_python: str | None,
    no_load: bool,
    output: Path | None,
    baseline: Path | None,
    tolerance: float,
    as_json: bool,
) -> int:
    """`asked()` resolves the plan options (`given`: any were passed); without them, a server's
    recorded plan is verified, so a bare `m31ctl verify` never probes this host for one."""
    from m31ctl.runtime import verify

    if not (0 <= tolerance < math.inf):
        raise InputError(f"--tolerance {tolerance:g} must be a non-negative fraction", hint="e.g. 0.25")
    old = verify.read_baseline(baseline) if baseline is not None else None
    target = _target(asked, given, url, name, runtime, bench_python)
    report = verify.run(
        target.deployment,
        target.base,
        server_plan_hash=None if target.plan_check else target.server_hash,
        bench=None if no_load else target.bench,
        baseline=old,
        tolerance=tolerance,
    )
    if target.plan_check is not None:
        report.checks.insert(0, target.plan_check)
    if output is not None:
        import json

        from m31ctl.cli.output import write_file
        from m31ctl.redact import redact_data

        # Redacted like everything printed: the report quotes the server's answers, which may
        # echo the API key it was sent.
        write_file(output, json.dumps(redact_data(report.to_json()), indent=2, sort_keys=True) + "\n")
    if as_json:
        from m31ctl.cli.output import emit_json

        emit_json(report.to_json())
    else:
        _print(report)
    return int(ExitCode.OK if report.ok else ExitCode.CHECK_FAILED)


def _print(report: VerifyReport) -> None:
    from rich.markup import escape
    from rich.text import Text

    from m31ctl.cli.output import console, table
    from m31ctl.redact import redact, redact_data

    out = console()
    found = redact_data(report.to_json())
    assert isinstance(found, dict)  # redact_data keeps the shape it is given
    data = found
    title = escape(f"verify {data['endpoint']} (plan {data['plan_hash']})")
    t = table(title, ["check", "result", "detail"])
    style = {"pass": "[green]pass[/green]", "fail": "[red]FAIL[/red]", "skip": "[dim]skip[/dim]"}
    for c in data["checks"]:
        # Text, not markup: a detail quotes what the server sent, which may hold [brackets].
        t.add_row(Text(c["check"]), style[c["status"]], Text(c["detail"]))
    out.print(t)
    bench = data.get("bench") or {}
    if bench:
        out.print(
            redact(
                "load: "
                + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in bench.items())
            ),
            markup=False,
        )
    if data["ok"]:
        out.print("[green]verified[/green]")
    else:
        out.print(Text.assemble(("failed:", "red"), " " + ", ".join(data["failed"])))
