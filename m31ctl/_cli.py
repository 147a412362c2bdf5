"""The command line: each command parses, calls the core once, and prints.

Errors from every command map to exit codes in one place: `main()`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from m31ctl.errors import ExitCode, M31Error

if TYPE_CHECKING:
    from m31ctl.plan import Plan, PlanRequest

app = typer.Typer(
    name="m31ctl",
    help="Serve MiniMax-M3.1-Flash with vLLM: probe, plan, render, launch, doctor.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        from m31ctl import __version__

        sys.stdout.write(f"m31ctl {__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Serve MiniMax-M3.1-Flash with vLLM: probe, plan, render, launch, doctor."""


recipes_app = typer.Typer(help="List, show and validate recipes.", no_args_is_help=True)
app.add_typer(recipes_app, name="recipes")

HardwareOpt = Annotated[
    str | None,
    typer.Option(
        "--hardware",
        help="Plan for PRODUCTxCOUNT (e.g. b300x4, h200x8, mi355xx8) instead of probing this host.",
    ),
]
RecipeOpt = Annotated[str | None, typer.Option("--recipe", help="Use this recipe instead of the probed one.")]
VariantOpt = Annotated[str | None, typer.Option("--variant", help="Recipe variant (e.g. aiter on MI355X).")]
ProfileOpt = Annotated[str, typer.Option("--profile", help="latency | throughput | long-context.")]
FileOpt = Annotated[list[Path] | None, typer.Option("-f", "--file", help="Override file (YAML); repeatable.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="key.path=value (JSON allowed); repeatable.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object for machines.")]
RuntimeOpt = Annotated[
    str, typer.Option("--runtime", help="docker (a container) or native (vLLM from a local Python).")
]
NoValidateOpt = Annotated[
    bool, typer.Option("--no-validate", help="Skip checking the engine argv against vLLM's schema.")
]


def _request(
    hardware: str | None,
    recipe: str | None,
    variant: str | None,
    profile: str,
    files: list[Path] | None,
    sets: list[str] | None,
) -> PlanRequest:
    """The plan options every plan-consuming command shares; probes unless --hardware."""
    from m31ctl.hardware import simulated
    from m31ctl.plan import PlanRequest

    if hardware:
        hw = simulated(hardware)
    else:
        from m31ctl.probe import detect

        hw = detect().hardware
    return PlanRequest(
        hardware=hw,
        recipe=recipe,
        variant=variant,
        profile=profile,
        files=tuple(files or ()),
        sets=tuple(sets or ()),
    )


def _resolve(
    hardware: str | None,
    recipe: str | None,
    variant: str | None,
    profile: str,
    files: list[Path] | None,
    sets: list[str] | None,
    validate: bool = True,
) -> Plan:
    from m31ctl.plan import resolve

    plan = resolve(_request(hardware, recipe, variant, profile, files, sets))
    if validate:
        from m31ctl.engine.adapter import build_invocation
        from m31ctl.engine.validate import check_plan_engine

        source = plan.provenance.get("engine.extra_args")
        check_plan_engine(
            build_invocation(plan),
            plan.settings.engine.schema_version,
            plan.settings.engine.extra_args,
            str(source) if source else None,
        )
    return plan


@recipes_app.command("list")
def recipes_list(json: JsonOpt = False) -> None:
    """The built-in recipes and what they match."""
    from m31ctl import recipes_cmd

    recipes_cmd.list_recipes(json)


@recipes_app.command("show")
def recipes_show(name: Annotated[str, typer.Argument(help="Recipe name.")], json: JsonOpt = False) -> None:
    """One recipe: hardware match, hard rules with reasons, variants, profiles."""
    from m31ctl import recipes_cmd

    recipes_cmd.show(name, json)


@recipes_app.command("validate")
def recipes_validate(
    file: Annotated[Path, typer.Argument(help="Recipe YAML file.")], json: JsonOpt = False
) -> None:
    """Check a recipe file: schema, rules, and every variant x profile resolving."""
    from m31ctl import recipes_cmd

    recipes_cmd.validate(file, json)


@app.command()
def plan(
    hardware: HardwareOpt = None,
    recipe: RecipeOpt = None,
    variant: VariantOpt = None,
    profile: ProfileOpt = "latency",
    file: FileOpt = None,
    set_: SetOpt = None,
    json: JsonOpt = False,
    explain: Annotated[bool, typer.Option("--explain", help="Show where every value comes from.")] = False,
    no_validate: NoValidateOpt = False,
) -> None:
    """Resolve the recipe for this host (or --hardware) and print the plan."""
    from m31ctl.planning import plan_fit

    p = _resolve(hardware, recipe, variant, profile, file, set_, not no_validate)
    fit = plan_fit(p)
    if json:
        from m31ctl.output import emit_json
        from m31ctl.views import plan_json

        emit_json(plan_json(p, fit))
    else:
        from m31ctl.views import print_plan

        print_plan(p, fit, explain)


@app.command()
def probe(json: JsonOpt = False) -> None:
    """Detect this host's GPUs and tell which recipe fits."""
    from m31ctl.probe import detect
    from m31ctl.recipes import select_recipe

    report = detect()
    try:
        recipe = select_recipe(report.hardware)
        needed = recipe.match.min_gpus
        fits = report.hardware.count >= needed
        recipe_line = f"{recipe.recipe} ({recipe.description})" + (
            "" if fits else f"; needs {needed} GPUs, this host has {report.hardware.count}"
        )
        recipe_json: dict[str, object] = {"name": recipe.recipe, "min_gpus": needed, "enough_gpus": fits}
    except M31Error as exc:
        recipe_line = exc.one_line()
        recipe_json = {"name": None, "reason": exc.message}
    if json:
        from m31ctl.output import emit_json
        from m31ctl.views import hardware_json

        emit_json(
            {
                "hardware": hardware_json(report.hardware),
                "recipe": recipe_json,
                "visible_devices_from": report.visibility,
                "attempts": [{"method": a.method, "ok": a.ok, "detail": a.detail} for a in report.attempts],
            }
        )
    else:
        from m31ctl.views import print_probe

        print_probe(report, recipe_line)


@app.command()
def capacity(
    hardware: HardwareOpt = None,
    recipe: RecipeOpt = None,
    variant: VariantOpt = None,
    profile: ProfileOpt = "latency",
    file: FileOpt = None,
    set_: SetOpt = None,
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
    from m31ctl import capacity_cmd

    p = _resolve(hardware, recipe, variant, profile, file, set_)
    capacity_cmd.run(p, context, sequences, plot, json)


@app.command()
def render(
    target: Annotated[str, typer.Option("--target", help="script | compose | k8s | systemd.")],
    hardware: HardwareOpt = None,
    recipe: RecipeOpt = None,
    variant: VariantOpt = None,
    profile: ProfileOpt = "latency",
    file: FileOpt = None,
    set_: SetOpt = None,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write into DIR (else print).")
    ] = None,
    check: Annotated[
        Path | None, typer.Option("--check", help="Exit 1 with a diff when DIR is out of date.")
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Overwrite files that differ.")] = False,
    no_validate: NoValidateOpt = False,
) -> int:
    """Render deployment artifacts (bash script, Compose, Kubernetes, systemd) from the plan."""
    from m31ctl.errors import InputError
    from m31ctl.render import files
    from m31ctl.render.targets import TARGETS
    from m31ctl.render.targets import render as render_target

    if target not in TARGETS:
        raise InputError(f"unknown --target {target!r}", hint=f"choose one of: {', '.join(TARGETS)}")
    artifacts = render_target(
        _resolve(hardware, recipe, variant, profile, file, set_, not no_validate), target
    )
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


@app.command()
def validate(
    hardware: HardwareOpt = None,
    recipe: RecipeOpt = None,
    variant: VariantOpt = None,
    profile: ProfileOpt = "latency",
    file: FileOpt = None,
    set_: SetOpt = None,
    json: JsonOpt = False,
) -> int:
    """Check the plan's vLLM argv and environment against vLLM's own schema (no vLLM import)."""
    from m31ctl.engine.validate import report_plan

    plan = _resolve(hardware, recipe, variant, profile, file, set_, False)
    return int(ExitCode.OK if report_plan(plan, json) else ExitCode.BAD_INPUT)


@app.command()
def doctor(
    hardware: HardwareOpt = None,
    recipe: RecipeOpt = None,
    variant: VariantOpt = None,
    profile: ProfileOpt = "latency",
    file: FileOpt = None,
    set_: SetOpt = None,
    json: JsonOpt = False,
) -> int:
    """Check that this host can run the plan: Docker, GPUs, drivers, disk, port, image."""
    from m31ctl.doctor import diagnose, print_report, report_json
    from m31ctl.probe import detect

    probe = detect()
    request = None
    if hardware or recipe or variant or file or set_ or profile != "latency":
        request = _request(hardware, recipe, variant, profile, file, set_)
        if not hardware:
            request = replace(request, hardware=probe.hardware)
    report = diagnose(request, probe)
    if json:
        from m31ctl.output import emit_json

        emit_json(report_json(report))
    else:
        print_report(report)
    return int(ExitCode.CHECK_FAILED if report.failed else ExitCode.OK)


@app.command()
def launch(
    hardware: HardwareOpt = None,
    recipe: RecipeOpt = None,
    variant: VariantOpt = None,
    profile: ProfileOpt = "latency",
    file: FileOpt = None,
    set_: SetOpt = None,
    json: JsonOpt = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the plan and container spec; start nothing.")
    ] = False,
    detach: Annotated[
        bool, typer.Option("--detach", help="Return once started; do not wait for readiness.")
    ] = False,
    timeout: Annotated[float | None, typer.Option("--timeout", help="Seconds to wait for readiness.")] = None,
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Replace a container running another plan.")
    ] = False,
    name: Annotated[str | None, typer.Option("--name", help="Container name.")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Host port.")] = None,
    runtime: RuntimeOpt = "docker",
    no_validate: NoValidateOpt = False,
) -> int:
    """Resolve, check, pull, start the serving container and wait until the model answers."""
    from m31ctl import runtimes

    runtimes.check(runtime)
    sets = list(set_ or [])
    if name:
        sets.append(f"runtime.container_name={name}")
    if port:
        sets.append(f"runtime.port={port}")
    p = _resolve(hardware, recipe, variant, profile, file, sets, not no_validate)
    if dry_run:
        from m31ctl import launch_views

        launch_views.print_dry_run(p, json, runtime)
        return 0
    from m31ctl import launch_views

    result = runtimes.launch(
        runtime,
        p,
        timeout=timeout,
        detach=detach,
        yes=yes,
        confirm=launch_views.confirm,
        report=launch_views.reporter(json),
    )
    launch_views.print_result(p, result, json)
    return 0


@app.command()
def status(json: JsonOpt = False, runtime: RuntimeOpt = "docker") -> None:
    """The servers m31ctl runs: state, plan, endpoint, health."""
    from m31ctl import launch_views, runtimes

    runtimes.check(runtime)
    launch_views.print_status(runtimes.servers(runtime), json)


@app.command()
def logs(
    name: Annotated[str | None, typer.Option("--name", help="Container (default: all of ours).")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new lines.")] = False,
    tail: Annotated[int, typer.Option("--tail", help="Lines from the end.")] = 100,
    runtime: RuntimeOpt = "docker",
) -> None:
    """Print the server's log."""
    from m31ctl import runtimes

    runtimes.check(runtime)
    runtimes.logs(runtime, name, follow, tail)


@app.command()
def stop(
    name: Annotated[str | None, typer.Option("--name", help="Container (default: all of ours).")] = None,
    timeout: Annotated[int | None, typer.Option("--timeout", help="Seconds of drain before SIGKILL.")] = None,
    keep: Annotated[bool, typer.Option("--keep", help="Keep the stopped container (and its log).")] = False,
    json: JsonOpt = False,
    runtime: RuntimeOpt = "docker",
) -> None:
    """Stop our servers: SIGTERM and a drain, then SIGKILL."""
    from m31ctl import launch_views, runtimes

    runtimes.check(runtime)
    stopped = runtimes.stop(runtime, name, timeout, keep, launch_views.reporter(json))
    if json:
        from m31ctl.output import emit_json

        emit_json({"stopped": stopped})
    elif not stopped:
        sys.stderr.write("nothing to stop\n")


INTERRUPTED = "interrupted; a container being started keeps its labels, and the next launch converges"


def _cli_exception_types() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(abort, exit) classes: typer >= 0.20 vendors click, older typer uses click itself."""
    aborts: list[type[BaseException]] = [KeyboardInterrupt, typer.Abort]
    exits: list[type[BaseException]] = [typer.Exit]
    try:
        import click

        aborts.append(click.exceptions.Abort)
        exits.append(click.exceptions.Exit)
    except ImportError:
        pass
    return tuple(aborts), tuple(exits)


@app.command()
def smoke(
    url: Annotated[
        str | None, typer.Option("--url", help="Endpoint (default: the running m31ctl server).")
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="Which m31ctl server.")] = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Served model name (default: the first).")
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens to generate.")] = 16,
    runtime: RuntimeOpt = "docker",
    json: JsonOpt = False,
) -> int:
    """Send a chat completion and a streamed one; check their shape; measure TTFT and tokens/s."""
    from m31ctl import runtimes
    from m31ctl import smoke as smoke_test

    runtimes.check(runtime)
    base = url or runtimes.running_endpoint(runtime, name)
    report = smoke_test.run(base.rstrip("/"), model, max_tokens)
    smoke_test.print_report(report, json)
    return int(ExitCode.OK if report.ok else ExitCode.CHECK_FAILED)


def main() -> None:
    """Entry point: run the app and map every error to one line and an exit code."""
    if len(sys.argv) == 1:
        sys.argv.append("--help")  # bare `m31ctl`: help, exit 0
    as_json = "--json" in sys.argv[1:]
    aborts, exits = _cli_exception_types()
    try:
        result = app(standalone_mode=False)
    except M31Error as exc:
        _fail(exc.one_line(), int(exc.exit_code), exc.to_json() if as_json else None)
    except aborts:
        _fail(INTERRUPTED, int(ExitCode.INTERRUPTED), None)
    except exits as exc:
        sys.exit(int(getattr(exc, "exit_code", 0) or 0))
    except BrokenPipeError:
        sys.exit(0)
    except Exception as exc:
        if hasattr(exc, "format_message"):  # click's usage errors: unknown option, missing value
            _fail(f"{exc.format_message()} (see m31ctl --help)", int(ExitCode.BAD_INPUT), None)
        if os.environ.get("M31CTL_DEBUG"):
            raise
        # A bug: one line for the user, the traceback on request.
        _fail(
            f"internal error: {type(exc).__name__}: {exc} (rerun with M31CTL_DEBUG=1 and report it)",
            int(ExitCode.INTERNAL),
            None,
        )
    if result == ExitCode.INTERRUPTED:  # typer turns Ctrl-C into a plain exit code 130
        _fail(INTERRUPTED, int(ExitCode.INTERRUPTED), None)
    sys.exit(result if isinstance(result, int) else 0)


def _fail(message: str, code: int, payload: dict[str, object] | None) -> None:
    if payload is not None:
        from m31ctl.output import emit_json

        emit_json(payload)
    sys.stderr.write(f"m31ctl: error: {message}\n")
    sys.exit(code)
