"""The commands that run and look after servers: doctor, launch, status, logs, stop. Each parses
its options, calls one function below cli/ and prints what it returned."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from m31ctl import interrupt
from m31ctl.cli.app import command
from m31ctl.cli.options import (
    AnyRuntimeOpt,
    DoctorLockedOpt,
    JsonOpt,
    LaunchRuntimeOpt,
    LockedOpt,
    NameOpt,
    NoValidateOpt,
    PlanOptions,
    UpdateLockOpt,
)
from m31ctl.cli.output import emit
from m31ctl.errors import ExitCode, HostPreconditionError, InputError
from m31ctl.interrupt import StoppedAsAsked

BlueGreenOpt = Annotated[
    bool,
    typer.Option(
        "--blue-green",
        help="Start the changed plan beside the live server (free GPUs, another port), gate it with "
        "verify's checks, then stop the old one.",
    ),
]
AcceptDowntimeOpt = Annotated[
    bool,
    typer.Option(
        "--accept-downtime", help="--blue-green without free GPUs: stop the old server first, unasked."
    ),
]
RollbackOpt = Annotated[
    bool,
    typer.Option("--rollback", help="Put back the plan the last --blue-green replaced (blue-green again)."),
]
GateNoLoadOpt = Annotated[
    bool, typer.Option("--gate-no-load", help="--blue-green's gate without verify's vllm bench serve load.")
]


@command
def doctor(
    plan_options: PlanOptions,
    json: JsonOpt = False,
    locked: DoctorLockedOpt = None,
    deep: Annotated[
        bool,
        typer.Option("--deep", help="Also run the engine and an all-reduce on the plan's GPUs (seconds)."),
    ] = False,
    runtime: Annotated[
        str,
        typer.Option(
            "--runtime",
            metavar="RUNTIME",
            help="The runtime to check for: docker, or native (no Docker checks); with --deep, where the engine runs.",
        ),
    ] = "docker",
) -> int:
    """Can this host run the plan, and what to fix.

    Checks Docker, GPUs, drivers, disk, port, image."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.cli.doctoring import DoctorShown
    from m31ctl.commands import doctor_report

    # Without plan options (and no --deep) the probed host's default plan is checked.
    request = plan_options.request if plan_options.given or deep else None
    report = doctor_report(request, plan_options.hardware is None, deep, locked, runtime)
    emit(DoctorShown(report), json)
    return int(ExitCode.CHECK_FAILED if report.failed else ExitCode.OK)


