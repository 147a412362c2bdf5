"""Printing: canonical JSON for machines, rich for people (imported only when used); and the
report and lock files the CLI writes."""

from __future__ import annotations

import codecs
import errno
import json
import sys
import unicodedata
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, TextIO, TypeVar

from m31ctl import interrupt
from m31ctl.errors import InputError, OutputError
from m31ctl.redact import redact_data

if TYPE_CHECKING:
    from pathlib import Path


# `m31ctl --quiet`: progress lines (launch's, stop's) are left out; results and errors are not.
QUIET = False


class GuardedStdout:
    """sys.stdout while a command runs, for a standard output that is not what rich expects.

    An output encoding that cannot carry a character (`LC_ALL=C`, `PYTHONIOENCODING=ascii`)
    gets plain ASCII in its place: rich already draws its tables with ASCII boxes there, and
    what it still writes (its ellipsis, U+2026, for a cut cell) and what users typed become one ASCII
    character each, so columns stay aligned. A write that fails is the reader's doing, not a
    bug: a closed descriptor is a reader that left (BrokenPipeError: the quiet exit, as for a
    closed pipe), any other error (a full disk) is OutputError, exit 2, as for an unwritable -o FILE.
    Everything else (isatty, fileno, encoding) is the stream's own."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            try:
                return self.stream.write(text)
            except UnicodeEncodeError:
                encoding = getattr(self.stream, "encoding", None) or "ascii"
                self.stream.write(text.encode(encoding, _PLAIN).decode(encoding))
                return len(text)
        except OSError as exc:
            raise _output_error(exc) from None

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as exc:
            raise _output_error(exc) from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _output_error(exc: OSError) -> Exception:
    if isinstance(exc, BrokenPipeError) or exc.errno == errno.EBADF:
        return BrokenPipeError(exc.errno, exc.strerror)
    return OutputError(f"cannot write to standard output: {exc.strerror or exc}")


# Single characters, so a table keeps its columns: rich's ellipsis, dashes, arrows, quotes.
_PLAIN_CHARS = {
    "\u2026": ".",  # horizontal ellipsis
    "\u2014": "-",  # em dash
    "\u2013": "-",  # en dash
    "\u2192": ">",  # rightwards arrow
    "\u2190": "<",  # leftwards arrow
    "\u00d7": "x",  # multiplication sign
    "\u2018": "'",
    "\u2019": "'",
    "\u201c": '"',
    "\u201d": '"',
}
_PLAIN = "m31ctl-plain"


def _plain(exc: UnicodeError) -> tuple[str, int]:
    """Codec error handler: each character the encoding lacks as one ASCII character (its
    letter without accents where it has one, else '?')."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    out = []
    for char in exc.object[exc.start : exc.end]:
        base = unicodedata.normalize("NFKD", char).encode("ascii", "ignore").decode("ascii")
        out.append(_PLAIN_CHARS.get(char) or (base[:1] if base.isprintable() else "") or "?")
    return "".join(out), exc.end


codecs.register_error(_PLAIN, _plain)


class Result(Protocol):
    """What a command returns for printing: its JSON (`--json`) is `to_json()`, its text is the
    view registered for its type (`text_view`)."""

    def to_json(self) -> Any: ...


R = TypeVar("R")
_TEXT_VIEWS: dict[type, Callable[[Any], None]] = {}


def text_view(kind: type[R]) -> Callable[[Callable[[R], None]], Callable[[R], None]]:
    """Register `fn` as how a `kind` result reads to people (a decorator)."""

    def register(fn: Callable[[R], None]) -> Callable[[R], None]:
        _TEXT_VIEWS[kind] = fn
        return fn

    return register


# --json: every line m31ctl prints on stdout is one envelope (docs/json.md). Its version says
# what a consumer may rely on: additive changes (a new key, a new event, a new command) keep it,
# a breaking one (a key removed, renamed or changing meaning) bumps it.
JSON_VERSION = 1
# The command the envelope names ("plan", "recipes show", "bench compare"): set by cli.main.
COMMAND: str | None = None


