"""What `m31ctl rehearse` prints: progress lines on stderr while it runs, then the report (one
JSON object with --json). Exit 0 only when the twin served; 5 when it did not (a node died or
never became ready), with the failing node's own error line."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

from m31ctl.cli.output import emit, text_view
from m31ctl.errors import ExitCode
from m31ctl.labels import Label
from m31ctl.rehearsal.pairing import PairingOutcome, front_answers
from m31ctl.rehearsal.result import RehearsalResult
from m31ctl.rehearsal.rollout_proof import summary_lines
from m31ctl.rehearsal.runner import rehearse
from m31ctl.rehearsal.session import Options

if TYPE_CHECKING:
    from m31ctl.plan import Plan


def run_rehearse(plan: Plan, options: Options, as_json: bool) -> int:
    def progress(line: str) -> None:
        sys.stderr.write(f"rehearse: {line}\n")
        sys.stderr.flush()

    result = rehearse(plan, options, progress=progress)
    emit(result, as_json)
    return int(ExitCode.OK if result.served else ExitCode.NOT_READY)


@text_view(RehearsalResult)
def _rehearsal_text(result: RehearsalResult) -> None:
    sys.stdout.write(summary(result))


def summary(result: RehearsalResult) -> str:
    lines = [f"{'SERVED' if result.served else 'FAILED'}: {result.layout} (plan {result.plan_hash})"]
    lines += ["scaled and replaced for this host:"]
    for why, changes in result.changes_by_reason():
        lines.append(f"  {why or 'the rehearsal'}:")
        # Values as `plan` prints them (JSON: null, {"VLLM_...": "1"}), not as Python's repr.
        lines += [f"    {c.key}: {_value(c.plan)} -> {_value(c.twin)}" for c in changes]
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
    if result.pairing is not None:
        lines += pairing_lines(result.pairing)
    if result.rollout is not None:
        lines += summary_lines(result.rollout)
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
        label = f"label={Label.REHEARSAL}={result.session}"
        lines.append(
            f"kept (--keep): docker rm -f -v $(docker ps -aq --filter {label}); "
            f"docker network rm $(docker network ls -q --filter {label}); "
            f"docker volume rm $(docker volume ls -q --filter {label})"
        )
    elif not result.cleaned:
        lines.append("LEFT BEHIND: " + " ".join(result.leftovers))
    lines.append(f"took {result.timings_s.get('total_s', 0):g} s")
    return "\n".join(lines) + "\n"


def pairing_lines(outcome: PairingOutcome) -> list[str]:
    """A P/D rehearsal's proof, a line a check (rehearsal/pairing.py)."""
    same = sum(p.same for p in outcome.parity)
    recovered = outcome.recovered_after_s
    lines = [
        f"P/D pair: {'proven' if outcome.ok else 'NOT proven'}",
        f"  kv transfer: {outcome.transfer_verdict}",
        f"  the router's front: {front_answers(outcome)}",
        f"  prefill killed: the router answered HTTP {outcome.prefill_down_status}, decode "
        + ("healthy" if outcome.decode_healthy_when_prefill_down else "not healthy"),
        "  prefill back: "
        + (
            f"serving again after {recovered} s"
            if recovered is not None
            else "not serving"
            if outcome.prefill_restarted
            else "not started again (an earlier step failed)"
        ),
        f"  parity with the prefill role alone: {same} of {len(outcome.parity)} prompts equal",
    ]
    lines += [
        f"    {'same' if p.same else 'DIFF'} {p.prompt} ({p.prompt_tokens} prompt tokens)"
        for p in outcome.parity
    ]
    return lines


def _value(value: object) -> str:
    return json.dumps(value, sort_keys=True, default=str)
