"""`--locked FILE` for launch, render and doctor, and the `lock` command: resolve as usual,
compare with the lock, and say every difference."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from m31ctl.cli.output import write_file
from m31ctl.errors import ConflictError, DockerUnreachable, M31Error
from m31ctl.lock import Drift, LockedCheckpoint, LockFile, build, drift, pin, pinned_reference, read, to_text
from m31ctl.plan import Plan
from m31ctl.redact import redact

if TYPE_CHECKING:
    from m31ctl.doctor import DoctorReport


def current_lock(plan: Plan, files: tuple[Path, ...]) -> LockFile:
    """The lock as it would be written now. The image's facts come from the Docker Engine; when
    it cannot be reached they are left out (and a lock that recorded them does not drift)."""
    from m31ctl.runtime.images import image_facts

    try:
        facts = image_facts(plan.settings.engine.image)
    except DockerUnreachable:
        facts = None
    return build(plan, files, facts, _checkpoint(plan))


def _checkpoint(plan: Plan) -> LockedCheckpoint | None:
    """The hub repo and the commit its cache holds (None for a local checkpoint directory)."""
    from m31ctl.checkpoint import cached_commit
    from m31ctl.deployment import derive

    deployment = derive(plan)
    repo = deployment.model.repo_id
    if repo is None:
        return None
    return LockedCheckpoint(repo=repo, commit=cached_commit(deployment.hf_cache, repo))


def compare(path: Path, plan: Plan, files: tuple[Path, ...]) -> tuple[LockFile, LockFile, list[Drift]]:
    """(the lock in `path`, the lock as it would be written now, every difference)."""
    locked = read(path)
    now = current_lock(plan, files)
    return locked, now, drift(locked, now, plan)


def write_lock(path: Path, lock: LockFile) -> None:
    write_file(path, to_text(lock))


def drift_lines(found: list[Drift]) -> tuple[str, ...]:
    """The printed form of drift: each line redacted (Drift.line), as the JSON forms are."""
    return tuple(f"  {d.line()}" for d in found)


def apply_lock(plan: Plan, files: tuple[Path, ...], path: Path, update: bool, *, by_id: bool) -> Plan:
    """Refuse a plan that drifted from its lock (exit 4) unless `update`, which rewrites the lock;
    then pin the image by the lock's digest (or, for launch, `by_id`, its local image ID)."""
    locked, now, found = compare(path, plan, files)
    if found and not update:
        raise ConflictError(
            f"the deployment drifted from {path} ({len(found)} difference{'s' if len(found) > 1 else ''})",
            hint="review the differences; pass --update-lock to accept them, or restore what changed",
            details=(f"drift from {path}:", *drift_lines(found)),
        )
    if found:
        write_lock(path, now)
        sys.stderr.write(f"m31ctl: updated {path} ({len(found)} differences)\n")
        locked = now
    reference = locked.image.digest or (pinned_reference(locked) if by_id else None)
    return pin(plan, reference, path) if reference else plan


def lock_check(report: DoctorReport, files: tuple[Path, ...], path: Path) -> DoctorReport:
    """doctor --locked: drift is a failed check named `lock`, with the differences in its message."""
    import dataclasses
    import time

    from m31ctl.doctor.base import CheckResult

    start = time.monotonic()
    if report.plan is None:
        result = CheckResult("lock", "Lock file", "skip", "no plan for this host", "", 0.0)
    else:
        problem: str | None = None
        found: list[Drift] = []
        try:
            _locked, _now, found = compare(path, report.plan, files)
        except M31Error as exc:
            problem = redact(exc.one_line())  # the check's message is printed as it stands
        took = time.monotonic() - start
        if problem:
            result = CheckResult(
                "lock", "Lock file", "fail", problem, "regenerate it with `m31ctl lock`", took
            )
        elif found:
            message = f"{len(found)} differences from {path}: " + "; ".join(d.line() for d in found)
            remedy = "restore what changed, or `m31ctl lock` to accept it"
            result = CheckResult("lock", "Lock file", "fail", message, remedy, took)
        else:
            result = CheckResult("lock", "Lock file", "ok", f"matches {path}", "", took)
    return dataclasses.replace(report, results=(*report.results, result))
