"""What the commands share below the CLI (issue 52): the plan's one Deployment as a command
asks for it (resolved, derived, fitted, its argv validated), and results of no stage of their own.
The CLI parses, calls one of these (or a stage's own function) and prints what it returned."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from m31ctl.deployment import Deployment
    from m31ctl.plan import PlanRequest


def deployment(request: PlanRequest, validate: bool = True, fit: bool = True) -> Deployment:
    """The request's one Deployment; with `fit`, refused when the hardware cannot hold its layout
    (exit 6, as launch's preflight); its argv checked against the engine's schema unless --no-validate."""
    # lazy: the plan's modules load for a command that plans, not for version's result (Version)
    from m31ctl.deployment import derive, require_fit
    from m31ctl.plan import resolve

    plan = resolve(request)
    found = derive(plan)
    if fit:
        require_fit(found)
    if validate:
        # lazy: the engine's schema check, only when asked for
        from m31ctl.engine.adapter import build_invocation
        from m31ctl.engine.validate import check_plan_engine

        source = plan.provenance.get("engine.extra_args")
        for engine in found.engines:  # a P/D group: each role's engine
            check_plan_engine(
                build_invocation(engine),
                plan.settings.engine.schema_version,
                plan.settings.engine.extra_args,
                str(source) if source else None,
            )
    return found


@dataclass(frozen=True)
class Version:
    """version's result."""

    version: str

    def to_json(self) -> dict[str, str]:
        return {"version": self.version}
