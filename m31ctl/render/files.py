"""Writing artifacts atomically, refusing to clobber, and diffing for `render --check`."""

from __future__ import annotations

import difflib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

from m31ctl.errors import ConflictError, InputError
from m31ctl.inputs import read_text_if_exists
from m31ctl.render.targets import Artifact


def _existing(path: Path) -> str | None:
    return read_text_if_exists(path, "existing file")


def write(directory: Path, artifacts: Sequence[Artifact], force: bool) -> list[tuple[Path, str]]:
    """Write every artifact or none: conflicts are found before the first write."""
    plan: list[tuple[Path, Artifact, str]] = []
    for artifact in artifacts:
        if Path(artifact.name).name != artifact.name or artifact.name in ("", ".", ".."):
            # Names come from validated settings; a path here would write outside DIR.
            raise InputError(f"refusing to write {artifact.name!r}: not a plain file name")
        path = directory / artifact.name
        current = _existing(path)
        if current == artifact.content:
            plan.append((path, artifact, "unchanged"))
        elif current is not None and not force:
            raise ConflictError(
                f"{path} exists and differs from the render",
                hint="review it with `m31ctl render --check DIR`, then pass --force to overwrite",
            )
        else:
            plan.append((path, artifact, "written" if current is None else "replaced"))
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
        current = _existing(path)
        if current == artifact.content:
            continue
        chunks.extend(
            difflib.unified_diff(
                (current or "").splitlines(keepends=True),
                artifact.content.splitlines(keepends=True),
                fromfile=str(path) if current is not None else "/dev/null",
                tofile=f"{path} (rendered)",
            )
        )
    return "".join(chunks)
