"""Printing: canonical JSON for machines, rich for people (imported only when used)."""

from __future__ import annotations

import json
import sys
from typing import Any


def emit_json(payload: Any) -> None:
    sys.stdout.write(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def console(stderr: bool = False) -> Any:
    import shutil

    from rich.console import Console

    # Pipes and CI logs get a wide page rather than rich's 80-column guess.
    width = shutil.get_terminal_size((140, 24)).columns
    return Console(stderr=stderr, highlight=False, width=max(width, 100))


def table(title: str | None, columns: list[str]) -> Any:
    from rich.table import Table

    t = Table(title=title, show_header=True, header_style="bold", title_justify="left")
    for name in columns:
        t.add_column(name)
    return t
