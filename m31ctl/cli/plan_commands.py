"""The commands that plan and write files, touching no server: plan, probe, capacity, render,
lock, validate, recipes, version. Each parses its options, calls one function below cli/ and prints
what it returned."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Annotated

import typer

from m31ctl import __version__
from m31ctl.cli.app import command
from m31ctl.cli.options import (
    JsonOpt,
    LockedOpt,
    NoValidateOpt,
    PlanOptions,
    UpdateLockOpt,
    not_a_format,
)
from m31ctl.cli.output import emit, text_view
from m31ctl.cli.screen import for_stderr
from m31ctl.commands import Version
from m31ctl.errors import ConflictError, ExitCode, InputError
from m31ctl.resources import LOCK_FILE

recipes_app = typer.Typer(help="List, show and validate recipes.", no_args_is_help=True)


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
    """Resolve the recipe for this host and print the plan.

    With --hardware, the plan for that hardware instead of this host's."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.capacity.fit import plan_fit
    from m31ctl.cli.views import PlanShown
    from m31ctl.commands import deployment

    d = deployment(plan_options.request(), not no_validate)
    emit(PlanShown(d, plan_fit(d), explain, brief=brief and not explain), json)


@command
def probe(json: JsonOpt = False) -> None:
    """Detect this host's GPUs and the recipe that fits."""
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
    """Resident sequences and the longest context the plan holds.

    How many sequences stay resident, and how the recipes and cache dtypes compare."""
    from m31ctl.cli import (
        capacity as capacity_view,  # lazy: only the command run loads its modules (COMMANDS)
    )
    from m31ctl.commands import deployment  # lazy: only the command run loads its modules (COMMANDS)

    d = deployment(plan_options.request(), validate=False)
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
    """Write deployment files: script, compose, k8s, systemd.

    Render deployment artifacts (bash script, Compose, Kubernetes, systemd) from the plan."""
    # lazy: only the command run loads its modules (COMMANDS), the lock's only with --locked
    from m31ctl.commands import deployment
    from m31ctl.render import files, get_target
    from m31ctl.revision import pin_checkpoint
    from m31ctl.timeline import conflicts

    if check is not None and output is not None:
        raise InputError(
            "--check and -o/--output exclude each other", hint="--check DIR compares; -o DIR writes"
        )
    renderer = get_target(target)
    request = plan_options.request()
    d = deployment(request, not no_validate)
    if locked is not None:
        # The lock applied: drift refused (exit 4) unless --update-lock, the image pinned (the argv
        # was checked before: the schema is the image tag's). Rendered files pin a registry digest
        # only: a local image ID means nothing elsewhere.
        from m31ctl.cli.locking import apply_lock

        d = apply_lock(d, request.files, locked, update_lock, by_id=False)
    d, unpinned = pin_checkpoint(d, target, locked, revision)
    if unpinned is not None:
        sys.stderr.write(for_stderr(f"m31ctl: warning: {unpinned}") + "\n")
    for conflict in conflicts(d.timeline, dict(d.plan.settings.runtime.env)):
        sys.stderr.write(for_stderr(f"m31ctl: warning: {conflict.message}") + "\n")
    artifacts = renderer(d)
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
    """Record the deployment so CI deploys the same one.

    The lock holds the plan, its input files, the image digest and the hardware."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.cli.locking import check_lock, write_current
    from m31ctl.commands import deployment

    request = plan_options.request()
    d = deployment(request, validate=False, fit=False)
    if check is not None:
        checked = check_lock(check, d, request.files)
        emit(checked, json)
        return int(ExitCode.CHECK_FAILED if checked.drift else ExitCode.OK)
    emit(write_current(output, d, request.files), json)
    return 0


@command
def validate(
    plan_options: PlanOptions,
    json: JsonOpt = False,
) -> int:
    """Check the plan's vLLM argv against vLLM's schema.

    The argv and the environment, against vLLM's own schema (no vLLM import)."""
    from m31ctl.cli import views  # noqa: F401  (lazy, as above: the validation's text view)
    from m31ctl.commands import deployment  # lazy: only the command run loads its modules
    from m31ctl.engine.validate import validate_plan  # lazy: as above

    report = validate_plan(deployment(plan_options.request(), validate=False, fit=False))
    emit(report, json)
    return int(ExitCode.OK if report.ok else ExitCode.BAD_INPUT)


@command
def version(json: JsonOpt = False) -> None:
    """Print m31ctl's version.

    As `m31ctl --version`."""
    emit(Version(__version__), json)


@text_view(Version)
def _version_text(found: Version) -> None:
    sys.stdout.write(f"m31ctl {found.version}\n")
