"""The plan a blue-green launch replaced, kept per deployment so that one command puts it back
(`m31ctl launch --rollback`): a JSON file in the state directory, beside the native records,
written atomically when the old server is stopped and rewritten by every switch (a rollback
keeps the plan it rolled back from, so a second rollback goes forward again, as `kubectl
rollout undo` does)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from m31ctl import atomic
from m31ctl.errors import HostPreconditionError
from m31ctl.names import check_name, name_problem
from m31ctl.resources import state_root
from m31ctl.runtime.planrecord import MAX_RECORD_CHARS, PlanRecord

FORMAT = 1


class Previous(NamedTuple):
    """The deployment `base`'s replaced server: its name, runtime and plan."""

    base: str
    server: str
    runtime: str
    record: PlanRecord
    replaced_at: float


def rollouts_dir() -> Path:
    return state_root() / "rollouts"


def _path(base: str) -> Path:
    return rollouts_dir() / f"{check_name(base, 'server name')}.json"


def remember(previous: Previous) -> None:
    """Keep the replaced plan; a state directory that cannot hold it is one line (exit 6)
    before the old server is stopped, so no rollback path is lost silently."""
    data = {
        "format": FORMAT,
        "base": previous.base,
        "server": previous.server,
        "runtime": previous.runtime,
        "plan": previous.record.to_json(),
        "replaced_at": previous.replaced_at,
    }
    try:
        _path(previous.base).parent.mkdir(parents=True, exist_ok=True)
        atomic.write_atomic(_path(previous.base), json.dumps(data, indent=1, sort_keys=True) + "\n", 0o600)
    except OSError as exc:
        raise HostPreconditionError(
            f"cannot keep the previous plan in {rollouts_dir()}: {exc.strerror or exc}",
            hint="point M31CTL_STATE_DIR at a writable directory; nothing was stopped",
        ) from None


def recall(base: str) -> Previous | None:
    """The deployment's previous plan, or None (none kept, or a file that is not one)."""
    try:
        text = _path(base).read_text()[: MAX_RECORD_CHARS * 2]
        data = json.loads(text)
        record = PlanRecord.parse(data.get("plan"))
        if data.get("format") != FORMAT or record is None:
            return None
        return Previous(
            str(data["base"]), str(data["server"]), str(data["runtime"]), record, float(data["replaced_at"])
        )
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return None


def kept() -> list[str]:
    """The deployments with a previous plan kept, by base name."""
    directory = rollouts_dir()
    if not directory.is_dir():
        return []
    return sorted(p.stem for p in directory.glob("*.json") if name_problem(p.stem) is None and recall(p.stem))
