"""Reading what `m31ctl ... --json` printed: every test reads a command's JSON through here, so
the output's shape is spelled in one place."""

from __future__ import annotations

import json
from typing import Any


def data(text: str) -> Any:
    """The result a command printed with --json."""
    return json.loads(text)
