"""`m31ctl verify`: the options to served/ (target, checks), then print and save the report."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from m31ctl.cli.output import console, emit, json_text, table, text_view, write_file
from m31ctl.deployment import Deployment
from m31ctl.errors import ExitCode, InputError
from m31ctl.redact import redact, redact_data
from m31ctl.served import target as targets
from m31ctl.served import verify
from m31ctl.served.baseline import verify_report
from m31ctl.served.verified import VerifyReport


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
    if not (0 <= tolerance < math.inf):
        raise InputError(f"--tolerance {tolerance:g} must be a non-negative fraction", hint="e.g. 0.25")
    old = verify_report(baseline) if baseline is not None else None
    target = targets.find(asked, given, targets.Where(url, name, runtime, bench_python))
    report = verify.run_target(target, no_load=no_load, baseline=old, tolerance=tolerance)
    if output is not None:
        write_file(output, json_text(report.to_json()))  # redacted, as everything printed
    emit(report, as_json)
    return int(ExitCode.OK if report.ok else ExitCode.CHECK_FAILED)


@text_view(VerifyReport)
def _print(report: VerifyReport) -> None:
    # lazy: rich is start-up cost that --json never needs
    from rich.markup import escape
    from rich.text import Text

    out = console()
    found = redact_data(report.to_json())
    assert isinstance(found, dict)  # redact_data keeps the shape it is given
    data = found
    title = escape(f"verify {data['endpoint']} (plan {data['plan_hash']})")
    t = table(title, ["check", "result", "detail"])
    style = {
        "ok": "[green]pass[/green]",
        "warn": "[yellow]warn[/yellow]",
        "fail": "[red]FAIL[/red]",
        "skip": "[dim]skip[/dim]",
    }
    for c in data["checks"]:  # CheckResult.to_json's shape, redacted
        # Text, not markup: a message quotes what the server sent, which may hold [brackets].
        t.add_row(Text(c["id"]), style[c["status"]], Text(c["message"]))
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
