"""The commands: each parses its options, calls the core once, and prints what it returned."""

from __future__ import annotations

import json as jsonlib
import os
import re
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from m31ctl import __version__, interrupt
from m31ctl.cli import output
from m31ctl.cli.options import (
    AnyRuntimeOpt,
    BenchPythonOpt,
    DoctorLockedOpt,
    JsonOpt,
    LaunchRuntimeOpt,
    LockedOpt,
    NameOpt,
    NoValidateOpt,
    PlanOptions,
    UpdateLockOpt,
    UrlOpt,
    not_a_format,
    plan_group,
)
from m31ctl.cli.output import emit, text_view
from m31ctl.errors import ConflictError, ExitCode, HostPreconditionError, InputError, M31Error
from m31ctl.interrupt import StoppedAsAsked
from m31ctl.resources import LOCK_FILE

if TYPE_CHECKING:
    from m31ctl.deployment import Deployment
    from m31ctl.plan import Plan, PlanRequest
    from m31ctl.runtime import Survey

# Commands by name. build_app() registers only the one a command line names (typer converts every
# registered command's options at start-up, a cost paid on each run), or all of them for help.
# Likewise each command imports its own modules in its body: importing them all here would cost
# every command the sum (a Docker client, the hub, doctor's checks) where --help takes 0.1 s.
COMMANDS: dict[str, Callable[..., object]] = {}


# Commands that compute and print, touching no server: they finish in a fraction of a second.
# Nearly everything they allocate lives to the end (classes, validators, typer's parameters), so
# CPython's cyclic collector, run ~80 times at start-up, frees almost nothing: main() turns it
# off for them (about 10 ms of 0.2 s measured, scripts/bench.py). Commands that wait on servers
# (launch, logs, verify, ...) keep it.
QUICK_COMMANDS = frozenset({"plan", "render", "capacity", "validate", "lock", "recipes"})


def command(fn: Callable[..., object]) -> Callable[..., object]:
    COMMANDS[fn.__name__] = fn
    return fn


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"m31ctl {__version__}\n")
        raise typer.Exit()


def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="No progress lines; results and errors only.")
    ] = False,
) -> None:
    """Serve MiniMax-M3.1-Flash with vLLM: probe, plan, render, launch, doctor."""
    output.QUIET = quiet  # set on every run: main() may run many commands in one process (tests)


# The command list of `m31ctl --help`: click cuts a docstring's first sentence at the terminal's
# width with "...", so each command says what it does in words that fit 80 columns.
SHORT_HELP = {
    "plan": "Resolve the recipe for this host and print the plan.",
    "probe": "Detect this host's GPUs and the recipe that fits.",
    "capacity": "Resident sequences and the longest context the plan holds.",
    "render": "Write deployment files: script, compose, k8s, systemd.",
    "lock": "Record the deployment so CI deploys the same one.",
    "validate": "Check the plan's vLLM argv against vLLM's schema.",
    "doctor": "Can this host run the plan, and what to fix.",
    "launch": "Check, pull, start the server, wait until it answers.",
    "status": "The servers m31ctl runs, in every runtime.",
    "logs": "Print (or follow with -f) a server's log.",
    "stop": "Stop a server by --name, or --all of ours.",
    "smoke": "A chat completion and a streamed one; TTFT, tok/s.",
    "verify": "Prove the running server is the plan's (the gate).",
    "bench": "Measure the serving frontier with vllm bench serve.",
    "pull": "Download the plan's checkpoint into its cache.",
    "rehearse": "Run the plan's layout for real on vLLM's CPU build.",
    "version": "Print m31ctl's version.",
}


recipes_app = typer.Typer(help="List, show and validate recipes.", no_args_is_help=True)


def _resolve(request: PlanRequest) -> Plan:
    from m31ctl.plan import resolve  # lazy: only the command run loads its modules (COMMANDS)

    return resolve(request)


