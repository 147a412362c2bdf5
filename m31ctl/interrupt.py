"""Interruption as a state: Ctrl-C (SIGINT) and SIGTERM (a CI runner's cancel) are recorded, and
the code stops at points of its own choosing.

Python's default SIGINT handler raises KeyboardInterrupt at whatever instruction the main thread
is on: inside a finalizer of urllib3's connection pool that is printed as "Exception ignored in:
<finalize object ...>" with a traceback, and the interrupt is lost; inside a state write it
leaves half a file. Here the handler only records the request. Waits and loops call `check()`
(or wait with `sleep()` / `join()`, which return as soon as a signal arrives) and raise
`Interrupted` there; the unwinding that follows (closing clients, removing throwaway
containers, writing state) runs once.

A step that does not reach a check within GRACE_S (a blocking call into a library: a Docker
API request, a subprocess) is cut where it stands then, as Python's own handler would have cut
it, except inside a finalizer, where an exception would only be printed and lost: the cut waits
until the finalizer has returned.

A command with nothing to clean up (plan, render, doctor without --deep: `command()` names them)
is cut at once instead, at the first signal, except where a cut would leave something half done:
inside a finalizer, a `deferred()` block (printing the result, writing a report) or a file
writer (`_WRITERS`: render's set of files, a --plot); there the cut comes as the block returns.
Its line says what the interruption left (`command()`), not a launch's.

What a further signal does (README's exit-code table, 130):
- while the request waits for the next check, a second one cuts the step at once (again never
  inside a finalizer);
- while cleaning up (after `Interrupted` was raised, or inside `shielded()`), the first further
  one prints "cleaning up; press Ctrl-C again to abandon the cleanup" and the next one exits
  130 at once, leaving what the cleanup had not removed yet.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, TypeVar

# The line a command that starts things (launch, stop, rehearse...) ends an interruption with (cli
# prints it with "m31ctl: error: "); the commands cut at once have their own (AT_ONCE).
INTERRUPTED_LINE = "interrupted; a container being started keeps its labels, and the next launch converges"
_NOTHING_WRITTEN = "interrupted; nothing was written"
# The commands with nothing to clean up, cut at the first signal, and what their interruption left
# (None: no command, `m31ctl --help`). doctor is one without --deep (which runs throwaway containers).
AT_ONCE: dict[str | None, str] = {
    None: _NOTHING_WRITTEN,
    "plan": _NOTHING_WRITTEN,
    "validate": _NOTHING_WRITTEN,
    "recipes": _NOTHING_WRITTEN,
    "probe": _NOTHING_WRITTEN,
    "doctor": _NOTHING_WRITTEN,
    "version": _NOTHING_WRITTEN,
    # files.write is a writer (_WRITERS): a cut waits for the whole set, so it lands before the
    # first file or after the last
    "render": "interrupted; the rendered files were written all or none, never half",
    "lock": "interrupted; the lock file was written whole or not at all",
    "capacity": "interrupted; a --plot file was written whole or not at all",
}
# What an interruption leaves for the commands that wait for their checks (the rest say
# INTERRUPTED_LINE: launch, rehearse and stop start or stop containers).
WAITING: dict[str, str] = {
    "pull": "interrupted; the files downloaded so far are kept: rerun m31ctl pull to continue where it stopped",
    "verify": "interrupted; the server keeps running and no report was written",
    "bench": "interrupted; the server keeps running and no report was written",
    "smoke": "interrupted; the server keeps running",
    "logs": "interrupted; the server keeps running",
    "status": "interrupted; nothing was changed",
    "doctor": "interrupted; its throwaway containers are removed, and nothing else was changed",
}
CLEANUP_NOTICE = "m31ctl: cleaning up; press Ctrl-C again to abandon the cleanup\n"
# The longest a wait sleeps between looks at the request: a signal handler that returns makes
# Python retry the interrupted sleep for its whole remaining time (PEP 475), so waits are sliced.
SLICE_S = 0.05
# How long a recorded request waits for a check before the step in the way is cut.
GRACE_S = 1.0

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The user (or a CI runner) asked m31ctl to stop. A KeyboardInterrupt, so code that already
    cleans up on Ctrl-C (a pull keeping its bytes, a rehearsal removing its containers) does."""


class _State:
    def __init__(self) -> None:
        self.installed = 0
        self.signum: int | None = None  # the recorded request, until a check raises it
        self.raised = False  # Interrupted was raised: the code is unwinding (cleaning up)
        self.shield = 0  # depth of shielded() blocks
        self.during_cleanup = 0  # signals seen while cleaning up
        self.previous: dict[int, Any] = {}
        self.timer = False  # SIGALRM is ours: the grace period's cut is armed with it
        self.at_once = False  # the command is cut at the first signal (AT_ONCE)
        self.line = f"error: {INTERRUPTED_LINE}"  # what follows "m31ctl: " when it is interrupted
        self.defer = 0  # depth of deferred() blocks


