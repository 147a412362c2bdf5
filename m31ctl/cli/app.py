"""The commands: each parses its options, calls the core once, and prints what it returned."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from m31ctl.cli.options import (
    AnyRuntimeOpt,
    BenchPythonOpt,
    JsonOpt,
    LaunchRuntimeOpt,
    LockedOpt,
    NameOpt,
    NoValidateOpt,
    PlanOptions,
    UpdateLockOpt,
    UrlOpt,
    plan_group,
)
from m31ctl.errors import ExitCode
from m31ctl.resources import LOCK_FILE

if TYPE_CHECKING:
    from m31ctl.deployment import Deployment
    from m31ctl.plan import Plan, PlanRequest
    from m31ctl.runtime import Survey

# Commands by name. build_app() registers only the one a command line names (typer converts every
# registered command's options at start-up, a cost paid on each run), or all of them for help.
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
        from m31ctl import __version__

        sys.stdout.write(f"m31ctl {__version__}\n")
        raise typer.Exit()


def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Serve MiniMax-M3.1-Flash with vLLM: probe, plan, render, launch, doctor."""


recipes_app = typer.Typer(help="List, show and validate recipes.", no_args_is_help=True)


def _resolve(request: PlanRequest) -> Plan:
    from m31ctl.plan import resolve

    return resolve(request)


