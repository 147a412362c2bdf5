"""What every runtime does the same way around a launch: the API key, the port, the decision's
confirmation and the readiness wait."""

from __future__ import annotations

from collections.abc import Mapping

from m31ctl.errors import ConflictError, HostPreconditionError, InputError
from m31ctl.netaddr import port_free
from m31ctl.plan import Plan
from m31ctl.runtime.base import LaunchOptions
from m31ctl.runtime.converge import Action, Decision

API_KEY_ENV = "VLLM_API_KEY"


def api_key_for(plan: Plan, environ: Mapping[str, str]) -> str | None:
    """The key the server will demand (read from the environment, never stored), or None."""
    if not plan.settings.runtime.api_key:
        return None
    key = environ.get(API_KEY_ENV)
    if not key:
        raise HostPreconditionError(
            f"runtime.api_key is set but {API_KEY_ENV} is not in the environment",
            hint=f"export {API_KEY_ENV} before launching",
        )
    if "\r" in key or "\n" in key:
        raise InputError(
            f"{API_KEY_ENV} holds a line break, which no HTTP header can carry",
            hint="fix the variable's value",
        )
    return key


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