_state = _State()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    state = _state
    if state.at_once and state.raised and not state.shield:
        return  # already ending: its one line is being written
    if state.raised or state.shield:
        state.during_cleanup += 1
        if state.during_cleanup == 1:
            _write_stderr(CLEANUP_NOTICE)
            return
        _write_stderr(f"m31ctl: {state.line}\n")
        os._exit(130)
    if state.signum is None:
        state.signum = signum
        if not state.at_once:
            _arm(GRACE_S)
            return
    _cut(frame)  # a second signal before any check took the first (or a command cut at once)


def deliver(signum: int) -> None:
    """A signal recorded before this module was loaded (m31ctl.cli's first statements), handled
    now as if it had just arrived."""
    _on_signal(signum, sys._getframe(1))


def _on_grace_over(_signum: int, frame: FrameType | None) -> None:
    if _state.signum is not None and not _state.raised:
        _cut(frame)


def _cut(frame: FrameType | None) -> None:
    """Raise Interrupted here, unless cleanup or a finalizer runs: then look again shortly."""
    state = _state
    if state.shield or state.defer or _in_finalizer(frame):
        _arm(SLICE_S)
        return
    state.raised = True
    raise Interrupted


def _arm(seconds: float) -> None:
    if _state.timer:
        signal.setitimer(signal.ITIMER_REAL, seconds)


# The standard library's weak-reference machinery: every function in these files that runs
# during a collection is a callback (weakref.finalize's __call__, the remove() callbacks of
# WeakKeyDictionary, WeakValueDictionary and WeakSet); an exception raised in any of them is
# printed as "Exception ignored in" and lost, like one raised in __del__.
_CALLBACK_FILES = ("weakref.py", "_weakrefset.py")
# The import system's own weakref callback: a module lock's `cb` (importlib._bootstrap
# _get_module_lock), run when a lock is collected mid-import. A cut there was printed as
# "Exception ignored in: <function _get_module_lock.<locals>.cb>" and lost (seen under load).
_CALLBACK_FUNCTIONS = (("<frozen importlib._bootstrap>", "cb"),)
# Writers a cut must not land in (a temporary file left beside its target, a set of files half
# written, a PNG cut short): (the file's path ending, the function; None: any function there).
_WRITERS = (
    ("m31ctl/atomic.py", None),
    ("m31ctl/render/files.py", "write"),
    ("m31ctl/render/files.py", "_write_atomic"),
    ("m31ctl/cli/figure.py", "save"),
)


def _in_finalizer(frame: FrameType | None) -> bool:
    """Whether the frame, or one it was called from, is a finalizer or a weakref callback, or a
    file writer (_WRITERS): where a cut would be lost or leave something half written."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__del__" or os.path.basename(code.co_filename) in _CALLBACK_FILES:
            return True
        if (code.co_filename, code.co_name) in _CALLBACK_FUNCTIONS:
            return True
        filename = code.co_filename.replace(os.sep, "/")
        if any(filename.endswith(path) and name in (None, code.co_name) for path, name in _WRITERS):
            return True
        frame = frame.f_back
    return False


def _write_stderr(text: str) -> None:
    """From a signal handler: os.write, never sys.stderr (its buffer may be mid-write)."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode("utf-8", "replace"))


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """Record SIGINT and SIGTERM while the block runs (a command), and restore what was there.
    A signal that whoever started m31ctl set to be ignored (a background job's SIGINT, a
    SIGTERM handler of a caller) is left alone, as is anything off the main thread."""
    install()
    try:
        yield
    finally:
        uninstall()


def install() -> None:
    """Start recording (nested calls count); a fresh request state for the outermost one."""
    state = _state
    if state.installed == 0:
        if threading.current_thread() is not threading.main_thread():
            return
        state.signum, state.raised, state.during_cleanup = None, False, 0
        state.at_once, state.line = False, f"error: {INTERRUPTED_LINE}"  # until command() says
        for sig in _SIGNALS:
            current = signal.getsignal(sig)
            # m31ctl.cli's own first handler (it records until this one takes over) counts as Python's
            if current in (signal.SIG_DFL, signal.default_int_handler) or getattr(
                current, "m31ctl_early", False
            ):
                state.previous[sig] = signal.signal(sig, _on_signal)
        state.timer = signal.getsignal(signal.SIGALRM) == signal.SIG_DFL
        if state.timer:
            state.previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, _on_grace_over)
    state.installed += 1


