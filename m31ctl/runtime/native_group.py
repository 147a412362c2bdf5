"""A prefill/decode group on the native runtime (issue 36), run as one deployment.

Launch converges each role engine exactly as an aggregated native engine is converged (its own
record, log, environment and readiness wait: runtime/native.py's launch primitives), prefill
then decode, and only once both answer starts vllm-router in front of them (the pair's command
line natively, m31ctl/pair.py: the roles on their loopback ports, the router on a free loopback
port of its own) and then its front (engine/router_front.py, issue 49: vllm-router checks no key
and serves worker management), which takes the plan's bind and port, and waits for the served
model to answer through both. The front's record is the group's: it carries the group's name,
plan, endpoint, and the names of the other parts' records (`parts`: NAME-router, then the roles);
each part's record names its group. So `status` shows the group and each part, `stop` stops the
front, the router (no new requests reach the roles) and then the roles, and a part that
dies while the group starts stops every part of the group before the error goes on: nothing of
a half-started group keeps running.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from m31ctl import interrupt
from m31ctl.deployment import Deployment, Disaggregated
from m31ctl.engine.router import LOOPBACK, ROUTER_EXECUTABLE
from m31ctl.errors import HostPreconditionError, M31Error
from m31ctl.pair import ROUTER_API_KEY_ENV, loopback_front_invocation, loopback_router_invocation, on_one_host
from m31ctl.runtime.flow import converge
from m31ctl.runtime.native import (
    NativeRuntime,
    ProcessHandle,
    ProcessLaunch,
    command,
    server_named,
    server_status,
    stop_server,
)
from m31ctl.runtime.native_state import NativeServer, claim, load, process_identity, recorded, save
from m31ctl.runtime.protocol import DryRun, LaunchOptions, LaunchResult, Reporter, ServerStatus

RUNTIME = "native"
# vllm-router renames its process (vllm_router/launch_router.py: setproctitle("vllm::router"),
# before it listens), which changes the command line a record's identity hashes: the record is
# written once the new title shows. How long that may take at most on a loaded host; a router
# that never renames itself is recorded as started once this has passed.
ROUTER_TITLE_WAIT_S = 120.0


def router_executable(python: str) -> str | None:
    """vllm-router next to runtime.native_python (its wheel installs the console script in the
    same bin directory, scripts/setup-vllm), else on PATH; None when neither has it."""
    beside = Path(python).parent / ROUTER_EXECUTABLE
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(ROUTER_EXECUTABLE)


def _free_port(bind: str) -> int:
    """A port the kernel has free now on `bind` (the router's exporter exits when its port is
    taken, so a fixed default would clash with a second group on the host)."""
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    with socket.socket(family) as s:
        s.bind((bind, 0))
        return int(s.getsockname()[1])


def _group(deployment: Deployment) -> Disaggregated:
    group = deployment.disaggregated
    assert group is not None, "a P/D group's deployment"
    return group


class _RouterLaunch(ProcessLaunch):
    """vllm-router as a supervised process, a part of the group under its own name (NAME-router):
    the same primitives as an engine's, with the router's command line on loopback at `port`
    behind its front, and the roles' key, where the plan has one, as vllm-router reads it."""

    # On loopback: the group's port is its front's (flow.py checks that one for the front).
    publishes = False

    def __init__(
        self, deployment: Deployment, options: LaunchOptions, executable: str, metrics_port: int, port: int
    ) -> None:
        super().__init__(deployment, options, group=deployment.name)
        self.name = _group(deployment).router.name
        self.executable = executable
        self.metrics_port = metrics_port
        self.port = port

    def argv(self) -> list[str]:
        invocation = loopback_router_invocation(
            _group(self.deployment), self.metrics_port, behind_front=self.port
        )
        return [self.executable, *invocation.argv[1:]]

    def own_env(self) -> Mapping[str, str]:
        return router_key_env(self.deployment, self.options.environ)

    def listens(self) -> tuple[str, int]:
        return LOOPBACK, self.port

    def settle(self, child: subprocess.Popen[bytes]) -> None:
        _await_retitle(child)

    def remove(self, server: NativeServer) -> None:
        # A router of another plan: only it goes; the roles were converged on this plan already.
        stop_server(server, server.stop_timeout, self.options.report)


def router_key_env(deployment: Deployment, environ: Mapping[str, str]) -> dict[str, str]:
    """The roles' key as vllm-router sends it to them (ROUTER_API_KEY_ENV), from the variable
    they read it from: in the router's environment alone, never in its argv or record."""
    name = deployment.secrets.api_key
    return {ROUTER_API_KEY_ENV: environ[name]} if name and environ.get(name) else {}


