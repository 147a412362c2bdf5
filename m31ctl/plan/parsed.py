"""A cache of the shipped recipe files in parsed form, as Python keeps .pyc files.

Parsing YAML (and importing PyYAML) is the largest part of planning's start-up; the shipped
recipes, defaults and model facts change only with m31ctl itself. Each parsed file is stored
as JSON under the user's cache directory, keyed by the file's bytes and m31ctl's version, so
an edited file is parsed again. Any failure to read or write the cache falls back to parsing:
the cache can make planning faster, never different. User files (-f, `recipes validate`) are
always parsed.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from m31ctl import __version__
from m31ctl.resources import cache_root

FORMAT = 1  # bump when the parsed form changes
DISABLE_ENV = "M31CTL_NO_PARSE_CACHE"


def cache_dir() -> Path:
    return cache_root() / "parsed"


def parsed(path: Path, parse: Callable[[bytes], Any]) -> Any:
    """parse(bytes of path), from the cache when this exact file was parsed before."""
    raw = path.read_bytes()
    if os.environ.get(DISABLE_ENV):
        return parse(raw)
    key = hashlib.sha256(f"{FORMAT}\0{__version__}\0{path.name}\0".encode() + raw).hexdigest()[:32]
    entry = cache_dir() / f"{key}.json"
    try:
        return json.loads(entry.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    data = parse(raw)
    _store(entry, data)
    return data


def _store(entry: Path, data: Any) -> None:
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".parsed.", dir=entry.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, sort_keys=True)
        os.replace(tmp, entry)
    except OSError:
        pass  # a read-only or full home: parse every time
