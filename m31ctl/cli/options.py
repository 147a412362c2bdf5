"""Option groups shared by commands (after pdm's cli/options.py): each is declared once here and
used by every command that takes it. Single options are Annotated aliases; the plan group (six
options every planning command takes) is one `plan_options: PlanOptions` parameter, which
`plan_group` spreads into the six options typer reads, in its place."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple

import typer

from m31ctl.errors import InputError, M31Error

if TYPE_CHECKING:
    from m31ctl.plan import PlanRequest

# --- the plan group: which host, recipe, variant, profile and overrides ------------------------
HardwareOpt = Annotated[
    str | None,
    typer.Option(
        "--hardware",
        metavar="SPEC",
        help="Plan for PRODUCTxCOUNT (e.g. b300x4, h200x8, mi355xx8) or cpu instead of probing this host.",
    ),
]
RecipeOpt = Annotated[
    str | None, typer.Option("--recipe", metavar="NAME", help="Use this recipe instead of the probed one.")
]
VariantOpt = Annotated[
    str | None, typer.Option("--variant", metavar="NAME", help="Recipe variant (e.g. aiter on MI355X).")
]
ProfileOpt = Annotated[
    str | None,
    typer.Option("--profile", metavar="NAME", help="latency (the default), throughput or long-context."),
]
FileOpt = Annotated[
    list[Path] | None, typer.Option("-f", "--file", metavar="FILE", help="Override file (YAML); repeatable.")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", metavar="KEY=VALUE", help="key.path=value (JSON allowed); repeatable."),
]
NoValidateOpt = Annotated[
    bool, typer.Option("--no-validate", help="Skip checking the engine argv against vLLM's schema.")
]

# --- output and runtime ------------------------------------------------------------------------
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object for machines.")]
LaunchRuntimeOpt = Annotated[
    str,
    typer.Option(
        "--runtime", metavar="RUNTIME", help="docker (a container) or native (vLLM from a local Python)."
    ),
]
AnyRuntimeOpt = Annotated[
    str | None,
    typer.Option(
        "--runtime",
        metavar="RUNTIME",
        help="Only this runtime (docker or native); default: look in every runtime.",
    ),
]
NameOpt = Annotated[
    str | None, typer.Option("--name", metavar="NAME", help="Which m31ctl server (default: all of ours).")
]
# --- a running server and its engine's benchmark (smoke, verify, bench) -------------------------
UrlOpt = Annotated[
    str | None, typer.Option("--url", metavar="URL", help="Endpoint (default: the running m31ctl server).")
]
BenchPythonOpt = Annotated[
    str | None,
    typer.Option(
        "--bench-python",
        metavar="PYTHON",
        help="A Python with vLLM to run vllm bench serve (needed with --url).",
    ),
]

# --- lock files (m31ctl lock) -------------------------------------------------------------------
LockedOpt = Annotated[
    Path | None,
    typer.Option(
        "--locked",
        metavar="FILE",
        help="Compare with this lock file; drift refuses (exit 4) unless --update-lock.",
    ),
]
# doctor has no --update-lock: there, drift from the lock is a failed check.
DoctorLockedOpt = Annotated[
    Path | None,
    typer.Option(
        "--locked", metavar="FILE", help="Compare with this lock file; drift is a failed check (exit 1)."
    ),
]
UpdateLockOpt = Annotated[
    bool, typer.Option("--update-lock", help="With --locked: rewrite the lock to what resolves now.")
]


# Words kubectl and helm users pass to -o as an output format: here -o is where m31ctl writes.
_FORMAT_WORDS = frozenset({"json", "yaml", "yml", "wide", "name", "table", "text", "jsonpath"})


def not_a_format(value: Path | None) -> Path | None:
    """-o's callback: a bare format word (`render -o json`) is refused rather than written to as
    ./json; a path that happens to be named so is still reachable by its full path."""
    if value is not None and str(value).lower() in _FORMAT_WORDS:
        raise InputError(
            f"-o {value}: -o names the directory or file m31ctl writes, not an output format",
            hint=f"for JSON pass --json; to write to a path named {value}, give its full path",
        )
    return value


# verify's and bench's report and regression options, declared once.
ReportOpt = Annotated[
    Path | None,
    typer.Option("-o", "--output", help="Save the JSON report here.", metavar="FILE", callback=not_a_format),
]
ToleranceOpt = Annotated[float, typer.Option("--tolerance", help="Allowed regression (0.25 = 25%).")]


class PlanOptions(NamedTuple):
    """The plan group's values, handed to a command as one argument (see `plan_group`)."""

    hardware: str | None
    recipe: str | None
    variant: str | None
    profile: str | None
    files: tuple[Path, ...]
    sets: tuple[str, ...]

    @property
    def given(self) -> bool:
        """Whether the command line chose anything (doctor checks the host alone otherwise)."""
        chosen = (self.recipe, self.variant, self.files, self.sets)
        return self.hardware is not None or self.profile is not None or any(chosen)

    def request(self) -> PlanRequest:
        """The values as a request; probes this host unless --hardware."""
        # lazy: the plan's modules, which --help and the commands without a plan never load
        from m31ctl.plan import PlanRequest

        if self.hardware is not None:
            from m31ctl.hardware import simulated  # lazy: as above

            try:
                hw = simulated(self.hardware)
            except InputError as exc:
                raise self._with_a_count_that_fits(exc) from None
        else:
            from m31ctl.probe import detect  # lazy: as above

            hw = detect().hardware
        return PlanRequest(hw, self.recipe, self.variant, self.profile, self.files, self.sets)

    def argv(self) -> list[str]:
        """The options as they were given, for a hint that says which command to run next."""
        from m31ctl.plan.resolve import option_words  # lazy: as in request()

        host = ["--hardware", self.hardware] if self.hardware is not None else []
        return host + option_words(self.recipe, self.variant, self.profile, self.files, self.sets)

    def _with_a_count_that_fits(self, error: Exception) -> Exception:
        """`--hardware h200` (a product without a count): the hint names the smallest host of
        it whose plan fits (h200x8: Hopper's TP8), not a count the plan then refuses."""
        from m31ctl.hardware import PRODUCTS, likely_spec, simulated  # lazy: as in request()

        asked = (self.hardware or "").strip().lower()
        # A misspelt product: the one spelt closest, with the count typed (mi355x8 is mi355xx8).
        product, typed = (asked, None) if asked in PRODUCTS else (likely_spec(asked) or ("", None))
        if not isinstance(error, InputError) or product not in PRODUCTS:
            return error
        # lazy: as in request()
        from m31ctl.deployment import derive, require_fit
        from m31ctl.plan import PlanRequest, resolve

        for count in ((typed,) if typed else ()) + (1, 2, 4, 8):
            spec = f"{product}x{count}"
            request = PlanRequest(
                simulated(spec), self.recipe, self.variant, self.profile, self.files, self.sets
            )
            try:
                require_fit(derive(resolve(request)))
            except M31Error:
                continue
            message = (
                f"--hardware {self.hardware!r} needs a GPU count" if asked == product else str(error.message)
            )
            if count == typed:  # the host typed, its product spelt right
                return InputError(message, hint=f"did you mean {spec}?")
            return InputError(
                message, hint=f"did you mean {spec}, the smallest {product} host this plan fits?"
            )
        return error