def uninstall() -> None:
    state = _state
    if state.installed == 0:
        return
    state.installed -= 1
    if state.installed == 0:
        if state.timer:
            signal.setitimer(signal.ITIMER_REAL, 0)
            state.timer = False
        for sig, handler in state.previous.items():
            with contextlib.suppress(ValueError):
                signal.signal(sig, handler)
        state.previous.clear()


def command(argv: list[str]) -> None:
    """Say which command runs (its command line): one in AT_ONCE is cut at the first signal and
    ends with its own line; any other waits for its checks and ends with its own (WAITING) or,
    starting things, a launch's."""
    name = next((a for a in argv if not a.startswith("-")), None)
    at_once = name in AT_ONCE and not (name == "doctor" and "--deep" in argv)
    _state.at_once = at_once
    waiting = WAITING.get(name or "", INTERRUPTED_LINE)
    _state.line = AT_ONCE[name] if at_once else f"error: {waiting}"


def line() -> str:
    """The command's interruption line, without its "m31ctl: " (see command())."""
    return _state.line


def requested() -> bool:
    """Whether a stop was asked for and has not been raised yet."""
    return _state.signum is not None and not _state.raised


def pending() -> bool:
    """Whether a stop was asked for at all in this command (raised or not)."""
    return _state.signum is not None or _state.raised


def check() -> None:
    """Raise Interrupted if a stop was asked for (not inside shielded(): cleanup runs on)."""
    state = _state
    if state.signum is not None and not state.shield and not state.raised:
        state.raised = True
        _arm(0)
        raise Interrupted


def settle() -> None:
    """The command has ended: a request it did not raise is taken as handled (the caller reports
    it), and the grace timer is disarmed, so nothing is cut during the interpreter's exit (and an
    armed SIGALRM does not outlive the handler that Python resets at its exit: killed by -14)."""
    state = _state
    if state.signum is not None:
        state.raised = True
    _arm(0)


def ending() -> None:
    """The command is over: a signal that arrives now is only recorded (as for a command that
    waits for its checks), not raised at once; leaving() then ignores any through the exit."""
    _state.at_once = False


def leaving() -> None:
    """The process is about to exit with its code: the timer is disarmed and further SIGINT and
    SIGTERM ignored for the few milliseconds of the interpreter's teardown (its finalizers run
    then, and Python resets handlers it installed before it is done)."""
    settle()
    if _state.installed and threading.current_thread() is threading.main_thread():
        for sig in _state.previous:
            if sig in _SIGNALS:
                signal.signal(sig, signal.SIG_IGN)


def sleep(seconds: float) -> None:
    """time.sleep that ends as soon as a stop is asked for, then raises it (check())."""
    deadline = time.monotonic() + max(0.0, seconds)
    check()
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or (requested() and not _state.shield):
            break
        time.sleep(min(SLICE_S, left))
    check()


def join(thread: threading.Thread, timeout: float | None = None) -> None:
    """thread.join that raises Interrupted as soon as a stop is asked for (the thread runs on;
    it should be a daemon, or be told to stop by the caller's cleanup)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while thread.is_alive():
        check()
        left = SLICE_S if deadline is None else min(SLICE_S, deadline - time.monotonic())
        if left <= 0:
            return
        thread.join(left)
    check()


T = TypeVar("T")


def call(work: Callable[[], T]) -> T:
    """work() in a daemon thread, the caller waiting with join(): for a blocking read with no
    check of its own (following a container's log stream, quiet for minutes), which a stop
    then leaves where it stands. Its exception, or its result, comes back to the caller."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, work()))
        except BaseException as exc:  # handed to the waiting thread
            box.append((False, exc))

    thread = threading.Thread(target=run, name="m31ctl interruptible call", daemon=True)
    thread.start()
    join(thread)
    ok, value = box[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """Cleanup that must run to its end: check() does not raise inside, and a further signal
    asks first ("press Ctrl-C again to abandon the cleanup"), then exits 130 at once."""
    _state.shield += 1
    try:
        yield
    finally:
        _state.shield -= 1


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A step a cut must not split (a result being printed, a report being written): a signal
    inside is recorded, and a command cut at once is cut as the block returns."""
    state = _state
    state.defer += 1
    try:
        yield
    finally:
        state.defer -= 1
    if state.at_once and state.defer == 0:
        check()


class StoppedAsAsked(Exception):
    """A command whose normal end is Ctrl-C (`logs -f`): exit 130 as `tail -f` does, no error line.
    Here, not in m31ctl/cli/__init__.py: the commands that raise it would import their own package."""
