"""The command line's app: the root options, the command table, and build_app(argv), which
registers the one command a command line names. The commands themselves are declared by area in
plan_commands.py, server_commands.py and measure_commands.py: each parses its options, calls one
function below cli/ and prints what it returned."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Annotated

import typer

from m31ctl import __version__
from m31ctl.cli import output
from m31ctl.cli.options import plan_group

# Commands by name, filled by @command as a command's module loads. build_app() registers only
# the one a command line names (typer converts every registered command's options at start-up, a
# cost paid on each run), or all of them for help.
COMMANDS: dict[str, Callable[..., object]] = {}

# The module that declares each command, in `m31ctl --help`'s order: build_app() imports only the
# named command's (importing them all would cost every command the sum), and each command imports
# its own modules in its body (a Docker client, the hub, doctor's checks) where --help takes 0.1 s.
_PLAN, _SERVER, _MEASURE = (
    "m31ctl.cli.plan_commands",
    "m31ctl.cli.server_commands",
    "m31ctl.cli.measure_commands",
)
COMMAND_MODULES = {
    **dict.fromkeys(("plan", "probe", "capacity", "render", "lock", "validate"), _PLAN),
    **dict.fromkeys(("doctor", "launch", "status", "logs", "stop"), _SERVER),
    **dict.fromkeys(("smoke", "verify", "bench", "pull", "rehearse"), _MEASURE),
    "version": _PLAN,
    "recipes": _PLAN,  # a group: plan_commands.recipes_app
}


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


def short_help(fn: Callable[..., object]) -> str | None:
    """A command's line in `m31ctl --help`: its docstring's first line (help from one place). Click
    would cut the docstring's first sentence at the terminal's width with "...", so each command's
    first line says what it does in words that fit 80 columns (tests/cli/test_first_hour.py)."""
    return (fn.__doc__ or "").strip().split("\n", 1)[0] or None


def command_name(argv: list[str]) -> str | None:
    """The command a command line names (its first word that is not an option)."""
    return next((a for a in argv if not a.startswith("-")), None)


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
    wanted = [first] if first in COMMAND_MODULES else list(COMMAND_MODULES)
    for name in wanted:
        if name == "recipes":
            app.add_typer(importlib.import_module(COMMAND_MODULES[name]).recipes_app, name="recipes")
        elif name == "bench" and _word_after(argv, "bench") == "compare":
            app.add_typer(importlib.import_module(COMMAND_MODULES[name]).bench_app, name="bench")
        else:
            if name not in COMMANDS:  # its module not loaded yet (a test may stand in for a command)
                importlib.import_module(COMMAND_MODULES[name])
            app.command(name=name, short_help=short_help(COMMANDS[name]))(plan_group(COMMANDS[name]))
    return app


def _word_after(argv: list[str], word: str) -> str | None:
    """The word after `word` on the command line (a sub-command's name), if any."""
    if word not in argv:
        return None
    at = argv.index(word) + 1
    return argv[at] if at < len(argv) else None
