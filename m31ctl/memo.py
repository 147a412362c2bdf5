"""A disk memo of deterministic work, as Python keeps .pyc files.

Two costs dominate a short command's start-up beyond typer and pydantic: importing PyYAML and
parsing the shipped recipes (every plan), and importing PyYAML to emit a Compose file or a
Kubernetes manifest (every render). Both are pure functions of their inputs, so each result is
stored as JSON under the user's cache directory, keyed by the inputs, the kind of work and
m31ctl's version. Any failure to read or write an entry falls back to doing the work: the memo
can make a command faster, never different. `M31CTL_NO_CACHE=1` turns it off.

An entry is trusted only as m31ctl wrote it: a header line names its key and the SHA-256 of the
JSON below it. A truncated, edited or swapped entry (even valid JSON such as `{}`), one that is
not a regular file, or one too large to be ours is a miss, and the work is done again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from m31ctl import __version__
from m31ctl.resources import cache_root

# Bump when the stored form changes (3: a header with the key and the payload's hash; 2: mapping
# order kept; 1: sorted keys).
FORMAT = 3
MAGIC = b"m31ctl-memo"
# An entry is a few kB (a parsed recipe, a rendered manifest); anything far larger is not ours.
MAX_ENTRY_BYTES = 4 << 20
DISABLE_ENV = "M31CTL_NO_CACHE"
# Entries kept per kind, newest first: renders of many variations must not fill a disk. Each
# entry is a few kB; the shipped recipe files need 7.
MAX_ENTRIES = 256


def memo_dir(kind: str) -> Path:
    return cache_root() / kind


def memoized(kind: str, key: bytes, compute: Callable[[], Any], code: Sequence[str] = ()) -> Any:
    """compute(), or its stored result when the same `kind` of work ran on the same `key` before.

    `key` must determine the result completely (every input, in a form whose equality implies
    the result's): a wrong key is the only way this memo could change an answer. `code` names the
    source files of the work itself: an installed m31ctl changes them only with its version, but
    a checkout edits them, and an edit must not be answered from before it."""
    if os.environ.get(DISABLE_ENV):
        return compute()
    stamp = f"{FORMAT}\0{__version__}\0{kind}\0{_code_stamp(code)}\0"
    digest = hashlib.sha256(stamp.encode() + key).hexdigest()[:32]
    entry = memo_dir(kind) / f"{digest}.json"
    found = _load(entry, digest)
    if found is not _MISS:
        return found
    result = compute()
    _store(entry, digest, result)
    return result


_MISS = object()


def _load(entry: Path, digest: str) -> Any:
    """The stored result, or _MISS for anything but an intact entry m31ctl wrote for `digest`."""
    try:
        # Never block on a FIFO or follow a link planted in the cache; a device is not a regular file.
        fd = os.open(entry, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return _MISS
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return _MISS
        with os.fdopen(fd, "rb", closefd=False) as handle:
            raw = handle.read(MAX_ENTRY_BYTES + 1)
    except OSError:
        return _MISS
    finally:
        os.close(fd)
    header, _, payload = raw.partition(b"\n")
    if len(raw) > MAX_ENTRY_BYTES or header != _header(digest, payload):
        return _MISS
    try:
        return json.loads(payload)
    except (ValueError, RecursionError):
        return _MISS


def _header(digest: str, payload: bytes) -> bytes:
    return b"%s %s %s" % (MAGIC, digest.encode(), hashlib.sha256(payload).hexdigest().encode())


def _code_stamp(code: Sequence[str]) -> str:
    """Each file's size and modification time: cheap (no read), and changed by any edit."""
    stamps = []
    for path in code:
        try:
            stat = os.stat(path)
            stamps.append(f"{path}:{stat.st_size}:{stat.st_mtime_ns}")
        except OSError:
            stamps.append(f"{path}:?")
    return ";".join(stamps)


def _store(entry: Path, digest: str, result: Any) -> None:
    """Write atomically (a concurrent reader sees the old entry or the new one, never half)."""
    try:
        payload = json.dumps(result).encode()  # key order kept: recipes and layers are ordered mappings
    except (TypeError, ValueError, RecursionError):
        return  # not JSON-able: nothing to keep, the work is simply done each time
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".memo.", dir=entry.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(_header(digest, payload) + b"\n" + payload)
            os.replace(tmp, entry)  # replaces whatever sat there (a link, a bad entry) without following it
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        return  # a read-only or full home: do the work every time
    _prune(entry.parent)


def _prune(folder: Path) -> None:
    """Keep the MAX_ENTRIES newest entries (run only after a miss, so a hit never lists the folder)."""
    try:
        entries = sorted(
            (item.stat().st_mtime_ns, item.path) for item in os.scandir(folder) if item.name.endswith(".json")
        )
    except OSError:
        return
    for _mtime, path in entries[: max(0, len(entries) - MAX_ENTRIES)]:
        with contextlib.suppress(OSError):
            os.unlink(path)