def command_name(argv: list[str]) -> str | None:
    """The command an envelope names: the first word that is not an option, and for a group
    (`recipes`, `bench compare`) its subcommand too."""
    words = [(i, a) for i, a in enumerate(argv) if not a.startswith("-")]
    if not words:
        return None
    i, name = words[0]
    after = argv[i + 1] if i + 1 < len(argv) else None
    if (name == "recipes" and after and not after.startswith("-")) or (
        name == "bench" and after == "compare"
    ):
        return f"{name} {after}"
    return name


def envelope(**body: Any) -> dict[str, Any]:
    """{"m31ctl": 1, "command": ..., **body}: a result ({"ok": true, "data"}), an error ({"ok":
    false, "error"}) or an event of a stream ({"event", "data"})."""
    return {"m31ctl": JSON_VERSION, "command": COMMAND, **body}


def result_envelope(data: Any) -> dict[str, Any]:
    return envelope(ok=True, data=data)


def error_envelope(error: dict[str, Any]) -> dict[str, Any]:
    """An M31Error's to_json() under "error", its class name as "type"."""
    fields = dict(error)
    return envelope(ok=False, error={"type": fields.pop("error", None), **fields})


def emit(result: Result, as_json: bool, *, line: bool = False) -> None:
    """The one output path of a command's result: under --json its envelope with `to_json()` as
    data (one compact line with `line`, the last of a JSON Lines stream: launch, bench, pull),
    else its type's text view. Printed whole or not at all: an interruption waits for its end
    (interrupt.deferred)."""
    with interrupt.deferred():
        if as_json:
            (_emit_json_line if line else _emit_json)(result_envelope(result.to_json()))
            return
        view = next((_TEXT_VIEWS[kind] for kind in type(result).__mro__ if kind in _TEXT_VIEWS), None)
        if view is None:  # a command whose view module was not imported: a bug, said as one
            raise TypeError(f"no text view registered for {type(result).__name__}")
        view(result)


def emit_event(kind: str, data: dict[str, Any]) -> None:
    """One event of a JSON Lines stream (launch's phases, pull's progress, bench's points): a line
    {"m31ctl": 1, "command", "event": kind, "data"}; the stream's last line is its result's or
    its error's envelope (the one line with "ok")."""
    _emit_json_line(envelope(event=kind, data=data))


def emit_error(error: dict[str, Any]) -> None:
    """An error under --json: its envelope on one line (the last line of a stream, or the only one)."""
    _emit_json_line(error_envelope(error))


def _emit_json(payload: Any) -> None:
    sys.stdout.write(json.dumps(redact_data(payload), indent=2, sort_keys=True) + "\n")


def json_text(payload: Any) -> str:
    """A saved report (`-o FILE`): the command's data as --json prints it, redacted alike (a report
    quotes the server's answers, which may echo the API key it was sent), without the envelope: a
    report is a document of its own that `bench compare` and other tools read back."""
    return json.dumps(redact_data(payload), indent=2, sort_keys=True) + "\n"


def _emit_json_line(payload: Any) -> None:
    """One compact JSON object on one line (a stream of events: JSON Lines)."""
    with interrupt.deferred():
        sys.stdout.write(json.dumps(redact_data(payload), sort_keys=True, separators=(",", ":")) + "\n")
        sys.stdout.flush()


def console(stderr: bool = False) -> Any:
    from rich.console import Console  # lazy: rich is start-up cost that JSON output never needs

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich exits 1 here; a reader that stopped early (`| head`) is not a failed check, and
            # cli.main maps a closed pipe to exit 0, as for JSON output.
            self.quiet = True
            raise BrokenPipeError

    # The terminal's width, else $COLUMNS, else 80 (rich's own rule, also for pipes and CI logs):
    # tables wrap their cells to fit it, so every view reads in an 80-column terminal.
    return _Console(stderr=stderr, highlight=False)


def table(title: str | None, columns: list[str]) -> Any:
    from rich.table import Table  # lazy: rich, as in console()

    t = Table(title=title, show_header=True, header_style="bold", title_justify="left")
    for name in columns:
        t.add_column(name, overflow="fold")  # narrowed to fit the width: wrapped, never cut with "..."
    return t


def write_file(path: Path, text: str) -> None:
    """A report or lock file, whole or not at all; an unwritable place is bad input (exit 2)."""
    from m31ctl.render.files import write_text_atomic  # lazy: m31ctl.render loads every target

    try:
        with interrupt.deferred():  # whole or not at all: no temporary file left beside it either
            write_text_atomic(path, text)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
