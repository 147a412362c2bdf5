"""Runtimes behind one registry: `docker` (a container on the Docker Engine) and `native` (vLLM
from a local Python). A new runtime is one module with a class that follows base.Runtime, plus
one line in RUNTIMES; commands never branch on the runtime's name.

Without a runtime name, `status`, `logs`, `stop` and `smoke` look for m31ctl servers in every
runtime. One that cannot be asked (the Docker Engine is down) is reported as unreachable: a
command whose answer would then be incomplete says so with its exit code (3) after doing what
it could.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from m31ctl.errors import (
    CheckFailed,
    ConflictError,
    DockerUnreachable,
    HostPreconditionError,
    InputError,
    M31Error,
)
from m31ctl.names import check_name
from m31ctl.netaddr import port_free
from m31ctl.plan import Plan
from m31ctl.runtime import bluegreen
from m31ctl.runtime.planrecord import plan_differences, recorded_plan
from m31ctl.runtime.protocol import Reporter, Runtime, ServerStatus

if TYPE_CHECKING:
    from m31ctl.deployment import Deployment

# name -> (module, class): imported on use, so the Docker SDK loads only when Docker is asked.
RUNTIMES: dict[str, tuple[str, str]] = {
    "docker": ("m31ctl.runtime.docker", "DockerRuntime"),
    "native": ("m31ctl.runtime.native_group", "NativeGroupRuntime"),
}
DEFAULT_RUNTIME = "docker"


def get_runtime(name: str) -> Runtime:
    if name not in RUNTIMES:
        raise InputError(f"unknown --runtime {name!r}", hint=f"choose one of: {', '.join(RUNTIMES)}")
    module, cls = RUNTIMES[name]
    runtime: Runtime = getattr(importlib.import_module(module), cls)()
    return runtime


@dataclass(frozen=True)
class Survey:
    """Our servers in the runtimes asked, and the runtimes that could not be asked (and why)."""

    servers: tuple[ServerStatus, ...]
    unreachable: dict[str, M31Error] = field(default_factory=dict)

    def raise_if_incomplete(self) -> None:
        for error in self.unreachable.values():
            raise error

    def exit_code(self) -> int:
        """0, or the exit code of a runtime that could not be asked (3: the Docker Engine)."""
        codes = [int(error.exit_code) for error in self.unreachable.values()]
        return max(codes) if codes else 0


def survey(runtime: str | None = None) -> Survey:
    """Every m31ctl server in `runtime`, or in all runtimes. A named runtime that cannot be asked
    raises; without a name, it is recorded and the others still answer."""
    if runtime is not None:
        return Survey(tuple(get_runtime(runtime).servers()))
    found: list[ServerStatus] = []
    unreachable: dict[str, M31Error] = {}
    for name in RUNTIMES:
        try:
            found.extend(get_runtime(name).servers())
        except DockerUnreachable as exc:
            unreachable[name] = exc
    return Survey(tuple(found), unreachable)


def select(name: str | None, runtime: str | None) -> tuple[list[ServerStatus], Survey]:
    """The servers a command acts on: the named one wherever it runs, or all of ours."""
    if name is not None:
        check_name(name, "--name")
    found = survey(runtime)
    chosen = [s for s in found.servers if name is None or s.name == name]
    if name is not None and not chosen:
        found.raise_if_incomplete()  # it may run where we could not look
        for asked in [runtime] if runtime else list(RUNTIMES):
            if get_runtime(asked).foreign(name):
                raise ConflictError(f"{name} was not created by m31ctl; not touching it")
        raise HostPreconditionError(f"no m31ctl server named {name}", hint="see `m31ctl status`")
    return chosen, found


def _whole(servers: list[ServerStatus]) -> list[ServerStatus]:
    """The servers to act on as deployments: a P/D group's parts go with their group when it is
    chosen too (stop and logs act on the group)."""
    chosen = {s.name for s in servers}
    return [s for s in servers if s.group is None or s.group not in chosen]


def stop(
    name: str | None, runtime: str | None, timeout: int | None, keep: bool, report: Reporter
) -> tuple[list[str], Survey]:
    """Stop the named server, or all of ours. One that cannot be stopped (a stale record whose pid
    cannot be confirmed) does not keep the others running: each is tried, then the first
    refusal is raised (the others were reported)."""
    servers, found = select(name, runtime)
    servers = _whole(servers)
    refused: list[M31Error] = []
    for server in servers:
        try:
            get_runtime(server.runtime).stop(server.name, timeout, keep, report)
        except M31Error as exc:
            if refused:
                report(f"also not stopped: {exc.one_line()}")
            refused.append(exc)
    if refused:
        raise refused[0]
    still = [s.name for s in survey(runtime).servers if s.name in {x.name for x in servers} and s.running]
    if still:
        raise CheckFailed(f"{', '.join(still)} still running after stop", hint="see `m31ctl status`")
    return [s.name for s in servers], found


def logs(
    name: str | None, runtime: str | None, follow: bool, tail: int, write: Callable[[str], None]
) -> Survey:
    servers, found = select(name, runtime)
    servers = _whole(servers)
    if not servers:  # unnamed, and none at all: say so, as a name that runs nowhere does
        found.raise_if_incomplete()
        where = f"in the {runtime} runtime " if runtime else ""
        raise HostPreconditionError(
            f"no m31ctl server {where}has a log to print",
            hint="see `m31ctl status`; `m31ctl launch` starts one",
        )
    if follow and len(servers) > 1:
        raise InputError(
            f"--follow needs one server, and {len(servers)} run", hint="pass --name (see `m31ctl status`)"
        )
    for server in servers:
        get_runtime(server.runtime).logs(server.name, follow, tail, write)
    return found


def running_server(name: str | None, runtime: str | None) -> ServerStatus:
    """The one running server (or the named one), wherever it runs."""
    servers, found = select(name, runtime)
    # Unnamed, a P/D group is its router's endpoint, not its parts'.
    running = [s for s in servers if s.running and s.endpoint and (name is not None or s.group is None)]
    if len(running) != 1:
        if not running:
            found.raise_if_incomplete()
        names = ", ".join(s.name for s in running) or "none"
        raise HostPreconditionError(
            f"need exactly one running m31ctl server, found {names}", hint="pass --name or --url"
        )
    return running[0]


def compare_plans(found: Survey, asked: Plan) -> dict[str, tuple[str, ...]]:
    """Per server (by name): what the asked plan changes in the plan it runs, 'key: server's ->
    asked', empty when it runs the asked plan. A server with no record (launched by an older
    m31ctl) can only be compared by hash."""
    out: dict[str, tuple[str, ...]] = {}
    for server in found.servers:
        if server.plan_hash == asked.hash:
            out[server.name] = ()
        elif server.plan is None:
            out[server.name] = (
                f"plan: {server.plan_hash or '?'} -> {asked.hash} (no recorded plan to compare)",
            )
        else:
            try:
                out[server.name] = plan_differences(recorded_plan(server.plan), asked) or (
                    f"plan: {server.plan_hash} -> {asked.hash}",
                )
            except InputError as exc:
                out[server.name] = (exc.message,)
    return out


def refuse_conflicts(d: Deployment, runtime: str, yes: bool, interactive: Callable[[], bool]) -> None:
    """What refuses a launch and costs a look, before the preflight's seconds of checks: a server
    of this name running another plan that may not be replaced (no --yes, and no terminal to
    ask: `interactive`), with the settings that differ; a port that something else listens on.
    The runtime's own decision after the preflight still rules (a race, a terminal's answer)."""
    try:
        found = get_runtime(runtime).servers()
    except M31Error:
        return  # an engine that cannot be asked: the preflight says so, with its fix
    same_name = [s for s in found if s.name == d.name]
    green = bluegreen.slots(d.name)[1]
    if any(s.name == green and s.running for s in found):
        raise ConflictError(
            f"{green} serves {d.name}'s deployment (a launch --blue-green put it there); a plain launch "
            f"would start a second server beside it",
            hint="launch with --blue-green to change it, or stop it first (m31ctl stop --name " + green + ")",
        )
    if same_name:
        server = same_name[0]
        if server.running and server.plan_hash != d.plan.hash and not yes and not interactive():
            changed = compare_plans(Survey((server,)), d.plan)[server.name]
            raise ConflictError(
                f"{d.name} runs plan {server.plan_hash}, not {d.plan.hash}; not replaced ("
                + "; ".join(changed)
                + ")",
                hint="pass --yes to recreate it with this plan, or --name for another server",
            )
        return  # its port is its own
    network = d.network
    if not port_free(network.bind, network.port):
        raise ConflictError(
            f"port {network.bind}:{network.port} is in use", hint="pass --port, or stop what listens there"
        )


def running_endpoint(name: str | None, runtime: str | None) -> str:
    """The endpoint of the one running server (or of the named one)."""
    return str(running_server(name, runtime).endpoint)


__all__ = [
    "DEFAULT_RUNTIME",
    "RUNTIMES",
    "Survey",
    "compare_plans",
    "get_runtime",
    "logs",
    "running_endpoint",
    "running_server",
    "stop",
    "survey",
]
