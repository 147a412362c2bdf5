"""Where plain HTTP's bytes land: one blob's partial file, locked and written at offsets by each
of its ranges' writers.

A writer is cancelled when its transfer is given up on (a stall, a merge of the ranges), and from
then on refuses every write: the thread still running it may only end, never write over the
bytes of the attempt that follows.
"""

from __future__ import annotations

import fcntl
import os
import threading
from pathlib import Path

from m31ctl.errors import ConflictError
from m31ctl.pull.cache import Part


class _Cancelled(Exception):
    """Raised into an abandoned transfer thread by its writer."""


class PartialFile:
    """One blob's partial file, open once for all its ranges: locked (flock) against a second pull
    writing it too, written at offsets."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise ConflictError(
                f"another process is downloading into {path}", hint="wait for it, or stop it and rerun"
            ) from None
        self._open = True

    def write_at(self, data: bytes, offset: int) -> int:
        return os.pwrite(self._fd, data, offset)

    def truncate(self, size: int) -> None:
        os.ftruncate(self._fd, size)

    def close(self) -> None:
        if self._open:
            self._open = False
            os.close(self._fd)  # also releases the lock on it


class PartWriter:
    """One range's writer (hub.Writer): each write lands after the range's bytes on disk; once
    cancelled it refuses every write, so an abandoned thread never writes after the next attempt began."""

    def __init__(self, partial: PartialFile, part: Part) -> None:
        self.partial, self.part = partial, part
        self.written = 0  # by this attempt: what the watchdog counts
        self.restarted = False  # the server sent the whole file: nothing was resumed after all
        self._lock = threading.Lock()
        self._cancelled = False

    def write(self, data: bytes) -> int:
        with self._lock:
            if self._cancelled:
                raise _Cancelled
            count = self.partial.write_at(data, self.part.start + self.part.done)
            self.part.done += count
            self.written += count
            return count

    def restart(self) -> None:
        """The server ignored the Range of a file in one piece and sends it from its first byte."""
        with self._lock:
            if self._cancelled:
                raise _Cancelled
            self.partial.truncate(0)
            self.part.done = 0
            self.restarted = True

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