def _deploy(plan: Plan, validate: bool = True, fit: bool = True) -> Deployment:
    """The plan's one Deployment; with `fit`, refused when the hardware cannot hold its layout
    (exit 6, as launch's preflight); its argv checked against the engine's schema unless --no-validate."""
    from m31ctl.deployment import (  # lazy: only the command run loads its modules (COMMANDS)
        derive,
        require_fit,
    )

    deployment = derive(plan)
    if fit:
        require_fit(deployment)
    if validate:
        # lazy: the engine's schema check, only when asked for
        from m31ctl.engine.adapter import build_invocation
        from m31ctl.engine.validate import check_plan_engine

        source = plan.provenance.get("engine.extra_args")
        for engine in deployment.engines:  # a P/D group: each role's engine
            check_plan_engine(
                build_invocation(engine),
                plan.settings.engine.schema_version,
                plan.settings.engine.extra_args,
                str(source) if source else None,
            )
    return deployment


def _pinned(
    deployment: Deployment, request: PlanRequest, locked: Path, update: bool, *, by_id: bool
) -> Deployment:
    """The deployment with its lock applied: drift refused (exit 4) unless `update`, the image
    pinned. The argv was checked before the pin: the schema is the image tag's, not a digest's."""
    from m31ctl.cli.locking import apply_lock  # lazy: only the command run loads its modules (COMMANDS)

    return apply_lock(deployment, request.files, locked, update, by_id=by_id)


@recipes_app.command("list")
def recipes_list(json: JsonOpt = False) -> None:
    """The built-in recipes and what they match."""
    from m31ctl.cli import recipes  # lazy: only the command run loads its modules (COMMANDS)

    recipes.list_recipes(json)


@recipes_app.command("show")
def recipes_show(
    name: Annotated[str, typer.Argument(help="Recipe name.", metavar="NAME")], json: JsonOpt = False
) -> None:
    """One recipe: hardware match, hard rules with reasons and sources, variants, profiles."""
    from m31ctl.cli import recipes  # lazy: only the command run loads its modules (COMMANDS)

    recipes.show(name, json)


@recipes_app.command("validate")
def recipes_validate(
    file: Annotated[Path, typer.Argument(help="Recipe YAML file.", metavar="FILE")], json: JsonOpt = False
) -> None:
    """Check a recipe file: schema, rules, and every variant x profile resolving."""
    from m31ctl.cli import recipes  # lazy: only the command run loads its modules (COMMANDS)

    recipes.validate(file, json)


@command
def plan(
    plan_options: PlanOptions,
    json: JsonOpt = False,
    explain: Annotated[bool, typer.Option("--explain", help="Show where every value comes from.")] = False,
    brief: Annotated[
        bool, typer.Option("--brief", help="Leave out the settings table: layout, capacity, command.")
    ] = False,
    no_validate: NoValidateOpt = False,
) -> None:
    """Resolve the recipe for this host (or --hardware) and print the plan."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.capacity.fit import plan_fit
    from m31ctl.cli.views import PlanShown

    d = _deploy(_resolve(plan_options.request()), not no_validate)
    emit(PlanShown(d, plan_fit(d), explain, brief=brief and not explain), json)


@command
def probe(json: JsonOpt = False) -> None:
    """Detect this host's GPUs and tell which recipe fits."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.cli.views import ProbeShown
    from m31ctl.probe import detect

    emit(ProbeShown(detect()), json)


@command
def capacity(
    plan_options: PlanOptions,
    json: JsonOpt = False,
    context: Annotated[
        str | None,
        typer.Option(
            "--context", help="Context length: 262144, 256k, 1m. [default: 256k, or the plan's longest]"
        ),
    ] = None,
    sequences: Annotated[
        int | None, typer.Option("--sequences", help="Also report the longest context for N sequences.")
    ] = None,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Draw sequences against context to this PNG.")
    ] = None,
) -> None:
    """How many sequences stay resident, and how the recipes and cache dtypes compare."""
    from m31ctl.cli import (
        capacity as capacity_view,  # lazy: only the command run loads its modules (COMMANDS)
    )

    d = _deploy(_resolve(plan_options.request()), validate=False)
    capacity_view.run(d, context, sequences, plot, json)


