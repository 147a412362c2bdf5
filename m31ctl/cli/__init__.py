"""The command line: the only package that parses argv or prints.

`main(argv) -> int` runs one command and returns its exit code (tests call it in-process);
`run()` is the console script. Every error maps to one line and a documented exit code here.
"""

# ruff: noqa: E402  (the imports come after the signal handler: see below)
from __future__ import annotations

# Ctrl-C is m31ctl's from here on (issue 51): the console script's first statements record SIGINT
# (then SIGTERM), before any import that Python's KeyboardInterrupt could land in (`signal` itself
# loads enum). _signal is built in: nothing to import. m31ctl.interrupt takes over in run().
import _signal  # type: ignore[import-not-found]


def _record_early(signum: int, _frame: object) -> None:
    _EARLY.append(signum)


_EARLY: list[int] = []
try:
    _PREVIOUS_SIGINT = _signal.signal(_signal.SIGINT, _record_early)
except ValueError:  # imported off the main thread: not the m31ctl process
    _PREVIOUS_SIGINT = None
if getattr(_PREVIOUS_SIGINT, "m31ctl_launcher", False):
    # bin/m31ctl recorded SIGINT from its first statement: what it caught is ours, and what it
    # took over was Python's own handler.
    _EARLY.extend(_PREVIOUS_SIGINT.signals)
    _PREVIOUS_SIGINT = _signal.default_int_handler

import sys

_record_early.m31ctl_early = True  # type: ignore[attr-defined]  # interrupt.install() replaces it
_ARGV0 = (sys.argv[0] if sys.argv else "").replace("\\", "/")
if _PREVIOUS_SIGINT is not _signal.default_int_handler or not (
    _ARGV0 == "m31ctl" or _ARGV0.endswith(("/m31ctl", "m31ctl/__main__.py"))
):
    # Not the m31ctl process (a program, a test run, imports this package), or SIGINT was not
    # Python's own (ignored in a background job): as it was, and a Ctrl-C meanwhile as it would
    # have been.
    if _PREVIOUS_SIGINT is not None:
        _signal.signal(_signal.SIGINT, _PREVIOUS_SIGINT)
    if _EARLY and _PREVIOUS_SIGINT is _signal.default_int_handler:
        _EARLY.clear()
        raise KeyboardInterrupt
elif _signal.getsignal(_signal.SIGTERM) == _signal.SIG_DFL:
    _signal.signal(_signal.SIGTERM, _record_early)

import contextlib
import fcntl
import gc
import os
from collections.abc import Sequence
from typing import TextIO

from m31ctl import interrupt
from m31ctl.cli import output
from m31ctl.cli.output import GuardedStdout, emit_error
from m31ctl.errors import ExitCode, M31Error, OutputError
from m31ctl.redact import redact

# Commands that compute and print, touching no server: they finish in a fraction of a second.
# Nearly everything they allocate lives to the end (classes, validators, typer's parameters), so
# CPython's cyclic collector, run ~80 times at start-up, frees almost nothing: main() turns it
# off for them, before the app loads (about 10 ms of 0.2 s measured, scripts/bench.py; typer's
# and pydantic's imports included). Commands that wait on servers (launch, logs, verify, ...) keep it.
QUICK_COMMANDS = frozenset({"plan", "render", "capacity", "validate", "lock", "recipes"})


def is_quick(argv: Sequence[str]) -> bool:
    """Whether the command line runs one of QUICK_COMMANDS (its first word that is no option)."""
    return next((a for a in argv if not a.startswith("-")), None) in QUICK_COMMANDS


def main(argv: Sequence[str] | None = None) -> int:
    """Run m31ctl with `argv` (default: sys.argv[1:]) and return the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args:
        args = ["--help"]  # bare `m31ctl`: help, exit 0
    interrupt.install()  # Ctrl-C and SIGTERM are recorded; the command stops at its own checks
    interrupt.command(args)  # ... or at once, for one with nothing to clean up (plan, render)
    output.COMMAND = output.command_name(args)  # what --json's envelopes name (docs/json.md)
    stdout = _standard_streams()
    try:
        if gc.isenabled() and is_quick(args):
            # The cyclic collector only costs these commands time (QUICK_COMMANDS), from before the
            # app (typer, pydantic) loads.
            gc.disable()
            try:
                return _finished(_main(args))
            finally:
                gc.enable()
        return _finished(_main(args))
    except KeyboardInterrupt:  # a command cut at once, outside the command itself (loading the app)
        return _interrupted()
    finally:
        # The command is over (its result out, its code chosen): a signal from here to the exit
        # is recorded, never raised, or it would end in a traceback outside every handler.
        interrupt.ending()
        interrupt.settle()  # idempotent: also when a SystemExit (shell completion) leaves
        interrupt.uninstall()
        sys.stdout = stdout  # the caller's own stream again, not the guard around it


def _finished(code: int) -> int:
    """A stop asked for after the command's last check still ends as an interruption: exit 130
    and the one line, whatever the command had time to finish."""
    late = interrupt.requested()
    interrupt.settle()
    if late and code != ExitCode.INTERRUPTED:
        return _interrupted()
    return code


def _interrupted() -> int:
    """The command's one interruption line (interrupt.command() chose it), exit 130."""
    _stderr(f"m31ctl: {interrupt.line()}\n")
    return int(ExitCode.INTERRUPTED)


