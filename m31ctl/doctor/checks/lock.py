"""doctor --locked FILE: the deployment against its lock. Drift fails the check, with every
difference in its message (each redacted: Drift.line)."""

from __future__ import annotations

from m31ctl.checks import CheckStatus
from m31ctl.doctor.base import CheckContext, Outcome, SkipCheck
from m31ctl.errors import M31Error
from m31ctl.lockfile import compare
from m31ctl.redact import redact

# The image's facts come from the Docker Engine (engine_api.connect's own bound is 5 s a call).
LOCK_CHECK_TIMEOUT_S = 30


def lock(ctx: CheckContext) -> Outcome:
    path = ctx.lock_path
    if path is None:
        raise SkipCheck("runs with --locked FILE only")
    if ctx.deployment is None:
        raise SkipCheck("no plan for this host")
    try:
        found = compare(path, ctx.deployment, ctx.plan_files).drift
    except M31Error as exc:
        # The check's message is printed as it stands.
        return Outcome(CheckStatus.FAIL, redact(exc.one_line()), "regenerate it with `m31ctl lock`")
    if found:
        message = f"{len(found)} differences from {path}: " + "; ".join(d.line() for d in found)
        return Outcome(CheckStatus.FAIL, message, "restore what changed, or `m31ctl lock` to accept it")
    return Outcome(CheckStatus.OK, f"matches {path}")