@command
def render(
    target: Annotated[str, typer.Option("--target", help="script | compose | k8s | systemd | monitoring.")],
    plan_options: PlanOptions,
    output: Annotated[
        Path | None,
        typer.Option(
            "-o", "--output", help="Write into DIR (else print).", metavar="DIR", callback=not_a_format
        ),
    ] = None,
    check: Annotated[
        Path | None, typer.Option("--check", help="Exit 1 with a diff when DIR is out of date.")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite files that differ.")] = False,
    revision: Annotated[
        str,
        typer.Option(
            "--revision",
            help="The hub revision to serve: a commit pins it; a branch or tag is pinned to the "
            "commit this machine's cache recorded for it (m31ctl pull), else resolved when the "
            "download runs. --locked pins the lock's commit.",
        ),
    ] = "main",
    no_validate: NoValidateOpt = False,
    locked: LockedOpt = None,
    update_lock: UpdateLockOpt = False,
) -> int:
    """Render deployment artifacts (bash script, Compose, Kubernetes, systemd) from the plan."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.render import files, get_target
    from m31ctl.revision import pin_checkpoint
    from m31ctl.timeline import conflicts

    if check is not None and output is not None:
        raise InputError(
            "--check and -o/--output exclude each other", hint="--check DIR compares; -o DIR writes"
        )
    renderer = get_target(target)
    request = plan_options.request()
    deployment = _deploy(_resolve(request), not no_validate)
    if locked is not None:
        # Rendered files pin a registry digest only: a local image ID means nothing elsewhere.
        deployment = _pinned(deployment, request, locked, update_lock, by_id=False)
    deployment, unpinned = pin_checkpoint(deployment, target, locked, revision)
    if unpinned is not None:
        sys.stderr.write(f"m31ctl: warning: {unpinned}\n")
    for conflict in conflicts(deployment.timeline, dict(deployment.plan.settings.runtime.env)):
        sys.stderr.write(f"m31ctl: warning: {conflict.message}\n")
    artifacts = renderer(deployment)
    if check is not None:
        drift = files.diff(check, artifacts)
        sys.stdout.write(drift)
        return int(ExitCode.CHECK_FAILED if drift else ExitCode.OK)
    if output is None:
        for artifact in artifacts:
            sys.stdout.write(artifact.content)
        return 0
    try:
        written = files.write(output, artifacts, force)
    except ConflictError as exc:
        # The next commands in full: the same target and plan options, which --check needs too.
        same = shlex.join(["m31ctl", "render", "--target", target, *plan_options.argv()])
        exc.hint = (
            f"review it with `{same} --check {shlex.quote(str(output))}`, then pass --force to overwrite"
        )
        raise
    for path, state in written:
        sys.stderr.write(f"{state}: {path}\n")
    return 0


@command
def lock(
    plan_options: PlanOptions,
    output: Annotated[
        Path,
        typer.Option("-o", "--output", help="The lock file to write.", metavar="FILE", callback=not_a_format),
    ] = Path(LOCK_FILE),
    check: Annotated[
        Path | None, typer.Option("--check", help="Exit 1 with the differences when FILE has drifted.")
    ] = None,
    json: JsonOpt = False,
) -> int:
    """Record the deployment (plan, input files, image digest, hardware) so CI deploys the same one."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.cli.locking import check_lock, write_current
    from m31ctl.deployment import derive

    request = plan_options.request()
    deployment = derive(_resolve(request))
    if check is not None:
        checked = check_lock(check, deployment, request.files)
        emit(checked, json)
        return int(ExitCode.CHECK_FAILED if checked.drift else ExitCode.OK)
    emit(write_current(output, deployment, request.files), json)
    return 0


@command
def validate(
    plan_options: PlanOptions,
    json: JsonOpt = False,
) -> int:
    """Check the plan's vLLM argv and environment against vLLM's own schema (no vLLM import)."""
    from m31ctl.cli import views  # noqa: F401  (lazy, as above: the validation's text view)
    from m31ctl.engine.validate import validate_plan  # lazy: only the command run loads its modules

    report = validate_plan(_deploy(_resolve(plan_options.request()), validate=False, fit=False))
    emit(report, json)
    return int(ExitCode.OK if report.ok else ExitCode.BAD_INPUT)


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
    """Check that this host can run the plan: Docker, GPUs, drivers, disk, port, image."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.cli.doctoring import DoctorShown
    from m31ctl.doctor import diagnose
    from m31ctl.probe import detect
    from m31ctl.runtime import get_runtime

    probe = detect()
    request = None
    if plan_options.given or deep:
        request = plan_options.request()
        if plan_options.hardware is None:
            request = request._replace(hardware=probe.hardware)
    get_runtime(runtime)  # an unknown runtime is bad input
    report = diagnose(
        request,
        probe,
        deep=runtime if deep else None,
        locked=locked,
        files=request.files if request else (),
        runtime=runtime,
    )
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
) -> int:
    """Resolve, check, pull, start the server and wait until the model answers."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl import deploy
    from m31ctl.cli import launch_views, pulling
    from m31ctl.runtime import get_runtime
    from m31ctl.runtime.protocol import LaunchOptions

    get_runtime(runtime)  # an unknown runtime is bad input before anything resolves
    if timeout is not None and not (0 < timeout < float("inf")):
        raise InputError(
            f"--timeout {timeout:g} is not a positive number of seconds", hint="e.g. --timeout 900"
        )
    request = plan_options._replace(sets=_with_flags(plan_options.sets, name, port)).request()
    d = _deploy(_resolve(request), not no_validate)
    if locked is not None:
        d = _pinned(d, request, locked, update_lock, by_id=True)
    if dry_run:
        emit(launch_views.DryRunShown(d, deploy.dry_run(d, runtime)), json)
        return 0
    display = launch_views.PhaseDisplay(live=not json)
    options = LaunchOptions(
        report=display.reporting(launch_views.reporter()),
        confirm=launch_views.confirm,
        timeout=timeout,
        detach=detach,
        yes=yes,
        environ=dict(os.environ),
        pull_progress=launch_views.pull_progress(),
        on_phase=launch_views.phase_events() if json else display.on_phase,
    )
    _cheap_conflicts(d, runtime, yes)
    try:
        fetch = None if no_pull else pulling.before_launch(json)
        result = deploy.launch(d, runtime, options, deep=not skip_deep, fetch=fetch)
    except HostPreconditionError as exc:
        exc.hint = _preflight_hint(exc, d, runtime, plan_options)
        raise
    finally:
        display.close()
    emit(launch_views.LaunchShown(d, result), json, line=True)  # the last line of the event stream
    return 0


def _with_flags(sets: tuple[str, ...], name: str | None, port: int | None) -> tuple[str, ...]:
    """launch's --name and --port as the settings they stand for, after the user's --set ones.
    Flags are values, not JSON: encoded so `--name true` stays the string "true". Each keeps its
    flag as its source: an error about it names `--port`, not a `--set #N` nobody typed."""
    from m31ctl.plan.layers import FlagSet  # lazy: only the command run loads its modules (COMMANDS)

    flags = []
    if name is not None:
        flags.append(FlagSet(f"runtime.container_name={jsonlib.dumps(name)}", "--name"))
    if port is not None:
        flags.append(FlagSet(f"runtime.port={port}", "--port"))
    return (*sets, *flags)


def _preflight_hint(exc: Exception, d: Deployment, runtime: str, plan_options: PlanOptions) -> str | None:
    """A failed preflight's next step for this launch: doctor with the same plan options and
    runtime (a bare `m31ctl doctor --deep` checks the probed host's default plan instead), and on
    the native runtime the setting that names the Python."""
    hint = getattr(exc, "hint", None)
    if not hint or "m31ctl doctor" not in hint:
        return hint
    doctor_cmd = shlex.join(
        ["m31ctl", "doctor", "--deep", "--runtime", runtime, *plan_options.argv(), "--json"]
    )
    if "runtime.native_python" in str(exc):
        python = d.plan.settings.runtime.native_python or sys.executable
        return (
            f"point runtime.native_python at a Python with vLLM (it is {python}: "
            f"--set runtime.native_python=PATH); the whole report: `{doctor_cmd}`"
        )
    return re.sub(r"`m31ctl doctor[^`]*`", f"`{doctor_cmd}`", hint)


def _cheap_conflicts(d: Deployment, runtime: str, yes: bool) -> None:
    """What refuses a launch and costs a look, before the preflight's seconds of checks: a server
    of this name running another plan that may not be replaced (no --yes, and no terminal to
    ask), with the settings that differ; a port that something else listens on. The runtime's
    own decision after the preflight still rules (a race, a terminal's answer)."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.netaddr import port_free
    from m31ctl.runtime import Survey, compare_plans, get_runtime

    try:
        same_name = [s for s in get_runtime(runtime).servers() if s.name == d.name]
    except M31Error:
        return  # an engine that cannot be asked: the preflight says so, with its fix
    if same_name:
        server = same_name[0]
        if server.running and server.plan_hash != d.plan.hash and not yes and not sys.stdin.isatty():
            changed = compare_plans(Survey((server,)), d.plan)[server.name]
            raise ConflictError(
                f"{d.name} runs plan {server.plan_hash}, not {d.plan.hash}; not replaced ("
                + "; ".join(changed)
                + ")",
                hint="pass --yes to recreate it with this plan, or --name for another server",
            )
        return  # its port is its own
    network = d.network
    if not port_free(network.bind, network.port):
        raise ConflictError(
            f"port {network.bind}:{network.port} is in use", hint="pass --port, or stop what listens there"
        )


@command
def status(plan_options: PlanOptions, json: JsonOpt = False, runtime: AnyRuntimeOpt = None) -> int:
    """The servers m31ctl runs, in every runtime: state, plan, endpoint, health; with plan options,
    which settings of each server's recorded plan differ from theirs."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.cli import launch_views
    from m31ctl.runtime import compare_plans, survey

    found = survey(runtime)
    differences = None
    if plan_options.given:
        asked = _deploy(_resolve(plan_options.request()), validate=False, fit=False)
        differences = compare_plans(found, asked.plan)
    emit(launch_views.StatusShown(found, differences), json)
    return _incomplete_exit(found)


@command
def logs(
    name: NameOpt = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines.")] = False,
    tail: Annotated[int, typer.Option("--tail", help="Lines from the end.")] = 100,
    runtime: AnyRuntimeOpt = None,
) -> int:
    """Print a server's log."""
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
    return _incomplete_exit(found)


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
    """Stop the named server wherever it runs, or with --all every one of ours: SIGTERM, a drain, SIGKILL."""
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
    return _incomplete_exit(found) if name is None else 0


def _incomplete_exit(found: Survey) -> int:
    """0, or the exit code of a runtime that could not be asked (3: the Docker Engine)."""
    codes = [int(error.exit_code) for error in found.unreachable.values()]
    return max(codes) if codes else 0


@command
def smoke(
    url: UrlOpt = None,
    name: NameOpt = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Served model name (default: the first).")
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens to generate.")] = 16,
    runtime: AnyRuntimeOpt = None,
    json: JsonOpt = False,
) -> int:
    """Send a chat completion and a streamed one; check their shape; measure TTFT and tokens/s."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.cli import smoking  # noqa: F401  (registers the smoke report's text view)
    from m31ctl.runtime import running_server
    from m31ctl.served import smoke as smoke_test

    if url is None:
        server = running_server(name, runtime)
        url = str(server.endpoint)
        # The model the server was launched to serve (its recorded plan), not merely the first listed.
        model = model or (server.plan.served_model if server.plan else None)
    report = smoke_test.run(url.rstrip("/"), model, max_tokens)
    emit(report, json)
    return int(ExitCode.OK if report.ok else ExitCode.CHECK_FAILED)


@command
def verify(
    plan_options: PlanOptions,
    url: UrlOpt = None,
    name: NameOpt = None,
    runtime: AnyRuntimeOpt = None,
    bench_python: BenchPythonOpt = None,
    no_load: Annotated[bool, typer.Option("--no-load", help="Skip the vllm bench serve run.")] = False,
    output: Annotated[
        Path | None,
        typer.Option(
            "-o", "--output", help="Save the JSON report here.", metavar="FILE", callback=not_a_format
        ),
    ] = None,
    baseline: Annotated[
        Path | None, typer.Option("--baseline", help="Fail when worse than this earlier report.")
    ] = None,
    tolerance: Annotated[float, typer.Option("--tolerance", help="Allowed regression (0.25 = 25%).")] = 0.25,
    json: JsonOpt = False,
) -> int:
    """Prove the running server is the plan's: function, served facts, vllm bench serve load, regression."""
    from m31ctl.cli.verifying import run_verify  # lazy: only the command run loads its modules (COMMANDS)

    def asked() -> Deployment:
        return _deploy(_resolve(plan_options.request()), validate=False, fit=False)

    # Without plan options a server's recorded plan is verified (no probe of this host for one).
    return run_verify(
        asked,
        plan_options.given,
        url=url,
        name=name,
        runtime=runtime,
        bench_python=bench_python,
        no_load=no_load,
        output=output,
        baseline=baseline,
        tolerance=tolerance,
        as_json=json,
    )


# bench's price and pick options, shared with `bench compare`.
GpuHourOpt = Annotated[
    float | None, typer.Option("--gpu-hour", help="Price per GPU-hour: report cost per million tokens.")
]
NodeHourOpt = Annotated[
    float | None, typer.Option("--node-hour", help="Price per node-hour (instead of --gpu-hour).")
]
CurrencyOpt = Annotated[str, typer.Option("--currency", help="The price's currency code.")]
PickOpt = Annotated[
    str, typer.Option("--pick", help="throughput | cost: what the best point under the SLO maximises.")
]


@command
def bench(
    plan_options: PlanOptions,
    url: UrlOpt = None,
    name: NameOpt = None,
    runtime: AnyRuntimeOpt = None,
    bench_python: BenchPythonOpt = None,
    concurrency: Annotated[
        str, typer.Option("--concurrency", help="Points to measure, e.g. 1,4,16.")
    ] = "1,4,16",
    workload: Annotated[str, typer.Option("--workload", help="chat | agentic | long-context.")] = "chat",
    slo: Annotated[
        str | None,
        typer.Option("--slo", help="e.g. ttft_p99_ms=500,tpot_p99_ms=50: pick the best point meeting it."),
    ] = None,
    requests: Annotated[
        int | None,
        typer.Option(
            "--requests", help="Requests per point (default 4x concurrency, at least verify.requests)."
        ),
    ] = None,
    output_len: Annotated[
        int | None,
        typer.Option("--output-len", help="Output tokens per request (default verify.output_len)."),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the generated workload.")] = 0,
    plot: Annotated[Path | None, typer.Option("--plot", help="Draw the frontier to this PNG.")] = None,
    write_profile: Annotated[
        Path | None,
        typer.Option("--write-profile", help="Write the chosen point as a plan layer file (YAML)."),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "-o", "--output", help="Save the JSON report here.", metavar="FILE", callback=not_a_format
        ),
    ] = None,
    baseline: Annotated[
        Path | None, typer.Option("--baseline", help="Fail when worse than this earlier bench report.")
    ] = None,
    tolerance: Annotated[float, typer.Option("--tolerance", help="Allowed regression (0.25 = 25%).")] = 0.25,
    gpu_hour: GpuHourOpt = None,
    node_hour: NodeHourOpt = None,
    currency: CurrencyOpt = "USD",
    pick: PickOpt = "throughput",
    json: JsonOpt = False,
) -> int:
    """Measure the serving frontier with vllm bench serve and turn it into the plan's operating point
    (`m31ctl bench compare A.json B.json` lays reports side by side)."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.cli.bench import parse_concurrency, run_bench
    from m31ctl.served.bench_run import BenchRequest
    from m31ctl.served.target import Where

    request = BenchRequest(
        where=Where(url=url, name=name, runtime=runtime, bench_python=bench_python),
        concurrencies=parse_concurrency(concurrency),
        workload=workload,
        slo=slo,
        requests=requests,
        output_len=output_len,
        seed=seed,
        baseline=baseline,
        tolerance=tolerance,
        gpu_hour=gpu_hour,
        node_hour=node_hour,
        currency=currency,
        pick=pick,
        profile=write_profile,
        plot=plot,
    )

    def asked() -> Deployment:
        return _deploy(_resolve(plan_options.request()), validate=False, fit=False)

    # Without plan options a server's recorded plan is used, as verify does (no probe of this host).
    return run_bench(asked, plan_options.given, request, output=output, as_json=json)


# `m31ctl bench compare`: bench's one sub-command. bench takes no positional argument, so a command
# line whose word after `bench` is `compare` names it (build_app registers this group instead).
bench_app = typer.Typer(help="Compare bench reports.", no_args_is_help=True)


@bench_app.command("compare")
def bench_compare(
    reports: Annotated[list[Path], typer.Argument(help="Two or more bench reports (bench -o).")],
    slo: Annotated[
        str | None, typer.Option("--slo", help="The verdict's SLO (default: the first report's).")
    ] = None,
    pick: PickOpt = "throughput",
    gpu_hour: GpuHourOpt = None,
    node_hour: NodeHourOpt = None,
    currency: CurrencyOpt = "USD",
    force: Annotated[
        bool, typer.Option("--force", help="Compare reports of different workloads or models.")
    ] = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Draw the frontiers together here.")] = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Save the comparison here.")] = None,
    json: JsonOpt = False,
) -> int:
    """Lay bench reports side by side: point by point differences and which run's best point wins."""
    from m31ctl.cli.bench_compare import (  # lazy: only the command run loads its modules (COMMANDS)
        CompareOptions,
        run_compare,
    )

    options = CompareOptions(
        reports=tuple(reports),
        slo=slo,
        pick=pick,
        gpu_hour=gpu_hour,
        node_hour=node_hour,
        currency=currency,
        force=force,
        plot=plot,
        output=output,
        as_json=json,
    )
    return run_compare(options)


@command
def pull(
    plan_options: PlanOptions,
    revision: Annotated[
        str, typer.Option("--revision", help="Branch, tag or commit; the download is pinned to its commit.")
    ] = "main",
    verify: Annotated[
        bool, typer.Option("--verify", help="Check every file's size and hub hash; fetch bad ones again.")
    ] = False,
    stall_timeout: Annotated[
        float,
        typer.Option("--stall-timeout", help="Seconds without a byte before a file's transfer is retried."),
    ] = 60.0,
    retries: Annotated[
        int,
        typer.Option(
            "--retries", help="Retries of a stalled file (then plain HTTP instead of Xet, then exit 5)."
        ),
    ] = 3,
    json: JsonOpt = False,
) -> int:
    """Download the plan's checkpoint (and its dspark/ draft) into its Hugging Face cache: resumable, watched, pinned."""
    from m31ctl.cli.pulling import run_pull  # lazy: only the command run loads its modules (COMMANDS)

    deployment = _deploy(_resolve(plan_options.request()), validate=False, fit=False)  # no GPU needed
    return run_pull(deployment, revision, verify, stall_timeout, retries, json)


@command
def rehearse(
    plan_options: PlanOptions,
    target: Annotated[str, typer.Option("--target", help="What to render and run (k8s).")] = "k8s",
    keep: Annotated[
        bool, typer.Option("--keep", help="Leave the containers and network for a look.")
    ] = False,
    timeout: Annotated[int, typer.Option("--timeout", help="Seconds for the leader to become ready.")] = 600,
    image: Annotated[
        str, typer.Option("--image", help="Rehearsal base image (vLLM's CPU build).")
    ] = "m31ctl/vllm-cpu:0.32.0",
    clock_scale: Annotated[
        float | None,
        typer.Option(
            "--clock-scale",
            help="Rehearse at the plan's own clock scaled by F (0 < F <= 1): a load of that length "
            "injected into every engine, vLLM's handshake scaled alike (README: the deployment's clock).",
        ),
    ] = None,
    leader_delay: Annotated[
        float, typer.Option("--leader-delay", help="Start the leader S seconds after its workers.")
    ] = 0.0,
    no_validate: NoValidateOpt = False,
    json: JsonOpt = False,
) -> int:
    """Run the plan's layout and rendered commands for real with vLLM's CPU build (a tiny model,
    Docker containers as nodes), send completions and smoke through the leader, remove it all."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.cli.rehearsing import run_rehearse
    from m31ctl.rehearsal.session import Options

    if timeout <= 0:
        raise InputError(f"--timeout {timeout} is not a positive number of seconds")
    if clock_scale is not None and not 0 < clock_scale <= 1:
        raise InputError(f"--clock-scale {clock_scale:g} is not in (0, 1]", hint="e.g. --clock-scale 0.05")
    if leader_delay < 0:
        raise InputError(f"--leader-delay {leader_delay:g} is negative")
    plan = _deploy(_resolve(plan_options.request()), not no_validate).plan
    options = Options(target, keep, timeout, image, clock_scale=clock_scale, leader_delay_s=leader_delay)
    return run_rehearse(plan, options, json)


@command
def version(json: JsonOpt = False) -> None:
    """Print m31ctl's version (as `m31ctl --version`)."""
    emit(Version(__version__), json)


@dataclass(frozen=True)
class Version:
    """version's result."""

    version: str

    def to_json(self) -> dict[str, str]:
        return {"version": self.version}


@text_view(Version)
def _version_text(found: Version) -> None:
    sys.stdout.write(f"m31ctl {found.version}\n")


def command_name(argv: list[str]) -> str | None:
    """The command a command line names (its first word that is not an option)."""
    return next((a for a in argv if not a.startswith("-")), None)


def is_quick(argv: list[str]) -> bool:
    """Whether the command line runs one of QUICK_COMMANDS."""
    return command_name(argv) in QUICK_COMMANDS


def build_app(argv: list[str]) -> typer.Typer:
    """The typer app for this command line: the named command only, or every command."""
    app = typer.Typer(
        name="m31ctl",
        help="Serve MiniMax-M3.1-Flash with vLLM: probe, plan, render, launch, doctor.",
        add_completion=True,  # --install-completion / --show-completion for bash, zsh, fish
        no_args_is_help=True,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
    )
    app.callback()(_root)
    first = command_name(argv)
    wanted = [first] if first in COMMANDS or first == "recipes" else [*COMMANDS, "recipes"]
    for name in wanted:
        if name == "recipes":
            app.add_typer(recipes_app, name="recipes")
        elif name == "bench" and _word_after(argv, "bench") == "compare":
            app.add_typer(bench_app, name="bench")
        else:
            app.command(name=name, short_help=SHORT_HELP.get(name))(plan_group(COMMANDS[name]))
    return app


def _word_after(argv: list[str], word: str) -> str | None:
    """The word after `word` on the command line (a sub-command's name), if any."""
    if word not in argv:
        return None
    at = argv.index(word) + 1
    return argv[at] if at < len(argv) else None