def _deploy(plan: Plan, validate: bool = True, fit: bool = True) -> Deployment:
    """The plan's one Deployment; with `fit`, refused when the hardware cannot hold its layout
    (exit 6, as launch's preflight); its argv checked against the engine's schema unless --no-validate."""
    from m31ctl.deployment import derive, require_fit

    deployment = derive(plan)
    if fit:
        require_fit(deployment)
    if validate:
        from m31ctl.engine.adapter import build_invocation
        from m31ctl.engine.validate import check_plan_engine

        source = plan.provenance.get("engine.extra_args")
        check_plan_engine(
            build_invocation(deployment),
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
    from m31ctl.cli.locking import apply_lock
    from m31ctl.deployment import derive

    return derive(apply_lock(deployment.plan, request.files, locked, update, by_id=by_id))


@recipes_app.command("list")
def recipes_list(json: JsonOpt = False) -> None:
    """The built-in recipes and what they match."""
    from m31ctl.cli import recipes

    recipes.list_recipes(json)


@recipes_app.command("show")
def recipes_show(name: Annotated[str, typer.Argument(help="Recipe name.")], json: JsonOpt = False) -> None:
    """One recipe: hardware match, hard rules with reasons and sources, variants, profiles."""
    from m31ctl.cli import recipes

    recipes.show(name, json)


@recipes_app.command("validate")
def recipes_validate(
    file: Annotated[Path, typer.Argument(help="Recipe YAML file.")], json: JsonOpt = False
) -> None:
    """Check a recipe file: schema, rules, and every variant x profile resolving."""
    from m31ctl.cli import recipes

    recipes.validate(file, json)


@command
def plan(
    plan_options: PlanOptions,
    json: JsonOpt = False,
    explain: Annotated[bool, typer.Option("--explain", help="Show where every value comes from.")] = False,
    no_validate: NoValidateOpt = False,
) -> None:
    """Resolve the recipe for this host (or --hardware) and print the plan."""
    from m31ctl.capacity.fit import plan_fit

    d = _deploy(_resolve(plan_options.request()), not no_validate)
    fit = plan_fit(d)
    if json:
        from m31ctl.cli.output import emit_json
        from m31ctl.cli.views import plan_json

        emit_json(plan_json(d, fit))
    else:
        from m31ctl.cli.views import print_plan

        print_plan(d, fit, explain)


@command
def probe(json: JsonOpt = False) -> None:
    """Detect this host's GPUs and tell which recipe fits."""
    from m31ctl.cli.views import print_probe, probe_json
    from m31ctl.probe import detect

    report = detect()
    if json:
        from m31ctl.cli.output import emit_json

        emit_json(probe_json(report))
    else:
        print_probe(report)


@command
def capacity(
    plan_options: PlanOptions,
    json: JsonOpt = False,
    context: Annotated[str, typer.Option("--context", help="Context length: 262144, 256k, 1m.")] = "256k",
    sequences: Annotated[
        int | None, typer.Option("--sequences", help="Also report the longest context for N sequences.")
    ] = None,
    plot: Annotated[
        Path | None, typer.Option("--plot", help="Draw sequences against context to this PNG.")
    ] = None,
) -> None:
    """How many sequences stay resident, and how the recipes and cache dtypes compare."""
    from m31ctl.cli import capacity as capacity_view

    d = _deploy(_resolve(plan_options.request()), validate=False)
    capacity_view.run(d, context, sequences, plot, json)


@command
def render(
    target: Annotated[str, typer.Option("--target", help="script | compose | k8s | systemd.")],
    plan_options: PlanOptions,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write into DIR (else print).")
    ] = None,
    check: Annotated[
        Path | None, typer.Option("--check", help="Exit 1 with a diff when DIR is out of date.")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite files that differ.")] = False,
    no_validate: NoValidateOpt = False,
    locked: LockedOpt = None,
    update_lock: UpdateLockOpt = False,
) -> int:
    """Render deployment artifacts (bash script, Compose, Kubernetes, systemd) from the plan."""
    from m31ctl.errors import InputError
    from m31ctl.render import files, get_target

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
    artifacts = renderer(deployment)
    if check is not None:
        drift = files.diff(check, artifacts)
        sys.stdout.write(drift)
        return int(ExitCode.CHECK_FAILED if drift else ExitCode.OK)
    if output is None:
        for artifact in artifacts:
            sys.stdout.write(artifact.content)
        return 0
    for path, state in files.write(output, artifacts, force):
        sys.stderr.write(f"{state}: {path}\n")
    return 0


@command
def lock(
    plan_options: PlanOptions,
    output: Annotated[Path, typer.Option("-o", "--output", help="The lock file to write.")] = Path(LOCK_FILE),
    check: Annotated[
        Path | None, typer.Option("--check", help="Exit 1 with the differences when FILE has drifted.")
    ] = None,
    json: JsonOpt = False,
) -> int:
    """Record the deployment (plan, input files, image digest, hardware) so CI deploys the same one."""
    from m31ctl.cli.locking import compare, current_lock, drift_lines, write_lock

    request = plan_options.request()
    plan = _resolve(request)
    if check is not None:
        _locked, _now, found = compare(check, plan, request.files)
        if json:
            from m31ctl.cli.output import emit_json

            emit_json({"lock": str(check), "drift": [d._asdict() for d in found], "ok": not found})
        elif found:
            sys.stdout.write("\n".join((f"drift from {check}:", *drift_lines(found))) + "\n")
        else:
            sys.stdout.write(f"{check}: no drift\n")
        return int(ExitCode.CHECK_FAILED if found else ExitCode.OK)
    lock_file = current_lock(plan, request.files)
    write_lock(output, lock_file)
    if json:
        from m31ctl.cli.output import emit_json

        emit_json({"lock": str(output), **lock_file.model_dump(mode="json")})
    else:
        image = lock_file.image
        pinned = image.digest or image.id or "not recorded (no Docker Engine, or the image is not here)"
        sys.stderr.write(f"wrote {output}: plan {lock_file.plan_hash}, image {image.reference} -> {pinned}\n")
    return 0


@command
def validate(
    plan_options: PlanOptions,
    json: JsonOpt = False,
) -> int:
    """Check the plan's vLLM argv and environment against vLLM's own schema (no vLLM import)."""
    from m31ctl.cli.views import print_validation
    from m31ctl.engine.validate import validate_plan

    report = validate_plan(_deploy(_resolve(plan_options.request()), validate=False, fit=False))
    print_validation(report, json)
    return int(ExitCode.OK if report.ok else ExitCode.BAD_INPUT)


@command
def doctor(
    plan_options: PlanOptions,
    json: JsonOpt = False,
    locked: LockedOpt = None,
    deep: Annotated[
        bool,
        typer.Option("--deep", help="Also run the engine and an all-reduce on the plan's GPUs (seconds)."),
    ] = False,
    runtime: Annotated[
        str,
        typer.Option("--runtime", help="With --deep: docker (in the engine image) or native (local torch)."),
    ] = "docker",
) -> int:
    """Check that this host can run the plan: Docker, GPUs, drivers, disk, port, image."""
    from m31ctl.cli.views import print_doctor
    from m31ctl.doctor import diagnose, report_json
    from m31ctl.probe import detect

    probe = detect()
    request = None
    if plan_options.given or deep:
        request = plan_options.request()
        if plan_options.hardware is None:
            request = request._replace(hardware=probe.hardware)
    from m31ctl.runtime import get_runtime

    get_runtime(runtime)  # an unknown runtime is bad input
    report = diagnose(request, probe, deep=runtime if deep else None)
    if locked is not None:
        from m31ctl.cli.locking import lock_check

        report = lock_check(report, request.files if request else (), locked)
    if json:
        from m31ctl.cli.output import emit_json

        emit_json(report_json(report))
    else:
        print_doctor(report)
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
    import json as jsonlib
    import os

    from m31ctl import deploy
    from m31ctl.cli import launch_views, pulling
    from m31ctl.errors import InputError
    from m31ctl.runtime import get_runtime
    from m31ctl.runtime.base import LaunchOptions

    get_runtime(runtime)  # an unknown runtime is bad input before anything resolves
    if timeout is not None and not (0 < timeout < float("inf")):
        raise InputError(
            f"--timeout {timeout:g} is not a positive number of seconds", hint="e.g. --timeout 900"
        )
    sets = list(plan_options.sets)
    # Flags are values, not JSON: encode them so `--name true` stays the string "true".
    if name is not None:
        sets.append(f"runtime.container_name={jsonlib.dumps(name)}")
    if port is not None:
        sets.append(f"runtime.port={port}")
    request = plan_options._replace(sets=tuple(sets)).request()
    d = _deploy(_resolve(request), not no_validate)
    if locked is not None:
        d = _pinned(d, request, locked, update_lock, by_id=True)
    if dry_run:
        launch_views.print_dry_run(d, deploy.dry_run(d, runtime), json)
        return 0
    display = launch_views.PhaseDisplay(live=not json)
    options = LaunchOptions(
        report=launch_views.reporter(),
        confirm=launch_views.confirm,
        timeout=timeout,
        detach=detach,
        yes=yes,
        environ=dict(os.environ),
        pull_progress=launch_views.pull_progress(),
        on_phase=launch_views.phase_events() if json else display.on_phase,
    )
    try:
        fetch = None if no_pull else pulling.before_launch(json)
        result = deploy.launch(d, runtime, options, deep=not skip_deep, fetch=fetch)
    finally:
        display.close()
    launch_views.print_result(d, result, json)
    return 0


@command
def status(plan_options: PlanOptions, json: JsonOpt = False, runtime: AnyRuntimeOpt = None) -> int:
    """The servers m31ctl runs, in every runtime: state, plan, endpoint, health; with plan options,
    which settings of each server's recorded plan differ from theirs."""
    from m31ctl.cli import launch_views
    from m31ctl.runtime import compare_plans, survey

    found = survey(runtime)
    differences = None
    if plan_options.given:
        asked = _deploy(_resolve(plan_options.request()), validate=False, fit=False)
        differences = compare_plans(found, asked.plan)
    launch_views.print_status(found, json, differences)
    return _incomplete_exit(found)


@command
def logs(
    name: NameOpt = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines.")] = False,
    tail: Annotated[int, typer.Option("--tail", help="Lines from the end.")] = 100,
    runtime: AnyRuntimeOpt = None,
) -> int:
    """Print a server's log."""
    from m31ctl.cli import launch_views
    from m31ctl.runtime import logs as server_logs

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    found = server_logs(name, runtime, follow, tail, write)
    launch_views.print_unreachable(found)
    return _incomplete_exit(found)


@command
def stop(
    name: NameOpt = None,
    timeout: Annotated[int | None, typer.Option("--timeout", help="Seconds of drain before SIGKILL.")] = None,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the stopped container (and its log).")] = False,
    json: JsonOpt = False,
    runtime: AnyRuntimeOpt = None,
) -> int:
    """Stop our servers (in every runtime, or the named one wherever it runs): SIGTERM, a drain, SIGKILL."""
    from m31ctl.cli import launch_views
    from m31ctl.runtime import stop as stop_servers

    stopped, found = stop_servers(name, runtime, timeout, keep, launch_views.reporter())
    launch_views.print_unreachable(found)
    if json:
        from m31ctl.cli.output import emit_json

        emit_json({"stopped": stopped})
    elif not stopped:
        sys.stderr.write("nothing to stop\n")
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
    from m31ctl.cli.views import print_smoke
    from m31ctl.runtime import running_server
    from m31ctl.runtime import smoke as smoke_test

    if url is None:
        server = running_server(name, runtime)
        url = str(server.endpoint)
        # The model the server was launched to serve (its recorded plan), not merely the first listed.
        model = model or (server.plan.served_model if server.plan else None)
    report = smoke_test.run(url.rstrip("/"), model, max_tokens)
    print_smoke(report, json)
    return int(ExitCode.OK if report.ok else ExitCode.CHECK_FAILED)


@command
def verify(
    plan_options: PlanOptions,
    url: UrlOpt = None,
    name: NameOpt = None,
    runtime: AnyRuntimeOpt = None,
    bench_python: BenchPythonOpt = None,
    no_load: Annotated[bool, typer.Option("--no-load", help="Skip the vllm bench serve run.")] = False,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Save the JSON report here.")] = None,
    baseline: Annotated[
        Path | None, typer.Option("--baseline", help="Fail when worse than this earlier report.")
    ] = None,
    tolerance: Annotated[float, typer.Option("--tolerance", help="Allowed regression (0.25 = 25%).")] = 0.25,
    json: JsonOpt = False,
) -> int:
    """Prove the running server is the plan's: function, served facts, vllm bench serve load, regression."""
    from m31ctl.cli.verifying import run_verify

    def asked() -> Deployment:
        return _deploy(_resolve(plan_options.request()), validate=False, fit=False)

    # Without plan options a server's recorded plan is verified (no probe of this host for one).
    return run_verify(
        asked, plan_options.given,
        url, name, runtime, bench_python, no_load, output, baseline, tolerance, json,
    )  # fmt: skip


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
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Save the JSON report here.")] = None,
    baseline: Annotated[
        Path | None, typer.Option("--baseline", help="Fail when worse than this earlier bench report.")
    ] = None,
    tolerance: Annotated[float, typer.Option("--tolerance", help="Allowed regression (0.25 = 25%).")] = 0.25,
    json: JsonOpt = False,
) -> int:
    """Measure the serving frontier with vllm bench serve and turn it into the plan's operating point."""
    from m31ctl.cli.bench import BenchOptions, run_bench

    options = BenchOptions(
        url, name, runtime, bench_python, concurrency, workload, slo, requests, output_len, seed,
        plot, write_profile, output, baseline, tolerance, json,
    )  # fmt: skip
    return run_bench(_resolve(plan_options.request()), options)


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
    from m31ctl.cli.pulling import run_pull

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
    no_validate: NoValidateOpt = False,
    json: JsonOpt = False,
) -> int:
    """Run the plan's layout and rendered commands for real with vLLM's CPU build (a tiny model,
    Docker containers as nodes), send completions and smoke through the leader, remove it all."""
    from m31ctl.cli.rehearsing import run_rehearse
    from m31ctl.errors import InputError
    from m31ctl.rehearsal.runner import Options

    if timeout <= 0:
        raise InputError(f"--timeout {timeout} is not a positive number of seconds")
    plan = _deploy(_resolve(plan_options.request()), not no_validate).plan
    return run_rehearse(plan, Options(target, keep, timeout, image), json)


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
        add_completion=False,
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
        else:
            app.command(name=name)(plan_group(COMMANDS[name]))
    return app
