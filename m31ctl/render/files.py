"""Writing artifacts atomically, refusing to clobber, and diffing for `render --check`.

What sits at a target path is compared only when it is a regular file of UTF-8 text, read
without following a link and up to a bound: a FIFO would block the read, a link to a device
would be read whole. Anything else there (a link, a FIFO, a device, a file that is not UTF-8 or
too large to be an artifact) differs from the render: a conflict that --force replaces without
reading or following it, and drift for --check.
"""

from __future__ import annotations

import difflib
import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from m31ctl.errors import ConflictError, InputError
from m31ctl.render.targets import Artifact

# Artifacts are a few kB; a larger file at a target path is not one of ours, and is not read.
MAX_ARTIFACT_BYTES = 1 << 20


class FileOnDisk(NamedTuple):
    """What a target path holds: nothing, a regular file's text, or something else (`other`
    says what, and the text is None)."""

    text: str | None = None
    other: str | None = None

    @property
    def present(self) -> bool:
        return self.text is not None or self.other is not None


def existing(path: Path) -> FileOnDisk:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return FileOnDisk()
    except OSError as exc:
        raise InputError(f"cannot inspect {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        return FileOnDisk(other=_kind(mode))
    try:
        # O_NOFOLLOW and O_NONBLOCK: had the file been swapped for a link or a FIFO since the
        # lstat, the open fails or returns at once instead of following or blocking.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            return FileOnDisk(other=_kind(info.st_mode))
        if info.st_size > MAX_ARTIFACT_BYTES:
            return FileOnDisk(other=f"a file of {info.st_size:,} bytes, larger than any artifact")
        raw = handle.read(MAX_ARTIFACT_BYTES + 1)
    if len(raw) > MAX_ARTIFACT_BYTES:
        return FileOnDisk(other="a file larger than any artifact")
    try:
        return FileOnDisk(text=raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return FileOnDisk(other=f"a file that is not UTF-8 text (byte {exc.start})")


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def write(directory: Path, artifacts: Sequence[Artifact], force: bool) -> list[tuple[Path, str]]:
    """Write every artifact or none: conflicts are found before the first write."""
    plan: list[tuple[Path, Artifact, str]] = []
    for artifact in artifacts:
        if Path(artifact.name).name != artifact.name or artifact.name in ("", ".", ".."):
            # Names come from validated settings; a path here would write outside DIR.
            raise InputError(f"refusing to write {artifact.name!r}: not a plain file name")
        path = directory / artifact.name
        current = existing(path)
        if current.text == artifact.content:
            plan.append((path, artifact, "unchanged"))
        elif current.other == "a directory":
            # Replacing would mean deleting a tree that m31ctl did not write: never, not even with --force.
            raise ConflictError(f"{path} is a directory", hint="move it away, or render into another DIR")
        elif current.present and not force:
            what = (
                f"is {current.other}, not the rendered file"
                if current.other
                else "exists and differs from the render"
            )
            raise ConflictError(
                f"{path} {what}",
                hint="review it with `m31ctl render --check DIR`, then pass --force to overwrite",
            )
        else:
            plan.append((path, artifact, "replaced" if current.present else "written"))
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create {directory}: {exc.strerror}") from None
    for path, artifact, state in plan:
        if state != "unchanged":
            try:
                _write_atomic(path, artifact.content, artifact.mode)
            except OSError as exc:  # a read-only or full file system: nothing half-written stays
                raise InputError(f"cannot write {path}: {exc.strerror or exc}") from None
    return [(path, state) for path, _artifact, state in plan]


def write_text_atomic(path: Path, content: str, mode: int = 0o644) -> None:
    """One file, whole or not at all (a temporary file in the same directory, then rename)."""
    _write_atomic(path, content, mode)


def _write_atomic(path: Path, content: str, mode: int) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(content)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def diff(directory: Path, artifacts: Sequence[Artifact]) -> str:
    """A unified diff from what DIR holds to what the plan renders; empty when up to date."""
    if not directory.is_dir():
        raise InputError(f"--check: {directory} is not a directory")
    chunks: list[str] = []
    for artifact in artifacts:
        path = directory / artifact.name
        current = existing(path)
        if current.text == artifact.content:
            continue
        if current.other is not None:  # nothing to diff line by line: say what is there instead
            chunks.append(f"{path}: {current.other}, not the rendered file\n")
            continue
        chunks.extend(
            difflib.unified_diff(
                (current.text or "").splitlines(keepends=True),
                artifact.content.splitlines(keepends=True),
                fromfile=str(path) if current.text is not None else "/dev/null",
                tofile=f"{path} (rendered)",
            )
        )
    return "".join(chunks)
