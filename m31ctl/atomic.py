"""Files written whole or not at all: a temporary file of this writer's own in the target's
directory, every byte written and flushed to disk (fsync), renamed over the target, and the
directory flushed so the rename itself survives a crash. On any failure (a full disk, an I/O
error, an interrupt) the temporary file is removed and the error goes on: nothing half-written
stays, and the old file, if any, is untouched.

`reserve` is the same in two steps, for a file whose content is known only after something has
been done that must not be done unless the file can be written (the native runtime's record,
whose pid exists only once the engine runs): the space is claimed first (posix_fallocate, so a
full disk answers ENOSPC before anything starts), the content is written into it later.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

Writer = Callable[[int, bytes], None]


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Slot:
    """A reserved temporary file beside `target`: `commit` writes it and renames it into place,
    at most once; closing the slot removes whatever was not committed."""

    def __init__(self, target: Path, size: int, mode: int) -> None:
        self.target = target
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
        self._fd: int | None = fd
        self.tmp = Path(tmp)
        try:
            os.fchmod(fd, mode)
            if size > 0:
                os.posix_fallocate(fd, 0, size)
        except BaseException:
            self.close()
            raise

    def commit(self, data: bytes, write: Writer = write_all) -> None:
        fd = self._fd
        if fd is None:
            raise ValueError(f"{self.tmp} was committed or closed already")
        try:
            os.lseek(fd, 0, os.SEEK_SET)
            write(fd, data)
            os.ftruncate(fd, len(data))  # the reservation's unused tail
            os.fsync(fd)
            os.close(fd)
            self._fd = None
            os.replace(self.tmp, self.target)
        except BaseException:
            self.close()
            raise
        _sync_directory(self.target.parent)

    def close(self) -> None:
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        self.tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def reserve(target: Path, size: int, mode: int = 0o600) -> Iterator[Slot]:
    """A slot for `target` with `size` bytes claimed on disk now (OSError, ENOSPC on a full disk,
    when they cannot be); whatever is not committed by the end is removed."""
    slot = Slot(target, size, mode)
    try:
        yield slot
    finally:
        slot.close()


def write_atomic(target: Path, data: bytes | str, mode: int = 0o644, write: Writer = write_all) -> None:
    """`target` holds `data` entirely, or (on any error, which is raised) what it held before."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    with reserve(target, 0, mode) as slot:
        slot.commit(payload, write)


def _sync_directory(directory: Path) -> None:
    """The rename is durable once the directory is flushed; a file system that cannot flush a
    directory (some network ones) has done what it can."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)
