"""What launch, status, logs and stop print, and the prompts and progress they show."""

from __future__ import annotations

import json as jsonlib
import os
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import typer

from m31ctl.capacity.fit import plan_fit
from m31ctl.checks import CheckStatus
from m31ctl.cli import output
from m31ctl.cli.output import console, emit, emit_event, text_view
from m31ctl.cli.screen import for_stderr, print_command, print_paragraph, print_table
from m31ctl.cli.views import plan_json, print_plan
from m31ctl.deployment import Deployment
from m31ctl.errors import InputError
from m31ctl.runtime import Survey
from m31ctl.runtime.bluegreen import GateVerdict
from m31ctl.runtime.phases import Phase
from m31ctl.runtime.protocol import DryRun, LaunchOptions, LaunchResult, PullEvent, PullProgress, Reporter


def reporter() -> Reporter:
    """Progress lines go to stderr, so stdout stays one JSON object under --json."""

    def report(line: str) -> None:
        if output.QUIET:
            return
        sys.stderr.write(for_stderr(f"m31ctl: {line}") + "\n")
        sys.stderr.flush()

    return report


class PhaseDisplay:
    """On a terminal, the startup phase as a live rich status line on stderr ("loading weights,
    42 s"), with progress lines printed above it; elsewhere nothing (the report lines say it)."""

    def __init__(self, live: bool) -> None:
        self._status: Any = None
        if live and not output.QUIET and sys.stderr.isatty():
            # The preflight runs first (doctor's checks, seconds): the engine is not starting yet.
            self._status = console(stderr=True).status("preflight: checking the host", spinner="dots")
            self._status.start()
        self._phase_seen = False

    def reporting(self, report: Reporter) -> Reporter:
        """`report`, and until the engine's first phase the status line follows its lines
        (the preflight's warnings, the pull, "started NAME ...")."""

        def both(line: str) -> None:
            report(line)
            if self._status is not None and not self._phase_seen:
                self._status.update(line if len(line) <= 70 else line[:69] + "\u2026")

        return both

    def on_phase(self, phase: Phase, elapsed: float) -> None:
        self._phase_seen = True
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
    return bool(typer.confirm(question, default=False))


def never(question: str) -> bool:
    """Unattended (--json, CI): no question is asked, and the answer is no."""
    del question
    return False


def launch_options(
    timeout: float | None, detach: bool, yes: bool, as_json: bool, ask: Callable[[str], bool] = confirm
) -> tuple[LaunchOptions, PhaseDisplay]:
    """launch's options from its flags, and the live display their progress lines go through
    (closed by the caller when the launch ends)."""
    display = PhaseDisplay(live=not as_json)
    options = LaunchOptions(
        report=display.reporting(reporter()),
        confirm=ask,
        timeout=timeout,
        detach=detach,
        yes=yes,
        environ=dict(os.environ),
        pull_progress=pull_progress(),
        on_phase=phase_events() if as_json else display.on_phase,
    )
    return options, display


@dataclass(frozen=True)
class Switching:
    """launch's blue-green flags (--blue-green, --accept-downtime, --rollback, --gate-no-load):
    checked together, then the switch run through deploy.blue_green and its result shown."""

    blue_green: bool
    accept_downtime: bool
    rollback_asked: bool
    gate_no_load: bool
    detach: bool
    as_json: bool

    def __post_init__(self) -> None:
        for flag, given in (
            ("--accept-downtime", self.accept_downtime),
            ("--gate-no-load", self.gate_no_load),
        ):
            if given and not self.asked:
                raise InputError(f"{flag} applies to --blue-green or --rollback", hint="add --blue-green")
        if self.asked and self.detach:
            raise InputError(
                "--detach and --blue-green exclude each other: the gate needs the new server up",
                hint="drop --detach",
            )

    @property
    def asked(self) -> bool:
        return self.blue_green or self.rollback_asked

    def rollback(self, planned: bool, name: str | None) -> tuple[Deployment, str]:
        """The kept previous plan (deploy.rollback_deployment), and the runtime it ran in."""
        if planned:
            raise InputError(
                "--rollback puts back the kept previous plan: plan options, --port and --locked do not apply",
                hint="drop them, or launch the plan you want with --blue-green",
            )
        from m31ctl import deploy  # lazy: launch's modules

        return deploy.rollback_deployment(name)

    def attended(self) -> bool:
        """A person can answer: a terminal, no --json, not CI (CI=true, as GitHub Actions and
        GitLab set it)."""
        return not self.as_json and sys.stdin.isatty() and not os.environ.get("CI")

    def run(
        self,
        d: Deployment,
        runtime: str,
        timeout: float | None,
        deep: bool,
        fetch: Callable[[Deployment], bool] | None,
    ) -> int:
        from m31ctl import deploy  # lazy: launch's modules

        options, display = launch_options(
            timeout, False, False, self.as_json, confirm if self.attended() else never
        )
        back = ["m31ctl", "launch", "--rollback", "--name", d.name] + (
            ["--gate-no-load"] if self.gate_no_load else []
        )
        switch = deploy.Switch(verify_gate(self.gate_no_load), self.accept_downtime, shlex.join(back))
        try:
            result = deploy.blue_green(d, runtime, options, switch, deep=deep, fetch=fetch)
        finally:
            display.close()
        emit(LaunchShown(d, result), self.as_json, line=True)
        return 0


