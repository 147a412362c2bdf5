"""Printing: canonical JSON for machines, rich for people (imported only when used); and the
report and lock files the CLI writes."""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path


def emit_json(payload: Any) -> None:
    from m31ctl.redact import redact_data

    sys.stdout.write(json.dumps(redact_data(payload), indent=2, sort_keys=True) + "\n")


def emit_json_line(payload: Any) -> None:
    """One compact JSON object on one line (a stream of events: JSON Lines)."""
    from m31ctl.redact import redact_data

    sys.stdout.write(json.dumps(redact_data(payload), sort_keys=True, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def console(stderr: bool = False) -> Any:
    import shutil

    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich exits 1 here; a reader that stopped early (`| head`) is not a failed check, and
            # cli.main maps a closed pipe to exit 0, as for JSON output.
            self.quiet = True
            raise BrokenPipeError

    # Pipes and CI logs get a wide page rather than rich's 80-column guess.
    width = shutil.get_terminal_size((140, 24)).columns
    return _Console(stderr=stderr, highlight=False, width=max(width, 100))


def table(title: str | None, columns: list[str]) -> Any:
    from rich.table import Table

    t = Table(title=title, show_header=True, header_style="bold", title_justify="left")
    for name in columns:
        t.add_column(name)
    return t


def write_file(path: Path, text: str) -> None:
    """A report or lock file, whole or not at all; an unwritable place is bad input (exit 2)."""
    from m31ctl.errors import InputError
    from m31ctl.render.files import write_text_atomic

    try:
        write_text_atomic(path, text)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
