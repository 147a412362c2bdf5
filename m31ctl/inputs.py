"""Reading the files a user hands to m31ctl: one place that decodes them and says what went wrong.

Every read is bounded and every JSON parse is depth-checked: a path to /dev/zero, a file that
grows without end, or `[[[[...` nested past Python's recursion limit is bad input (exit 2) naming
the file, never a MemoryError or a RecursionError. The largest file m31ctl reads on purpose (a
verify report, a lock file, a model's config.json) is well under a megabyte.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from m31ctl.errors import InputError

MAX_INPUT_BYTES = 4 << 20
# Settings nest a handful of levels (a section, a mapping of variables, a JSON-valued flag); a
# verify report or a lock file a few more. Deeper is not something m31ctl wrote or a person meant.
MAX_DEPTH = 32


def read_bytes(path: Path, what: str, hint: str | None = None, limit: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of `path` (at most `limit`), or bad input (exit 2) naming the file. A pipe works
    (`-f <(...)`); a device or pipe that never ends is cut at the limit and refused."""
    try:
        with path.open("rb") as handle:
            data = handle.read(limit + 1)
    except FileNotFoundError:
        raise InputError(f"{what} not found: {path}", hint=hint) from None
    except IsADirectoryError:
        raise InputError(f"{what} {path} is a directory, not a file", hint=hint) from None
    except OSError as exc:
        raise InputError(f"cannot read {what} {path}: {exc.strerror or exc}", hint=hint) from None
    if len(data) > limit:
        raise InputError(
            f"{what} {path} is larger than {_size(limit)}",
            hint=hint or f"a {what} is small text; check the path",
        )
    return data


def read_text(path: Path, what: str, hint: str | None = None, limit: int = MAX_INPUT_BYTES) -> str:
    """The UTF-8 text of `path`. Missing, unreadable, oversized and non-UTF-8 files are bad input
    (exit 2) naming the file, never a traceback."""
    return decode(read_bytes(path, what, hint, limit), path, what)


def decode(raw: bytes, path: Path, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{what} {path} is not UTF-8 text (byte {exc.start})", hint="save it as UTF-8"
        ) from None


def read_json(path: Path, what: str, hint: str | None = None) -> Any:
    """The JSON value in `path`: bounded in size and depth, or bad input (exit 2) naming the file."""
    return parse_json(read_text(path, what, hint), path, what)


def parse_json(text: str, path: Path, what: str) -> Any:
    too_deep = InputError(f"not a {what}: nested more than {MAX_DEPTH} levels deep", where=str(path))
    try:
        data = json.loads(text)
    except RecursionError:
        raise too_deep from None
    except ValueError as exc:
        raise InputError(f"not a {what}: invalid JSON ({exc})", where=str(path)) from None
    if nesting_depth(data) > MAX_DEPTH:
        raise too_deep
    return data


def nesting_depth(data: Any, stop: int = MAX_DEPTH) -> int:
    """How deeply lists and mappings nest in `data` (a scalar: 0), counted without recursion and
    given up one level past `stop`: what walks it next (validation, redaction, json.dumps) recurses."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, depth + 1)
        if deepest > stop:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit} bytes"
