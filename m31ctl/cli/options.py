"""Option groups shared by commands (after pdm's cli/options.py): each is declared once here and
used by every command that takes it. Typer declares options per function, so a group is a set
of Annotated aliases plus the function that turns their values into core data."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from m31ctl.plan import PlanRequest

# --- the plan group: which host, recipe, variant, profile and overrides ------------------------
HardwareOpt = Annotated[
    str | None,
    typer.Option(
        "--hardware",
        help="Plan for PRODUCTxCOUNT (e.g. b300x4, h200x8, mi355xx8) or cpu instead of probing this host.",
    ),
]
RecipeOpt = Annotated[str | None, typer.Option("--recipe", help="Use this recipe instead of the probed one.")]
VariantOpt = Annotated[str | None, typer.Option("--variant", help="Recipe variant (e.g. aiter on MI355X).")]
ProfileOpt = Annotated[str, typer.Option("--profile", help="latency | throughput | long-context.")]
FileOpt = Annotated[list[Path] | None, typer.Option("-f", "--file", help="Override file (YAML); repeatable.")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="key.path=value (JSON allowed); repeatable.")]
NoValidateOpt = Annotated[
    bool, typer.Option("--no-validate", help="Skip checking the engine argv against vLLM's schema.")
]

# --- output and runtime ------------------------------------------------------------------------
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object for machines.")]
LaunchRuntimeOpt = Annotated[
    str, typer.Option("--runtime", help="docker (a container) or native (vLLM from a local Python).")
]
AnyRuntimeOpt = Annotated[
    str | None,
    typer.Option("--runtime", help="Only this runtime (docker or native); default: look in every runtime."),
]
NameOpt = Annotated[str | None, typer.Option("--name", help="Which m31ctl server (default: all of ours).")]

# --- lock files (m31ctl lock) -------------------------------------------------------------------
LockedOpt = Annotated[
    Path | None,
    typer.Option(
        "--locked", help="Compare with this lock file; drift refuses (exit 4) unless --update-lock."
    ),
]
UpdateLockOpt = Annotated[
    bool, typer.Option("--update-lock", help="With --locked: rewrite the lock to what resolves now.")
]


def plan_request(
    hardware: str | None,
    recipe: str | None,
    variant: str | None,
    profile: str,
    files: list[Path] | None,
    sets: list[str] | None,
) -> PlanRequest:
    """The plan group's values as a request; probes this host unless --hardware."""
    from m31ctl.plan import PlanRequest

    if hardware is not None:
        from m31ctl.hardware import simulated

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
