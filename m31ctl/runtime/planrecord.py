"""The plan a server was launched with, recorded with the server (a container label, the native
record), so that `verify`, `smoke` and `status` can act on the server's own plan without plan
options, and name the settings that differ when they are given some.

The record holds what re-resolving needs and nothing that can drift: the host as the plan saw it
(the probe's answer or the simulated host), the recipe, variant and profile, every resolved setting,
and the directory launch ran in (a relative model path is read from there). Re-resolving layers the
settings over the recipe as one layer each, so the files and `--set`s that produced them are not
needed again (and a file edited since changes nothing). The record comes from something anyone can
write (a label), so it is parsed with a size bound and re-resolved through the same validation as
user input.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from pydantic import ValidationError

from m31ctl.deployment import Deployment, derive
from m31ctl.errors import InputError
from m31ctl.hardware import Hardware
from m31ctl.plan import Plan, PlanRequest, resolve

FORMAT = 1
MAX_RECORD_CHARS = 256 * 1024


class PlanRecord(NamedTuple):
    plan_hash: str
    hardware: Mapping[str, Any]  # Hardware, as JSON
    recipe: str
    variant: str
    profile: str
    settings: Mapping[str, Any]
    cwd: str

    @property
    def served_model(self) -> str | None:
        """The name the server serves the model under (smoke asks for it)."""
        model = self.settings.get("model")
        name = model.get("served_name") if isinstance(model, Mapping) else None
        return name if isinstance(name, str) else None

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **self._asdict()}, sort_keys=True, separators=(",", ":"))

    @classmethod
    def parse(cls, text: str | None) -> PlanRecord | None:
        """The record in `text`, or None when there is none or it is not one (never raises)."""
        if not text or len(text) > MAX_RECORD_CHARS:
            return None
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            return None
        if not isinstance(data, dict) or data.pop("format", None) != FORMAT:
            return None
        try:
            record = cls(**data)
        except TypeError:
            return None
        shapes = (
            (record.hardware, dict),
            (record.settings, dict),
            *((value, str) for value in (record.plan_hash, record.recipe, record.variant, record.profile)),
            (record.cwd, str),
        )
        return record if all(isinstance(value, kind) for value, kind in shapes) else None


def record_of(deployment: Deployment, cwd: str) -> PlanRecord:
    plan = deployment.plan
    return PlanRecord(
        plan_hash=plan.hash,
        hardware=plan.hardware.model_dump(mode="json"),
        recipe=plan.recipe.recipe,
        variant=plan.variant,
        profile=plan.profile,
        settings=plan.settings_dict(),
        cwd=cwd,
    )


def recorded_plan(record: PlanRecord) -> Plan:
    """The plan again, from its record. Raises InputError when the record does not resolve (it
    was written by something else, or by an m31ctl whose settings differ)."""
    # One layer per section, each replacing everything below it: the settings exactly as resolved.
    sets = tuple(f"{section}={json.dumps(value)}" for section, value in sorted(record.settings.items()))
    try:
        hardware = Hardware.model_validate(record.hardware)
        plan = resolve(PlanRequest(hardware, record.recipe, record.variant, record.profile, (), sets))
    except (InputError, ValidationError) as exc:
        reason = exc.one_line() if isinstance(exc, InputError) else str(exc).splitlines()[0]
        raise InputError(
            f"the server's recorded plan does not resolve: {reason}",
            hint="pass the plan options it was launched with",
        ) from None
    return plan


def recorded_deployment(record: PlanRecord) -> Deployment:
    """The server's Deployment, derived where its launch ran (a relative model path stays put)."""
    return derive(recorded_plan(record), cwd=record.cwd)


def _leaves(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping) and value:
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def plan_differences(server: Plan, asked: Plan) -> tuple[str, ...]:
    """What the asked plan changes in the server's: 'key: server's value -> asked value', for the
    recipe, variant, profile and every setting that enters the plan hash."""
    rows: list[tuple[str, Any, Any]] = [
        ("recipe", server.recipe.recipe, asked.recipe.recipe),
        ("variant", server.variant, asked.variant),
        ("profile", server.profile, asked.profile),
    ]
    mine = _leaves({k: v for k, v in server.settings_dict().items() if k != "verify"})
    theirs = _leaves({k: v for k, v in asked.settings_dict().items() if k != "verify"})
    rows += [(key, mine.get(key), theirs.get(key)) for key in sorted(mine.keys() | theirs.keys())]
    return tuple(f"{key}: {json.dumps(old)} -> {json.dumps(new)}" for key, old, new in rows if old != new)


def comparison(server_hash: str, server: Plan | None, asked: Plan) -> tuple[bool, str]:
    """Whether a server runs the asked plan, and the sentence that says so (naming the settings
    that differ when the server's plan is known)."""
    if server_hash == asked.hash:
        return True, f"the server runs plan {asked.hash}"
    if server is None:
        return False, f"the server runs plan {server_hash}; verifying plan {asked.hash}"
    differences = plan_differences(server, asked)
    shown = "; ".join(differences[:8]) + (
        f"; and {len(differences) - 8} more" if len(differences) > 8 else ""
    )
    return False, (
        f"the server runs plan {server_hash}; verifying plan {asked.hash}: "
        f"{shown or 'the same settings (the server was launched by another m31ctl version)'}"
    )
