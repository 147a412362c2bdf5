"""What every runtime does the same way around a launch: the API key, the port, the decision's
confirmation and the readiness wait."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from m31ctl.deployment import Deployment
from m31ctl.engine.adapter import OFFLINE_ENV
from m31ctl.errors import ConflictError, HostPreconditionError
from m31ctl.netaddr import port_free
from m31ctl.plan import Plan
from m31ctl.redact import header_safe
from m31ctl.resources import state_root
from m31ctl.runtime.converge import Action, Decision
from m31ctl.runtime.phases import Phase
from m31ctl.runtime.protocol import Diagnostics, LaunchOptions
from m31ctl.runtime.readiness import Watchdog
from m31ctl.timeline import ENGINE_READY_ENV

# Variables launch itself sets for the engine in LaunchOptions.environ (beyond the plan's env and
# the secrets): the container runtime passes them into the container as the native one inherits them.
LAUNCH_ENV = (OFFLINE_ENV, ENGINE_READY_ENV)


def api_key_for(deployment: Deployment, environ: Mapping[str, str]) -> str | None:
    """The key the server will demand (read from the environment, never stored), or None."""
    name = deployment.secrets.api_key
    if name is None:
        return None
    key = environ.get(name)
    if not key:
        raise HostPreconditionError(
            f"runtime.api_key is set but {name} is not in the environment",
            hint=f"export {name} before launching",
        )
    return header_safe(name, key)


def ensure_port_free(bind: str, port: int) -> None:
    if not port_free(bind, port):
        raise ConflictError(f"port {bind}:{port} is in use", hint="pass --port, or stop what listens there")


def confirm_or_refuse(decision: Decision, name: str, plan_hash: str, options: LaunchOptions) -> None:
    """Refuse a foreign server; ask before replacing one that runs another plan."""
    if decision.action is Action.REFUSE:
        raise ConflictError(
            f"a server named {name} exists and was not created by m31ctl",
            hint="m31ctl never touches it: pass --name to use another name",
        )
    if decision.needs_confirmation:
        question = f"{name}: {decision.reason}; replace it with plan {plan_hash}?"
        if not (options.yes or options.confirm(question)):
            raise ConflictError(
                f"{name} {decision.reason}; not replaced", hint="pass --yes to recreate it with this plan"
            )


def watchdog_for(deployment: Deployment, diagnostics: Diagnostics | None = None) -> Watchdog:
    """Silence budgets per startup phase, from the Deployment: the checkpoint download may go
    quiet for its whole expected time; every other phase for the load-and-compile budget. The
    triage bundle is written under the state directory."""
    timeline = deployment.timeline
    return Watchdog(
        {Phase.DOWNLOADING: max(60.0, float(timeline.download_s))},
        float(max(1, timeline.load_s)),
        lambda data: write_triage(deployment.plan, deployment.name, data, diagnostics),
    )


def triage_dir() -> Path:
    return state_root() / "triage"


def write_triage(plan: Plan, name: str, data: dict[str, Any], diagnostics: Diagnostics | None = None) -> str:
    """The bundle a stalled launch leaves: log tail, phase timeline, the plan, and what
    `diagnostics` adds (deploy passes the doctor's report with each GPU's memory), as one JSON
    file. Returns its path ("not written: why" if it fails)."""
    bundle: dict[str, Any] = {
        **data,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "plan": {"hash": plan.hash, "recipe": plan.recipe.recipe, "settings": plan.settings_dict()},
    }
    if diagnostics is not None:
        try:
            bundle.update(diagnostics())
        except Exception as exc:  # the bundle matters more than its diagnostics
            bundle["diagnostics"] = f"not collected: {type(exc).__name__}: {exc}"
    path = triage_dir() / f"{name}-{time.strftime('%Y%m%dT%H%M%S')}.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(bundle, indent=1, sort_keys=True, default=str) + "\n")
    except OSError as exc:
        return f"not written ({exc.strerror or exc})"
    return str(path)
