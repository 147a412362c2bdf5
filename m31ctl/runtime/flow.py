"""The one launch flow every runtime shares: decide (converge.decide), confirm, then adopt,
recreate or create, then detach or wait, then the result. A runtime supplies only its primitives
(a Backend): find what stands under the name, start it if only created, remove it, prepare and
create+start a new one, the handle readiness polls, the endpoint, and what to do with a server
that died while loading.

Interrupts (Ctrl-C, and SIGTERM, which the CLI turns into the same) may land anywhere here. What
each step leaves is one that the next launch converges on: the claim (a lock) is released by the
`with`; a created container carries its labels and is adopted; a native engine counts as started
only once its record is saved, and Backend.create stops it if the save does not happen.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar

from m31ctl import interrupt
from m31ctl.deployment import Deployment
from m31ctl.errors import ConflictError, ServerDied
from m31ctl.runtime.converge import Action, ExistingServer, decide
from m31ctl.runtime.launching import api_key_for, confirm_or_refuse, ensure_port_free, watchdog_for
from m31ctl.runtime.phases import Phase
from m31ctl.runtime.protocol import LaunchOptions, LaunchResult
from m31ctl.runtime.readiness import ServerHandle, wait_ready

S = TypeVar("S")


# Generic records are frozen dataclasses: a generic NamedTuple needs Python 3.11, m31ctl runs on 3.10.
@dataclass(frozen=True)
class Found(Generic[S]):
    """What stands under the server's name: the decision's view of it, and the runtime's own."""

    existing: ExistingServer
    server: S


class Backend(Protocol[S]):
    """One runtime's primitives for one launch (it holds the deployment and the options)."""

    def claim(self) -> contextlib.AbstractContextManager[object]:
        """Held from find to create: concurrent launches of the name are serialised, or the
        runtime's create-by-name is atomic and this is a no-op."""
        ...

    def find(self, api_key: str | None) -> Found[S] | None: ...

    def resume(self, server: S) -> None:
        """Start an adopted server that exists but was never started (a no-op if it runs)."""
        ...

    def remove(self, server: S) -> None:
        """Stop and remove a server about to be recreated."""
        ...

    def prepare(self) -> None:
        """What comes before the create and is not timed with it (the image pull)."""
        ...

    def create(self) -> S:
        """Create and start, recorded; ConflictError when the name was taken meanwhile."""
        ...

    def handle(self, server: S) -> ServerHandle: ...

    def endpoint(self, server: S) -> str: ...

    def died(self, server: S, error: ServerDied) -> ServerDied:
        """Deal with a server that died while loading; the error to raise."""
        ...

    def describe(self, server: S) -> str:
        """The server for a progress line ("NAME", "NAME (pid N)")."""
        ...

    def started(self, server: S) -> str:
        """The progress line once it started."""
        ...


class _Launch(NamedTuple):
    runtime: str
    deployment: Deployment
    options: LaunchOptions
    api_key: str | None

    def result(
        self,
        action: Action,
        endpoint: str,
        ready: bool,
        timings: dict[str, float] | None = None,
        phases: tuple[Phase, ...] = (),
    ) -> LaunchResult:
        d = self.deployment
        return LaunchResult(
            action.value, d.name, self.runtime, endpoint, d.plan.hash, ready, timings or {}, phases
        )


@dataclass(frozen=True)
class _Chosen(Generic[S]):
    """The server to follow after the decision: adopted, or created at `created_at`."""

    server: S
    action: Action
    created_at: float | None


def converge(
    runtime: str, backend: Backend[S], deployment: Deployment, options: LaunchOptions
) -> LaunchResult:
    """Converge on the deployment's plan with `backend`'s primitives; wait unless detached. The
    claim is held while deciding and acting, never while waiting."""
    launch = _Launch(runtime, deployment, options, api_key_for(deployment, options.environ))
    with backend.claim():
        chosen = _act(launch, backend)
    if isinstance(chosen, LaunchResult):
        return chosen
    if chosen.created_at is not None:
        options.report(backend.started(chosen.server))
    return _follow(launch, backend, chosen)


def _act(launch: _Launch, backend: Backend[S]) -> LaunchResult | _Chosen[S]:
    deployment, options = launch.deployment, launch.options
    plan_hash = deployment.plan.hash
    found = backend.find(launch.api_key)
    decision = decide(found.existing if found else None, plan_hash)
    confirm_or_refuse(decision, deployment.name, plan_hash, options)
    if found is not None and decision.action is Action.UNCHANGED:
        return launch.result(Action.UNCHANGED, backend.endpoint(found.server), True)
    if found is not None and decision.action is Action.ADOPT:
        return _adopt(launch, backend, found.server)
    if found is not None and decision.action is Action.RECREATE:
        options.report(f"removing {backend.describe(found.server)} ({decision.reason})")
        backend.remove(found.server)
    try:
        # A part in another container's network namespace (a P/D router behind its front, which
        # holds the port) publishes none of its own: a backend says so with `publishes = False`.
        if getattr(backend, "publishes", True):
            ensure_port_free(deployment.network.bind, deployment.network.port)
        interrupt.check()  # a stop asked for until here: nothing pulled, nothing created
        backend.prepare()
        interrupt.check()
        created_at = time.monotonic()
        return _Chosen(backend.create(), decision.action, created_at)
    except ConflictError as exc:
        return _join(launch, backend, exc)


def _join(launch: _Launch, backend: Backend[S], conflict: ConflictError) -> LaunchResult | _Chosen[S]:
    """Another launch of this name won the race (a container's create-by-name is atomic; the
    port check sees the winner once it listens): join it when it runs this plan, else refuse."""
    winner = backend.find(launch.api_key)
    joined = decide(winner.existing if winner else None, launch.deployment.plan.hash)
    if winner is None or joined.action not in (Action.ADOPT, Action.UNCHANGED):
        raise conflict
    if joined.action is Action.UNCHANGED:
        return launch.result(Action.UNCHANGED, backend.endpoint(winner.server), True)
    return _adopt(launch, backend, winner.server)


def _adopt(launch: _Launch, backend: Backend[S], server: S) -> _Chosen[S]:
    launch.options.report(f"{backend.describe(server)} runs this plan already; waiting for it")
    backend.resume(server)
    return _Chosen(server, Action.ADOPT, None)


def _follow(launch: _Launch, backend: Backend[S], chosen: _Chosen[S]) -> LaunchResult:
    """Return at once when detached; else wait until the served model answers."""
    server, action = chosen.server, chosen.action
    endpoint = backend.endpoint(server)
    if launch.options.detach:
        return launch.result(action, endpoint, False)
    d, options = launch.deployment, launch.options
    timeout = float(options.timeout if options.timeout is not None else d.timeline.ready_s)
    try:
        timings, phases = wait_ready(
            backend.handle(server),
            endpoint,
            d.plan.settings.model.served_name,
            timeout,
            options.report,
            launch.api_key,
            on_phase=options.on_phase,
            watchdog=watchdog_for(d, options.diagnostics),
        )
    except ServerDied as exc:
        raise backend.died(server, exc) from None
    if chosen.created_at is not None:
        timings["total_since_create"] = time.monotonic() - chosen.created_at
    return launch.result(action, endpoint, True, timings, phases)
