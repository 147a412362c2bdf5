"""Printing: canonical JSON for machines, rich for people (imported only when used)."""

from __future__ import annotations

import json
import sys
from typing import Any


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