def verify_gate(no_load: bool) -> Callable[[Deployment, str], GateVerdict]:
    """The blue-green gate: `m31ctl verify --name NEW` (its recorded plan, its runtime's
    benchmark unless `no_load`), as a verdict."""

    def gate(new: Deployment, runtime: str) -> GateVerdict:
        # lazy: served/ talks to the server, only once one is up
        from m31ctl.served import target as targets
        from m31ctl.served import verify

        target = targets.find(lambda: new, False, targets.Where(None, new.name, runtime, None))
        report = verify.run_target(target, no_load=no_load, baseline=None, tolerance=0.25)
        failed = tuple(f"{c.id}: {c.message}" for c in report.checks if c.failed)
        skipped = tuple(c.id for c in report.checks if c.status is CheckStatus.SKIP)
        return GateVerdict(report.ok, tuple(c.id for c in report.checks), failed, skipped)

    return gate


def pull_progress() -> PullProgress:
    """A rich progress display of an image pull, per layer, on stderr; closed on the final None."""
    # lazy: rich's progress display, only for an image pull on a terminal
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


@dataclass(frozen=True)
class DryRunShown:
    """`launch --dry-run`: the plan, and what the runtime would start."""

    deployment: Deployment
    dry: DryRun

    def to_json(self) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "plan": plan_json(self.deployment, plan_fit(self.deployment)),
            **self.dry.detail,
        }
        payload[self.dry.argv_key] = list(self.dry.argv)
        return payload


@text_view(DryRunShown)
def print_dry_run(shown: DryRunShown) -> None:
    dry = shown.dry
    print_plan(shown.deployment, plan_fit(shown.deployment), explain=False)
    out = console()
    out.print()
    print_paragraph(out, f"{dry.kind.capitalize()} (dry run, nothing started):")
    print_command(out, [shlex.quote(word) for word in dry.argv])


def phase_events() -> Callable[[Phase, float], None]:
    """launch --json: each startup phase as one JSON line on stdout, as it begins (for CI logs)."""

    def on_phase(phase: Phase, elapsed: float) -> None:
        emit_event("phase", {"phase": phase.value, "elapsed_s": round(elapsed, 3)})

    return on_phase


@dataclass(frozen=True)
class LaunchShown:
    """launch's result (under --json the last line of its event stream), with the deployment
    its text view quotes (the served model, the API key's variable)."""

    deployment: Deployment
    result: LaunchResult

    def to_json(self) -> dict[str, Any]:
        return self.result.to_json()


@text_view(LaunchShown)
def print_result(shown: LaunchShown) -> None:
    deployment, result = shown.deployment, shown.result
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
    out.print(f"endpoint: {result.endpoint}/v1", markup=False)
    _print_rollout(out, result)
    words = ["curl", "-s", f"{result.endpoint}/v1/chat/completions", "-H", "'Content-Type: application/json'"]
    words += ["-H", f'"Authorization: Bearer ${key}"'] if key else []
    print_command(out, [*words, "-d", shlex.quote(jsonlib.dumps(body))], lead="try: ")


def _print_rollout(out: Any, result: LaunchResult) -> None:
    """A blue-green switch: whom it replaced, after what, and the endpoint move, said plainly."""
    rollout = result.rollout
    if rollout is None:
        return
    how = (
        f"stopped first: about {rollout.downtime_s} s without service (accepted)"
        if rollout.downtime_s is not None
        else "started beside it"
    )
    gpus = f" on GPU {', '.join(map(str, rollout.gpus))}" if rollout.gpus else ""
    out.print(
        f"replaced {rollout.previous} (plan {rollout.previous_plan_hash or '?'}): {how}{gpus}; "
        f"the gate passed (verify's {len(rollout.gate)} checks)",
        markup=False,
    )
    if rollout.previous_endpoint != result.endpoint:
        out.print(f"the endpoint moved: {rollout.previous_endpoint} -> {result.endpoint}", markup=False)
    out.print(f"roll back: {rollout.rollback}", markup=False)


def print_unreachable(found: Survey) -> None:
    for name, error in found.unreachable.items():
        sys.stderr.write(for_stderr(f"m31ctl: {name} runtime not asked: {error.one_line()}") + "\n")


@dataclass(frozen=True)
class StatusShown:
    """status's result: the servers; with `differences` (status given plan options), how each
    one's recorded plan differs from the plan given."""

    found: Survey
    differences: dict[str, tuple[str, ...]] | None = None

    def to_json(self) -> dict[str, Any]:
        rows = [s.to_json() for s in self.found.servers]
        if self.differences is not None:
            for row in rows:
                changed = self.differences.get(row["name"], ())
                row.update({"runs_plan": not changed, "plan_differences": list(changed)})
        return {
            "servers": rows,
            # The older key, kept for pipelines that read it: it lists native servers too.
            "containers": rows,
            "unreachable": {name: error.one_line() for name, error in self.found.unreachable.items()},
        }


@text_view(StatusShown)
def print_status(shown: StatusShown) -> None:
    from rich.text import Text  # lazy: rich is start-up cost that --json never needs

    found, differences = shown.found, shown.differences
    print_unreachable(found)
    if not found.servers:
        console().print("no m31ctl servers")
        return
    columns = ["name", "runtime", "state", "health", "plan", "recipe", "endpoint", "restarts"]
    columns += ["vs the plan given"] if differences is not None else []
    rows = []
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
        rows.append(cells)
    # Names, URLs and hashes are words: folded between them, or a record a server (m31ctl.cli.screen).
    print_table(console(), None, columns, [[Text(cell) for cell in cells] for cells in rows])


@dataclass(frozen=True)
class Stopped:
    """stop's result: the servers it stopped, by name."""

    servers: list[str]

    def to_json(self) -> dict[str, Any]:
        return {"stopped": self.servers}


@text_view(Stopped)
def _stopped_text(stopped: Stopped) -> None:
    if not stopped.servers:
        sys.stderr.write("nothing to stop\n")
    else:  # as `docker stop` names them
        sys.stdout.write("".join(f"stopped {server}\n" for server in stopped.servers))
