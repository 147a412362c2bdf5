"""`--locked FILE` for launch and render, and the `lock` command: what of the lock's work writes
a file or prints, and the lock command's two results. Comparing and applying a lock is
m31ctl/lockfile.py's; doctor's lock check is m31ctl/doctor/checks/lock.py."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m31ctl.cli.output import text_view, write_file
from m31ctl.cli.screen import for_stderr
from m31ctl.deployment import Deployment
from m31ctl.lockfile import Drift, LockFile, apply, checkpoint_gap, compare, current, drift_lines, to_text


def write_lock(path: Path, lock: LockFile) -> None:
    write_file(path, to_text(lock))


def apply_lock(
    deployment: Deployment, files: tuple[Path, ...], path: Path, update: bool, *, by_id: bool
) -> Deployment:
    """m31ctl.lockfile.apply, with the lock rewritten (and said so) when `update` accepted drift."""
    applied = apply(deployment, files, path, update, by_id=by_id)
    if applied.rewrite is not None:
        write_lock(path, applied.rewrite)
        differences = len(applied.differences)
        sys.stderr.write(f"m31ctl: updated {path} ({differences} differences)\n")
    return applied.deployment


@dataclass(frozen=True)
class LockChecked:
    """`lock --check FILE`: how the deployment differs from the lock (nothing: no drift)."""

    path: Path
    drift: list[Drift]

    def to_json(self) -> dict[str, Any]:
        return {"lock": str(self.path), "drift": [d._asdict() for d in self.drift], "ok": not self.drift}


@text_view(LockChecked)
def _checked_text(checked: LockChecked) -> None:
    if checked.drift:
        sys.stdout.write("\n".join((f"drift from {checked.path}:", *drift_lines(checked.drift))) + "\n")
    else:
        sys.stdout.write(f"{checked.path}: no drift\n")


@dataclass(frozen=True)
class LockWritten:
    """`lock -o FILE`: the lock written, why its image is not pinned (`gap`) if it is not, and
    why it records no checkpoint commit (`checkpoint_gap`) if it does not."""

    path: Path
    lock: LockFile
    gap: str | None
    checkpoint_gap: str | None = None

    def to_json(self) -> dict[str, Any]:
        warnings = [self.checkpoint_gap] if self.checkpoint_gap else []
        return {"lock": str(self.path), **self.lock.model_dump(mode="json"), "warnings": warnings}


@text_view(LockWritten)
def _written_text(written: LockWritten) -> None:
    lock, image = written.lock, written.lock.image
    pinned = image.digest or image.id or written.gap
    sys.stderr.write(f"wrote {written.path}: plan {lock.plan_hash}, image {image.reference} -> {pinned}\n")
    if written.checkpoint_gap:
        sys.stderr.write(for_stderr(f"m31ctl: warning: {written.checkpoint_gap}") + "\n")


def check_lock(path: Path, deployment: Deployment, files: tuple[Path, ...]) -> LockChecked:
    return LockChecked(path, compare(path, deployment, files).drift)


def write_current(path: Path, deployment: Deployment, files: tuple[Path, ...]) -> LockWritten:
    """The deployment's lock, written to `path`."""
    lock_file, gap = current(deployment, files)
    write_lock(path, lock_file)
    return LockWritten(path, lock_file, gap, checkpoint_gap(deployment, lock_file.checkpoint))