class _FrontLaunch(ProcessLaunch):
    """The router's front (engine/router_front.py, issue 49) under the group's name, its one
    endpoint on the plan's bind and port, forwarding to the router on loopback at `router_port`.
    Its record is the group's: the plan, the endpoint and the parts (router first, as stop
    goes). Run by the roles' Python (the router's environment); the key, where the plan has one,
    it reads by name from the environment it inherits, as the roles do."""

    def __init__(self, deployment: Deployment, options: LaunchOptions, python: str, router_port: int) -> None:
        super().__init__(deployment, options)
        self.python = python
        self.router_port = router_port

    def argv(self) -> list[str]:
        return [self.python, *loopback_front_invocation(self.deployment, self.router_port).argv[1:]]

    def own_env(self) -> Mapping[str, str]:
        return {}

    def record_extra(self) -> dict[str, Any]:
        group = _group(self.deployment)
        return {"parts": (group.router.name, *(role.name for role in group.roles))}

    def remove(self, server: NativeServer) -> None:
        stop_server(server, server.stop_timeout, self.options.report)


def _forwards_to(front: NativeServer, port: int) -> bool:
    """Whether the group's recorded front forwards to the router at loopback `port` (a front of
    an earlier router, or a router recorded under the group's name before it had a front, does not)."""
    argv = list(front.argv)
    flag = "--upstream-port"
    return flag in argv[:-1] and argv[argv.index(flag) + 1] == str(port)


def _await_retitle(child: subprocess.Popen[bytes]) -> None:
    """Until our child's command line differs from the one it started with (its new title), it
    exits, or ROUTER_TITLE_WAIT_S pass."""
    started = process_identity(child.pid)
    deadline = time.monotonic() + ROUTER_TITLE_WAIT_S
    while child.poll() is None and time.monotonic() < deadline:
        now = process_identity(child.pid)
        if now is not None and now != started:
            return
        interrupt.sleep(0.1)


def _refresh_identity(launch: ProcessLaunch) -> None:
    """A router that renamed itself later than _await_retitle waited: once it answers, and while
    it is still our own child (so the pid is certain), its record takes the identity it has now."""
    child = launch.child
    server = load(launch.name)
    if child is None or server is None or server.pid != child.pid or child.poll() is not None:
        return
    now = process_identity(child.pid)
    if now is not None and now != server.identity:
        with claim(launch.name):
            save(dataclasses.replace(server, identity=now))


def launch_group(deployment: Deployment, options: LaunchOptions) -> LaunchResult:
    group = on_one_host(deployment, "launch")
    python = deployment.plan.settings.runtime.native_python or sys.executable
    executable = router_executable(python)
    if executable is None:
        raise HostPreconditionError(
            f"{ROUTER_EXECUTABLE} is neither beside runtime.native_python ({python}) nor on PATH: "
            "the P/D group needs it in front of its roles",
            hint=f"install it into that Python's environment: {Path(python).parent / 'pip'} install vllm-router",
        )
    router = group.router
    metrics_port = router.metrics_port or _free_port(router.network.bind)
    # The router's own port, behind its front on loopback: free now, as groups share loopback.
    router_port = _free_port(LOOPBACK)
    # The router needs both roles answering: each role is waited for even when launch is detached.
    role_options = dataclasses.replace(options, detach=False)
    launches: list[ProcessLaunch] = []
    parts = [router.name, *(role.name for role in group.roles)]
    try:
        for role in group.roles:
            launches.append(ProcessLaunch(role, role_options, group=deployment.name))
            converge(RUNTIME, launches[-1], role, role_options)
        launches.append(_RouterLaunch(deployment, options, executable, metrics_port, router_port))
        routed = converge(RUNTIME, launches[-1], deployment, options)
        if routed.ready:
            _refresh_identity(launches[-1])
        running = load(router.name)  # this launch's router, or the one that runs the plan already
        assert running is not None, "the router converged"
        front = load(deployment.name)
        if front is not None and not _forwards_to(front, running.port):
            stop_server(front, front.stop_timeout, options.report)
        launches.append(_FrontLaunch(deployment, options, python, running.port))
        return converge(RUNTIME, launches[-1], deployment, options)
    except M31Error as exc:
        if not any(launch.child is not None for launch in launches):
            raise  # refused before anything of this launch started: what ran before is untouched
        stopped = _stop_parts(deployment.name, parts, options.report)
        exc.message = f"P/D group {deployment.name}: {exc.message}; stopped the group" + (
            f" ({', '.join(stopped)})" if stopped else ""
        )
        raise


