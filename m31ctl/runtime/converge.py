"""What launch does about a server that may already exist: a pure decision, shared by every
runtime and tested without one (after docker-compose's convergence plan)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

# States in which a server of the same plan is on its way (or there): wait for it, never replace.
_LIVE = frozenset({"running", "created", "restarting"})


class Action(str, Enum):
    CREATE = "created"  # nothing there
    ADOPT = "adopted"  # our server with this plan, still starting: wait for it
    UNCHANGED = "unchanged"  # our server with this plan, serving: nothing to do
    RECREATE = "recreated"  # ours, but another plan or dead: replace it
    REFUSE = "refused"  # not ours: never touched


@dataclass(frozen=True)
class ExistingServer:
    """What stands under the server's name now."""

    owned: bool  # carries m31ctl's owner label (or state file)
    plan_hash: str | None
    state: str  # running | created | restarting | exited | dead | paused
    serving: bool = False  # /v1/models lists the served model


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    # Replacing a server that runs another plan stops someone's traffic: ask first (or --yes).
    needs_confirmation: bool = False


def decide(existing: ExistingServer | None, plan_hash: str) -> Decision:
    if existing is None:
        return Decision(Action.CREATE, "no server by that name")
    if not existing.owned:
        return Decision(Action.REFUSE, "a server by that name exists and was not started by m31ctl")
    if existing.plan_hash != plan_hash:
        live = existing.state in _LIVE
        return Decision(
            Action.RECREATE,
            f"it runs plan {existing.plan_hash or '?'} ({existing.state})",
            needs_confirmation=live,
        )
    if existing.state in _LIVE:
        if existing.state == "running" and existing.serving:
            return Decision(Action.UNCHANGED, "it serves this plan already")
        return Decision(Action.ADOPT, f"it runs this plan and is {existing.state}")
    return Decision(Action.RECREATE, f"it ran this plan and is {existing.state}")