def _standard_streams() -> TextIO:
    """Make stdin, stdout and stderr usable, and guard stdout for the command; returns stdout as
    it was. A descriptor closed at start (`>&-`, `<&-`) gets /dev/null in its place: the next file
    m31ctl opens must not take its number (a lock file written through fd 1), and writes go
    nowhere, quietly, as to a reader that left. One open only for reading counts as closed."""
    for fd, name, writes in ((0, "stdin", False), (1, "stdout", True), (2, "stderr", True)):
        stream = getattr(sys, name)
        if stream is not None and _fileno(stream) != fd:
            continue  # redirected within this process (tests, a caller): its own business
        usable = _fd_usable(fd, writes)
        if usable is None:  # closed: hold its number with /dev/null
            with contextlib.suppress(OSError):
                spare = os.open(os.devnull, os.O_RDWR)
                if spare != fd:
                    os.dup2(spare, fd)
                    os.close(spare)
        if stream is None or not usable:
            setattr(sys, name, open(os.devnull, "w" if writes else "r", encoding="utf-8"))  # noqa: SIM115
    original: TextIO = sys.stdout
    sys.stdout = GuardedStdout(original)
    return original


def _fileno(stream: object) -> int | None:
    try:
        return int(stream.fileno())  # type: ignore[attr-defined]
    except (AttributeError, OSError, ValueError):
        return None


def _fd_usable(fd: int, writes: bool) -> bool | None:
    """None when `fd` is closed; else whether it is open the right way round."""
    try:
        mode = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE
    except OSError:
        return None
    return mode != (os.O_RDONLY if writes else os.O_WRONLY)


def _main(args: list[str]) -> int:
    from m31ctl.cli.app import build_app  # lazy: as in main()

    aborts, exits = _click_exceptions()
    as_json = "--json" in args
    try:
        result = build_app(args)(args=args, prog_name="m31ctl", standalone_mode=False)
    except interrupt.StoppedAsAsked:
        return int(ExitCode.INTERRUPTED)
    except OutputError as exc:  # stdout itself failed: the message goes to stderr only
        _silence_stdout()
        return _say(exc.one_line(), exc.exit_code)
    except M31Error as exc:
        if interrupt.pending() and exc.exit_code != ExitCode.INTERRUPTED:
            # What failed after a stop was asked for (a child that got the terminal's Ctrl-C too)
            # failed because of it: the interruption is the one line.
            return _interrupted()
        return _fail(exc, as_json)
    except aborts:
        return _interrupted()
    except exits as exc:
        return int(getattr(exc, "exit_code", 0) or 0)
    except BrokenPipeError:
        _silence_stdout()
        return int(ExitCode.OK)
    except Exception as exc:
        if interrupt.pending():
            return _interrupted()
        if hasattr(exc, "format_message"):  # click's usage errors: unknown option, missing value
            return _say(f"{exc.format_message()} (see m31ctl --help)", ExitCode.BAD_INPUT)
        if os.environ.get("M31CTL_DEBUG"):
            raise
        # A bug: one line for the user, the traceback on request.
        return _say(
            f"internal error: {type(exc).__name__}: {exc} (rerun with M31CTL_DEBUG=1 and report it)",
            ExitCode.INTERNAL,
        )
    if result == ExitCode.INTERRUPTED:  # click turns Ctrl-C during a prompt into exit code 130
        return _interrupted()
    return result if isinstance(result, int) else 0


def _click_exceptions() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(abort, exit) classes: typer's own (typer >= 0.20 vendors click and uses them throughout),
    plus click's where an older typer runs on click itself."""
    import typer  # lazy: loaded with the app, as in main()

    aborts: list[type[BaseException]] = [KeyboardInterrupt, typer.Abort]
    exits: list[type[BaseException]] = [typer.Exit]
    if "click" in sys.modules:  # an older typer imported it; a newer one never loads it
        from click import exceptions as click_exceptions  # optional: only where typer loaded it

        aborts.append(click_exceptions.Abort)
        exits.append(click_exceptions.Exit)
    return tuple(aborts), tuple(exits)


