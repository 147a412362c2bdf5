"""What launch, status, logs and stop print, and the prompts and progress they show."""

from __future__ import annotations

import json as jsonlib
import shlex
import sys
from collections.abc import Callable
from typing import Any

from m31ctl.capacity.fit import plan_fit
from m31ctl.cli.output import console, emit_json, table
from m31ctl.cli.views import plan_json, print_plan
from m31ctl.deployment import Deployment
from m31ctl.runtime import Survey
from m31ctl.runtime.base import DryRun, LaunchResult, PullEvent, PullProgress, Reporter
from m31ctl.runtime.phases import Phase


def reporter() -> Reporter:
    """Progress lines go to stderr, so stdout stays one JSON object under --json."""

    def report(line: str) -> None:
        sys.stderr.write(f"m31ctl: {line}\n")
        sys.stderr.flush()

    return report


class PhaseDisplay:
    """On a terminal, the startup phase as a live rich status line on stderr ("loading weights,
    42 s"), with progress lines printed above it; elsewhere nothing (the report lines say it)."""

    def __init__(self, live: bool) -> None:
        self._status: Any = None
        if live and sys.stderr.isatty():
            from m31ctl.cli.output import console

            self._status = console(stderr=True).status("starting", spinner="dots")
            self._status.start()

    def on_phase(self, phase: Phase, elapsed: float) -> None:
        if self._status is not None:
            self._status.update(f"{phase.value} ({elapsed:.0f} s since start)")

    def close(self) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None


def confirm(question: str) -> bool:
    """Ask on a terminal; anywhere else (CI, a pipe) the answer is no."""
    if not sys.stdin.isatty():
        return False
    import typer

    return bool(typer.confirm(question, default=False))


def pull_progress() -> PullProgress:
    """A rich progress display of an image pull, per layer, on stderr; closed on the final None."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    state: dict[str, Any] = {"progress": None, "tasks": {}}

    def on_event(event: PullEvent | None) -> None:
        progress = state["progress"]
        if event is None:
            if progress is not None:
                progress.stop()
            return
        if progress is None:
            progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                DownloadColumn(),
                TransferSpeedColumn(),
                transient=True,
                console=console(stderr=True),
            )
            progress.start()
            state["progress"] = progress
        tasks = state["tasks"]
        if event.layer not in tasks:
            tasks[event.layer] = progress.add_task(f"layer {event.layer}", total=event.total)
        progress.update(tasks[event.layer], completed=event.current)

    return on_event


def print_dry_run(deployment: Deployment, dry: DryRun, as_json: bool) -> None:
    if as_json:
        payload: dict[str, Any] = {"plan": plan_json(deployment, plan_fit(deployment)), **dry.detail}
        payload[dry.argv_key] = list(dry.argv)
        emit_json(payload)
        return
    print_plan(deployment, plan_fit(deployment), explain=False)
    out = console()
    out.print()
    out.print(f"{dry.kind.capitalize()} (dry run, nothing started):", markup=False)
    out.print(shlex.join(dry.argv), markup=False, soft_wrap=True)


def phase_events() -> Callable[[Phase, float], None]:
    """launch --json: each startup phase as one JSON line on stdout, as it begins (for CI logs)."""
    from m31ctl.cli.output import emit_json_line

    def on_phase(phase: Phase, elapsed: float) -> None:
        emit_json_line({"event": "phase", "phase": phase.value, "elapsed_s": round(elapsed, 3)})

    return on_phase


def print_result(deployment: Deployment, result: LaunchResult, as_json: bool) -> None:
    if as_json:
        # The last line of the event stream: the result object.
        from m31ctl.cli.output import emit_json_line

        emit_json_line(result.to_json())
        return
    out = console()
    verb = {"unchanged": "already serving this plan; nothing changed"}.get(result.action, result.action)
    out.print(f"{result.server}: {verb} (plan {result.plan_hash}, {result.runtime})", markup=False)
    if not result.ready:
        out.print("started; not waiting for readiness (--detach). `m31ctl status` tells when it is up.")
        return
    if "ready" in result.timings:
        out.print(f"ready in {result.timings['ready']:.1f} s", markup=False)
    body = {
        "model": deployment.plan.settings.model.served_name,
        "messages": [{"role": "user", "content": "Hello!"}],
        "max_tokens": 64,
    }
    key = deployment.secrets.api_key
    auth = f' -H "Authorization: Bearer ${key}"' if key else ""
    out.print(f"endpoint: {result.endpoint}/v1", markup=False)
    out.print(
        f"try: curl -s {result.endpoint}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
        f"-d {shlex.quote(jsonlib.dumps(body))}",
        markup=False,
        soft_wrap=True,
    )


def print_unreachable(found: Survey) -> None:
    for name, error in found.unreachable.items():
        sys.stderr.write(f"m31ctl: {name} runtime not asked: {error.one_line()}\n")


def print_status(found: Survey, as_json: bool, differences: dict[str, tuple[str, ...]] | None = None) -> None:
    """The servers; with `differences` (status given plan options), how each one's plan differs."""
    if as_json:
        rows = [s.to_json() for s in found.servers]
        if differences is not None:
            for row in rows:
                changed = differences.get(row["name"], ())
                row.update({"runs_plan": not changed, "plan_differences": list(changed)})
        emit_json(
            {
                "servers": rows,
                # The older key, kept for pipelines that read it: it lists native servers too.
                "containers": rows,
                "unreachable": {name: error.one_line() for name, error in found.unreachable.items()},
            }
        )
        return
    print_unreachable(found)
    if not found.servers:
        console().print("no m31ctl servers")
        return
    columns = ["name", "runtime", "state", "health", "plan", "recipe", "endpoint", "restarts"]
    t = table(None, columns + (["vs the plan given"] if differences is not None else []))
    for s in found.servers:
        cells = [
            s.name,
            s.runtime,
            s.state,
            str(s.health or "-"),
            s.plan_hash or "-",
            f"{s.recipe}/{s.variant}/{s.profile}",
            s.endpoint or "-",
            str(s.restart_count),
        ]
        if differences is not None:
            changed = differences.get(s.name, ())
            cells.append("\n".join(changed) if changed else "same")
        t.add_row(*cells)
    console().print(t)
