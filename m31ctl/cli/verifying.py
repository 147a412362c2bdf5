"""`m31ctl verify`: find the server and its benchmark runner, run the checks, print and save."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from m31ctl.deployment import Deployment
from m31ctl.errors import ExitCode, InputError

if TYPE_CHECKING:
    from m31ctl.runtime.verify import VerifyReport


def run_verify(
    deployment: Deployment,
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
    from m31ctl.runtime import running_server, verify

    plan = deployment.plan

    if not (0 <= tolerance < math.inf):
        raise InputError(f"--tolerance {tolerance:g} must be a non-negative fraction", hint="e.g. 0.25")
    old = verify.read_baseline(baseline) if baseline is not None else None
    server_hash: str | None = None
    bench: verify.BenchRunner | None = None
    if url is not None:
        base = url.rstrip("/")
        if bench_python:
            bench = verify.native_bench(bench_python)
    else:
        server = running_server(name, runtime)
        base, server_hash = str(server.endpoint), server.plan_hash
        if bench_python:
            bench = verify.native_bench(bench_python)
        elif server.runtime == "native":
            bench = verify.native_bench(plan.settings.runtime.native_python or sys.executable)
        elif server.runtime == "docker":
            from m31ctl.container import container_spec

            spec = container_spec(deployment)
            bench = verify.container_bench(spec.image, [(m.source, m.target) for m in spec.mounts])
    report = verify.run(
        deployment,
        base,
        server_plan_hash=server_hash,
        bench=None if no_load else bench,
        baseline=old,
        tolerance=tolerance,
    )
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