def _fail(exc: M31Error, as_json: bool) -> int:
    if as_json:
        # Its envelope on one line (docs/json.md), as every event and a stream's result is: a
        # consumer of launch's (or pull's, or bench's) JSON Lines reads an error with the same
        # `json.loads(line)`, and tells it by "ok": false.
        try:
            emit_error(exc.to_json())
        except (BrokenPipeError, OutputError):  # the exit code and stderr still tell
            _silence_stdout()
    for line in exc.details:
        _stderr(_fitted(f"m31ctl: {redact(line)}") + "\n")
    return _say(exc.one_line(), exc.exit_code)


def _say(message: str, code: int) -> int:
    _stderr(_fitted(f"m31ctl: error: {redact(message)}") + "\n")
    return int(code)


def _fitted(line: str) -> str:
    """The error line as a terminal shows it: wrapped at its width between phrases, continuation
    lines indented, a setting, a path or a `--set k=v` never split (m31ctl.cli.screen). Piped or
    redirected (CI logs, grep) it stays one line."""
    from m31ctl.cli.screen import for_stderr  # lazy: as the app, after interrupt.install()

    return for_stderr(line)


def _stderr(text: str) -> None:
    """Write to stderr if there is one: a closed stderr (`2>&-`) must not change the exit code."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):
        pass


def _silence_stdout() -> None:
    """After a closed pipe, point stdout at /dev/null so Python's exit flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def run() -> None:
    """The console script (and `python -m m31ctl`). SIGTERM is handled as Ctrl-C (CI runners
    send it on cancel), and both stay recorded, never raised, through the interpreter's exit:
    a finalizer that runs then must not be interrupted half-way (m31ctl.interrupt). A signal
    recorded by this module's first statements is handled as soon as m31ctl.interrupt is in place."""
    started = False
    quick = True
    _without_pydantic_plugins()
    try:
        interrupt.install()
        interrupt.command(sys.argv[1:] or ["--help"])
        for signum in _EARLY[:1]:
            interrupt.deliver(signum)  # a command cut at once stops here
        quick = is_quick(sys.argv[1:])
        started = True
        code = main()
    except KeyboardInterrupt:  # cut before main() began: nothing was started, nothing written
        code = _interrupted()
    interrupt.leaving()
    if quick or not started:
        _leave_now(code)
    sys.exit(code)


# pydantic's plugin loader, which m31ctl stands in for (see _without_pydantic_plugins).
_PYDANTIC_PLUGIN_LOADER = "pydantic.plugin._loader"


def _without_pydantic_plugins() -> None:
    """The m31ctl process runs no pydantic plugins (observability hooks around every validation,
    found through installed packages' entry points, that m31ctl neither needs nor asks for). Their
    loader imports importlib.metadata (email, zipfile, csv, ...) and scans every installed
    distribution's entry points the first time a model is built: 15-20 ms on every command that
    plans, a third of what m31ctl adds to typer and pydantic (scripts/bench.py). Here the loader
    answers "no plugins" without that; any other name pydantic asks of it loads the real one."""
    if _PYDANTIC_PLUGIN_LOADER in sys.modules:  # loaded already (a program that imported pydantic)
        return
    import types  # lazy: the console script's alone (main() never stands in for the loader)

    loader = types.ModuleType(_PYDANTIC_PLUGIN_LOADER, "m31ctl's stand-in: no pydantic plugins")

    def get_plugins() -> tuple[()]:
        return ()

    def real(name: str) -> object:
        if name.startswith("__"):  # the import system's own questions (__path__): a plain module
            raise AttributeError(name)
        import importlib  # lazy: only where pydantic asks the loader for more than get_plugins

        del sys.modules[_PYDANTIC_PLUGIN_LOADER]
        return getattr(importlib.import_module(_PYDANTIC_PLUGIN_LOADER), name)

    loader.get_plugins = get_plugins  # type: ignore[attr-defined]
    loader.__getattr__ = real  # type: ignore[method-assign]
    sys.modules[_PYDANTIC_PLUGIN_LOADER] = loader


def _leave_now(code: int) -> None:
    """Exit without the interpreter's teardown, which frees every module, class and validator one
    by one and collects once more: about 25 ms, longer than a quick command's own work beyond
    typer and pydantic (scripts/bench.py). A quick command has nothing teardown would finish: no
    threads, no child processes, every file it wrote closed and renamed into place. Only stdout
    and stderr may hold buffered text, so they are flushed first."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BrokenPipeError:
            _silence_stdout()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(code)