# The group's options as typer sees them, in the order --help lists them: (name, type, default).
_PLAN_GROUP: tuple[tuple[str, Any, Any], ...] = (
    ("hardware", HardwareOpt, None),
    ("recipe", RecipeOpt, None),
    ("variant", VariantOpt, None),
    ("profile", ProfileOpt, None),
    ("file", FileOpt, None),
    ("set_", SetOpt, None),
)
PLAN_GROUP_PARAMETER = "plan_options"


def plan_group(command: Callable[..., Any]) -> Callable[..., Any]:
    """The command as typer should see it: its `plan_options: PlanOptions` parameter replaced, in
    place, by the group's options (pdm's option groups: declared once, used by every command that
    plans). Called when a command is registered, so only the invoked command pays for it."""
    if PLAN_GROUP_PARAMETER not in inspect.signature(command).parameters:
        return command
    signature = inspect.signature(command, eval_str=True)  # typer needs the Annotated objects
    parameters: list[inspect.Parameter] = []
    for parameter in signature.parameters.values():
        if parameter.name != PLAN_GROUP_PARAMETER:
            parameters.append(parameter)
            continue
        parameters.extend(
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=kind)
            for name, kind, default in _PLAN_GROUP
        )

    @functools.wraps(command)
    def with_group(**values: Any) -> Any:
        group = {name: values.pop(name) for name, _kind, _default in _PLAN_GROUP}
        options = PlanOptions(
            hardware=group["hardware"],
            recipe=group["recipe"],
            variant=group["variant"],
            profile=group["profile"],
            files=tuple(group["file"] or ()),
            sets=tuple(group["set_"] or ()),
        )
        return command(**values, **{PLAN_GROUP_PARAMETER: options})

    # Every parameter keyword-only: typer passes them by name, and a default may precede none.
    with_group.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in parameters]
    )
    return with_group