def _stop_parts(name: str, parts: Sequence[str], report: Reporter) -> list[str]:
    """Stop the front and the parts recorded for group `name` (router, then roles), front first;
    the names stopped."""
    stopped = []
    for part in (name, *parts):
        server = load(part)
        if server is None:
            continue
        try:
            stop_server(server, server.stop_timeout, report)
            stopped.append(part)
        except M31Error as exc:
            report(f"also not stopped: {exc.one_line()}")
    return stopped


def stop_group(server: NativeServer, timeout: int | None, report: Reporter) -> None:
    """The front first (no new requests reach the router), then each part, the router before the
    roles (no new requests reach them), each drained for `timeout` (else its own stop timeout). A part that cannot be stopped is raised after the
    others were tried."""
    stop_server(server, timeout if timeout is not None else server.stop_timeout, report)
    refused: list[M31Error] = []
    for part in server.parts:
        role = load(part)
        if role is None:
            continue
        try:
            stop_server(role, timeout if timeout is not None else role.stop_timeout, report)
        except M31Error as exc:
            refused.append(exc)
    if refused:
        raise refused[0]


def statuses(records: Sequence[NativeServer]) -> list[ServerStatus]:
    """Each record as status shows it: a group's row (its state says which part is down), then
    a row per part; a part whose group record is gone stands alone (so it can be stopped)."""
    by_name = {r.name: r for r in records}
    in_groups = {part for r in records for part in r.parts}
    rows: list[ServerStatus] = []
    for record in records:
        if record.name in in_groups:
            continue
        row = server_status(record)
        parts = [(part, by_name.get(part)) for part in record.parts]
        down = [part for part, role in parts if role is None or not role.alive()]
        if record.parts and row.running and down:
            row = dataclasses.replace(row, state=f"degraded: {', '.join(down)} down", health=None)
        rows.append(row)
        for part, role in parts:
            if role is None:
                rows.append(
                    ServerStatus(part, RUNTIME, "missing", None, None, None, None, None, group=record.name)
                )
            else:
                rows.append(dataclasses.replace(server_status(role), group=record.name))
    return rows


def write_logs(server: NativeServer, tail: int, write: Callable[[str], None]) -> None:
    """Each part's last lines under a header naming it, the router and the roles first, the front last."""
    for part in (*server.parts, server.name):
        record = server if part == server.name else load(part)
        if record is None:
            write(f"==> {part}: no record <==\n")
            continue
        write(f"==> {part} ({record.log}) <==\n")
        write(ProcessHandle(record).log_tail(tail))


def dry_run_group(deployment: Deployment) -> DryRun:
    """The four command lines: each role's (as an engine's), the router's on loopback and its
    front's on the plan's port (the router's port and metrics port 0 where launch picks free ones)."""
    group = on_one_host(deployment, "launch")
    python = deployment.plan.settings.runtime.native_python or sys.executable
    executable = router_executable(python) or ROUTER_EXECUTABLE
    router = loopback_router_invocation(group, group.router.metrics_port, behind_front=0)
    front_argv = [python, *loopback_front_invocation(deployment, 0).argv[1:]]
    detail = {
        "prefill": command(group.prefill),
        "decode": command(group.decode),
        "router": [executable, *router.argv[1:]],
        "front": front_argv,
    }
    return DryRun("process", tuple(front_argv), detail)


class NativeGroupRuntime(NativeRuntime):
    """The native runtime (registered as `native`), which also runs a P/D plan as one deployment;
    an aggregated plan is NativeRuntime's, unchanged."""

    runs_groups = True

    def dry_run(self, deployment: Deployment) -> DryRun:
        if deployment.disaggregated is not None:
            return dry_run_group(deployment)
        return super().dry_run(deployment)

    def launch(self, deployment: Deployment, options: LaunchOptions) -> LaunchResult:
        if deployment.disaggregated is not None and not deployment.simulated:
            return launch_group(deployment, options)
        return super().launch(deployment, options)

    def servers(self) -> list[ServerStatus]:
        return statuses(recorded())

    def _write_tail(self, server: NativeServer, tail: int, write: Callable[[str], None]) -> None:
        if server.parts:
            write_logs(server, tail, write)  # each part's
        else:
            super()._write_tail(server, tail, write)

    def _followed(self, server: NativeServer) -> list[tuple[str, str]]:
        """A group's parts, each under its name (the front's record is the group's own)."""
        if not server.parts:
            return super()._followed(server)
        records = [(part, load(part)) for part in server.parts]
        return [(part, r.log) for part, r in records if r is not None] + [(server.name, server.log)]

    def stop(self, name: str, timeout: int | None, keep: bool, report: Reporter) -> None:
        server = server_named(name)
        if server.parts:
            stop_group(server, timeout, report)
        else:
            super().stop(name, timeout, keep, report)
