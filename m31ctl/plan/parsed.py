"""The shipped recipe files in parsed form, memoized on disk (m31ctl/memo.py).

Parsing YAML (and importing PyYAML) is the largest part of planning's start-up; the shipped
recipes, defaults and model facts change only with m31ctl itself. Each file is keyed by its
name and bytes, so an edited file is parsed again. User files (-f, `recipes validate`) are
always parsed.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from m31ctl.memo import memoized

# The code that turns a settings file into data: an edit to it (in a checkout) parses again.
_PARSER_CODE = tuple(
    str(Path(__file__).with_name(name)) for name in ("catalog.py", "yamlfile.py", "layers.py")
)


def parsed(path: Path, parse: Callable[[bytes], Any]) -> Any:
    """parse(bytes of path), from the memo when this exact file was parsed before."""
    raw = path.read_bytes()
    return memoized("parsed", path.name.encode() + b"\0" + raw, lambda: parse(raw), code=_PARSER_CODE)