@command
def launch(
    plan_options: PlanOptions,
    json: JsonOpt = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan and what would start; start nothing.")
    ] = False,
    detach: Annotated[
        bool, typer.Option("--detach", help="Return once started; do not wait for readiness.")
    ] = False,
    timeout: Annotated[float | None, typer.Option("--timeout", help="Seconds to wait for readiness.")] = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Replace a server running another plan.")] = False,
    name: Annotated[str | None, typer.Option("--name", help="Server (container) name.")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Host port.")] = None,
    runtime: LaunchRuntimeOpt = "docker",
    no_validate: NoValidateOpt = False,
    locked: LockedOpt = None,
    update_lock: UpdateLockOpt = False,
    skip_deep: Annotated[
        bool,
        typer.Option("--skip-deep", help="Skip the preflight's engine and all-reduce check on the GPUs."),
    ] = False,
    no_pull: Annotated[
        bool,
        typer.Option(
            "--no-pull", help="Start without m31ctl pull first (the engine downloads what it lacks)."
        ),
    ] = False,
    blue_green: BlueGreenOpt = False,
    accept_downtime: AcceptDowntimeOpt = False,
    rollback: RollbackOpt = False,
    gate_no_load: GateNoLoadOpt = False,
) -> int:
    """Check, pull, start the server, wait until it answers.

    Resolve the plan, check the host, pull the checkpoint, start the server and wait until the
    model answers."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl import deploy
    from m31ctl.cli import launch_views, pulling
    from m31ctl.cli.locking import apply_lock
    from m31ctl.commands import deployment
    from m31ctl.runtime import get_runtime, refuse_conflicts

    get_runtime(runtime)  # an unknown runtime is bad input before anything resolves
    if timeout is not None and not (0 < timeout < float("inf")):
        raise InputError(
            f"--timeout {timeout:g} is not a positive number of seconds", hint="e.g. --timeout 900"
        )
    switching = launch_views.Switching(blue_green, accept_downtime, rollback, gate_no_load, detach, json)
    fetch = None if no_pull else pulling.before_launch(json)
    if rollback:  # the previous plan, as kept: no plan options, no lock
        d, runtime = switching.rollback(plan_options.given or port is not None or locked is not None, name)
        return switching.run(d, runtime, timeout, not skip_deep, fetch)
    request = plan_options._replace(sets=deploy.launch_sets(plan_options.sets, name, port)).request()
    d = deployment(request, not no_validate)
    if locked is not None:
        # The lock applied: drift refused (exit 4) unless --update-lock, the image pinned (the argv
        # was checked before: the schema is the image tag's, not a digest's).
        d = apply_lock(d, request.files, locked, update_lock, by_id=True)
    if dry_run:
        emit(launch_views.DryRunShown(d, deploy.dry_run(d, runtime)), json)
        return 0
    if switching.asked:
        return switching.run(d, runtime, timeout, not skip_deep, fetch)
    options, display = launch_views.launch_options(timeout, detach, yes, json)
    refuse_conflicts(d, runtime, yes, sys.stdin.isatty)
    try:
        result = deploy.launch(d, runtime, options, deep=not skip_deep, fetch=fetch)
    except HostPreconditionError as exc:
        exc.hint = deploy.preflight_hint(exc, d, runtime, plan_options.argv())
        raise
    finally:
        display.close()
    emit(launch_views.LaunchShown(d, result), json, line=True)  # the last line of the event stream
    return 0


@command
def status(plan_options: PlanOptions, json: JsonOpt = False, runtime: AnyRuntimeOpt = None) -> int:
    """The servers m31ctl runs, in every runtime.

    State, plan, endpoint, health; with plan options, which settings of each server's recorded
    plan differ from theirs."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.cli import launch_views
    from m31ctl.commands import deployment
    from m31ctl.runtime import compare_plans, survey

    found = survey(runtime)
    differences = None
    if plan_options.given:
        asked = deployment(plan_options.request(), validate=False, fit=False)
        differences = compare_plans(found, asked.plan)
    emit(launch_views.StatusShown(found, differences), json)
    return found.exit_code()


@command
def logs(
    name: NameOpt = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines.")] = False,
    tail: Annotated[int, typer.Option("--tail", help="Lines from the end.")] = 100,
    runtime: AnyRuntimeOpt = None,
) -> int:
    """Print (or follow with -f) a server's log."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.cli import launch_views
    from m31ctl.runtime import logs as server_logs

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    if not follow:
        found = server_logs(name, runtime, follow, tail, write)
    else:
        try:
            found = interrupt.call(lambda: server_logs(name, runtime, follow, tail, write))
        except interrupt.Interrupted:
            # Ctrl-C is how one stops following: exit 130 as `tail -f` and `kubectl logs -f` do,
            # and no error line (nothing went wrong; a launch's interrupted line would mislead).
            raise StoppedAsAsked from None
    launch_views.print_unreachable(found)
    return found.exit_code()


@command
def stop(
    name: Annotated[str | None, typer.Option("--name", help="The m31ctl server to stop.")] = None,
    all_servers: Annotated[
        bool, typer.Option("--all", help="Stop every m31ctl server, in every runtime (or --runtime's).")
    ] = False,
    timeout: Annotated[int | None, typer.Option("--timeout", help="Seconds of drain before SIGKILL.")] = None,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the stopped container (and its log).")] = False,
    json: JsonOpt = False,
    runtime: AnyRuntimeOpt = None,
) -> int:
    """Stop a server by --name, or --all of ours.

    The named server wherever it runs, or with --all every one of ours: SIGTERM, a drain, SIGKILL."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.cli import launch_views
    from m31ctl.runtime import stop as stop_servers

    # As `docker stop` and `kubectl delete` refuse to guess: nothing is stopped without a name or
    # a scope the user chose (--all; --runtime R is every one of ours in R, as before).
    if name is None and not all_servers and runtime is None:
        raise InputError(
            "stop needs --name NAME, or --all (every m31ctl server), or --runtime docker|native",
            hint="`m31ctl status` lists our servers",
        )
    if name is not None and all_servers:
        raise InputError("--name and --all exclude each other", hint="--name NAME stops one; --all every one")
    stopped, found = stop_servers(name, runtime, timeout, keep, launch_views.reporter())
    launch_views.print_unreachable(found)
    emit(launch_views.Stopped(stopped), json)
    # Without a name, an engine we could not ask may still run our servers: say so.
    return found.exit_code() if name is None else 0
