"""What `m31ctl rehearse` prints: progress lines on stderr while it runs, then the report (one
JSON object with --json). Exit 0 only when the twin served; 5 when it did not (a node died or
never became ready), with the failing node's own error line."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from m31ctl.cli.output import emit_json
from m31ctl.errors import ExitCode

if TYPE_CHECKING:
    from m31ctl.plan import Plan
    from m31ctl.rehearsal.result import RehearsalResult
    from m31ctl.rehearsal.runner import Options


def run_rehearse(plan: Plan, options: Options, as_json: bool) -> int:
    from m31ctl.rehearsal.runner import rehearse

    def progress(line: str) -> None:
        sys.stderr.write(f"rehearse: {line}\n")
        sys.stderr.flush()

    result = rehearse(plan, options, progress=progress)
    if as_json:
        emit_json(result.to_json())
    else:
        sys.stdout.write(summary(result))
    return int(ExitCode.OK if result.served else ExitCode.NOT_READY)


def summary(result: RehearsalResult) -> str:
    lines = [f"{'SERVED' if result.served else 'FAILED'}: {result.layout} (plan {result.plan_hash})"]
    lines += ["scaled and replaced for this host:"]
    lines += [f"  {c.key}: {c.plan!r} -> {c.twin!r} ({c.why})" for c in result.changes]
    for node in result.nodes:
        ready = f"ready after {node.ready_s} s" if node.ready_s is not None else "not ready"
        ended = "" if node.exit_code is None else f", exited {node.exit_code}"
        lines.append(f"{node.pod} [{node.role}] {node.address or '-'}: {ready}{ended}")
        lines += [f"    {rank}" for rank in node.ranks]
    passed = sum(1 for p in result.probes if p.passed)
    lines.append(f"probes passed: {passed} of {len(result.probes)}")
    lines += [
        f"  {'ok  ' if p.passed else 'FAIL'} {p.pod} {p.probe} ({p.attempts} tries)" for p in result.probes
    ]
    if result.served:
        lines.append(f"{result.completions} completions and smoke answered through {result.endpoint}")
    else:
        lines.append(f"failure: {result.failure}")
        if result.failing_node:
            lines.append(f"  {result.failing_node}: {result.error_line or '(no error line in its log)'}")
        if result.cause:
            lines.append(f"  likely cause: {result.cause}")
    if result.not_emulated:
        lines.append("not emulated: " + "; ".join(result.not_emulated))
    if result.kept:
        label = f"label=io.m31ctl.rehearsal={result.session}"
        lines.append(
            f"kept (--keep): docker rm -f -v $(docker ps -aq --filter {label}); "
            f"docker network rm $(docker network ls -q --filter {label}); "
            f"docker volume rm $(docker volume ls -q --filter {label})"
        )
    elif not result.cleaned:
        lines.append("LEFT BEHIND: " + " ".join(result.leftovers))
    lines.append(f"took {result.timings_s.get('total_s', 0):g} s")
    return "\n".join(lines) + "\n"
