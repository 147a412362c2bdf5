"""The `native` runtime: vLLM from a local Python as a supervised process.

It behaves like the container runtime: the same plan, argv (from the engine adapter), launch flow
(runtime/flow.py) and readiness; a record per server (runtime/native_state.py: pid and the
process's identity, plan, port, log) stands in for the container's labels, so status, logs and
stop act on our processes only, a relaunch of the same plan changes nothing, and a pid that cannot
be confirmed as the process m31ctl started is never signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from m31ctl import interrupt
from m31ctl.deployment import Deployment
from m31ctl.engine.adapter import build_invocation, native_command
from m31ctl.errors import CheckFailed, ConflictError, HostPreconditionError, ServerDied
from m31ctl.hardware import Platform
from m31ctl.runtime.converge import ExistingServer
from m31ctl.runtime.flow import Found, converge
from m31ctl.runtime.gates import CheckId
from m31ctl.runtime.launching import LAUNCH_ENV
from m31ctl.runtime.load_run import BenchRunner, native_bench
from m31ctl.runtime.native_identity import python_identity
from m31ctl.runtime.native_state import (
    Liveness,
    NativeServer,
    claim,
    follow_logs,
    forget,
    group_runs,
    load,
    process_identity,
    recorded,
    save,
    state_dir,
)
from m31ctl.runtime.planrecord import PlanRecord, record_of
from m31ctl.runtime.protocol import (
    DryRun,
    LaunchOptions,
    LaunchResult,
    Reporter,
    ScriptRun,
    ServerStatus,
)
from m31ctl.runtime.readiness import ProcessState, health, models

# After SIGKILL, how long the kernel may take to reap the process group before stop gives up.
# Not 5 s: a P/D prefill vLLM whose interpreter hung in its teardown after "Application shutdown
# complete" (NIXL/UCX, 1 GiB of registered KV cache) was SIGKILLed and still had a live member 5 s
# later on this loaded 2-core host, gone a few seconds after that; stop then failed with exit 1
# although nothing was stuck. The wait ends as soon as the group is gone.
KILL_GRACE_S = 30.0
# How long an engine we started but could not record gets to leave on SIGTERM before SIGKILL.
ABANDON_GRACE_S = 5.0

# What the native P/D group (runtime/native_group.py) and the rest of m31ctl build on.
__all__ = [
    "NativeRuntime",
    "NativeServer",
    "ProcessHandle",
    "ProcessLaunch",
    "command",
    "process_identity",
    "run_script",
    "server_named",
    "server_status",
    "stop_server",
]


# How far `log_tail` reads back at a time.
LOG_BLOCK = 64 * 1024


class ProcessHandle:
    """A native server as readiness sees it; exit codes come from our own child when we have it."""

    kind = "process"

    def __init__(
        self, server: NativeServer, child: subprocess.Popen[bytes] | None = None, since: int = 0
    ) -> None:
        self.server = server
        self.child = child
        self.name = server.name
        # Where this start's lines begin in the log (one log per name, appended start after
        # start): readiness must not read the last start's "serving" as this one's phase.
        self.since = since

    def state(self) -> ProcessState:
        if self.child is not None:
            code = self.child.poll()
            return ProcessState(running=code is None, dead=code is not None, exit_code=code)
        alive = self.server.alive()
        return ProcessState(running=alive, dead=not alive)

    def log_tail(self, lines: int) -> str:
        """The last `lines` lines this start wrote: read back from the end a block at a time until
        they are in hand (`logs --tail 5000` after a crash's tracebacks is far more than one
        block; the soak's "the restart is in the logs" failed in CI on a fixed 64 KiB window)."""
        try:
            with open(self.server.log, "rb") as handle:
                end = handle.seek(0, os.SEEK_END)
                floor = self.since if self.since <= end else 0  # cut shorter: all of it is ours
                data = b""
                while end > floor and data.count(b"\n") <= lines:
                    start = max(floor, end - LOG_BLOCK)
                    handle.seek(start)
                    data = handle.read(end - start) + data
                    end = start
                text = data.decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:]) + "\n"


def command(deployment: Deployment) -> list[str]:
    runtime = deployment.plan.settings.runtime
    return native_command(deployment, runtime.native_python or sys.executable)


def _existing(server: NativeServer, served: str, api_key: str | None) -> ExistingServer:
    liveness = server.liveness()
    alive = liveness is Liveness.RUNNING
    return ExistingServer(
        owned=True,  # records are ours by construction
        plan_hash=server.plan_hash,
        state=liveness.value,
        serving=alive and served in (models(server.base, api_key) or []),
    )


class ProcessLaunch:
    """The native runtime's launch primitives for one process (runtime/flow.py runs the flow): an
    engine, or a P/D role of `group`. A launch of another process (the P/D router) subclasses it
    and overrides what differs: argv, own_env, listens, record_extra, settle, remove."""

    def __init__(self, deployment: Deployment, options: LaunchOptions, group: str | None = None) -> None:
        self.deployment = deployment
        self.options = options
        self.name = deployment.name
        self.group = group  # the P/D group this engine is a role of (its record says so)
        self.child: subprocess.Popen[bytes] | None = None
        self.log_start = 0  # the engine log's size when this launch started its engine

    def argv(self) -> list[str]:
        return command(self.deployment)

    def own_env(self) -> Mapping[str, str]:
        """What the process's own invocation sets, over the inherited environment: the plan's,
        and the GPUs it was given by index (a P/D role's, a blue-green successor's)."""
        return {**pinned_gpus(self.deployment), **dict(build_invocation(self.deployment).env)}

    def claim(self) -> contextlib.AbstractContextManager[object]:
        return claim(self.name)

    def find(self, api_key: str | None) -> Found[NativeServer] | None:
        server = load(self.name)
        if server is None:
            return None
        return Found(_existing(server, self.deployment.plan.settings.model.served_name, api_key), server)

    def resume(self, server: NativeServer) -> None:
        pass  # a process is started when it is created

    def remove(self, server: NativeServer) -> None:
        stop_server(server, server.stop_timeout, self.options.report)

    def prepare(self) -> None:
        pass

    def create(self) -> NativeServer:
        """Start the engine, then record it. An engine that cannot be recorded (a full disk, an
        interrupt) is stopped again before the error goes on: nothing runs that m31ctl does not
        know of."""
        d = self.deployment
        argv = self.argv()
        log_path = state_dir() / f"{self.name}.log"
        self.log_start = log_path.stat().st_size if log_path.is_file() else 0
        # What launch itself sets for this start (LAUNCH_ENV: offline mode, the engine-ready
        # limit of an engine that downloads) wins over the plan's, as the container runtime's does.
        launch_set = {
            name: self.options.environ[name] for name in LAUNCH_ENV if self.options.environ.get(name)
        }
        env = {**self.options.environ, "HF_HOME": d.hf_cache, **dict(self.own_env()), **launch_set}
        try:
            with open(log_path, "ab") as log:
                # A session of its own: Ctrl-C on m31ctl leaves the server running, as a container would.
                child = subprocess.Popen(
                    argv,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
        except OSError as exc:
            raise HostPreconditionError(
                f"cannot start the engine: {exc.strerror or exc} ({exc.filename or argv[0]})",
                hint="check runtime.native_python, and that M31CTL_STATE_DIR is writable",
            ) from None
        try:
            self.settle(child)
            server = self._record(child, argv, str(log_path))
        except BaseException as exc:
            _abandon(child)
            if isinstance(exc, HostPreconditionError):
                raise HostPreconditionError(
                    f"{exc.message}; the engine it had started (pid {child.pid}) was stopped",
                    hint=exc.hint,
                ) from None
            raise
        self.child = child
        return server

    def _record(self, child: subprocess.Popen[bytes], argv: list[str], log: str) -> NativeServer:
        d = self.deployment
        plan = d.plan
        server = NativeServer(
            name=self.name,
            pid=child.pid,
            plan_hash=plan.hash,
            recipe=plan.recipe.recipe,
            variant=plan.variant,
            profile=plan.profile,
            bind=self.listens()[0],
            port=self.listens()[1],
            log=log,
            argv=tuple(argv),
            started_at=time.time(),
            stop_timeout=d.timeline.stop_s,
            identity=process_identity(child.pid),
            plan=record_of(d, os.getcwd()).to_json(),
            group=self.group,
            gpus=tuple(str(i) for i in d.gpus.indices),
            **self.record_extra(),
        )
        save(server)
        return server

    def listens(self) -> tuple[str, int]:
        """Where the process answers (its record's bind and port): the plan's."""
        return self.deployment.network.bind, self.deployment.network.port

    def settle(self, child: subprocess.Popen[bytes]) -> None:
        """Before the record is written: wait until what it records of the process is final."""

    def record_extra(self) -> dict[str, Any]:
        """Fields of the record beyond an engine's."""
        return {}

    def handle(self, server: NativeServer) -> ProcessHandle:
        own = self.child if self.child is not None and self.child.pid == server.pid else None
        return ProcessHandle(server, own, since=self.log_start if own is not None else 0)

    def endpoint(self, server: NativeServer) -> str:
        return server.base

    def died(self, server: NativeServer, error: ServerDied) -> ServerDied:
        return error  # the process is gone; its record says so, and the next launch replaces it

    def describe(self, server: NativeServer) -> str:
        return f"{server.name} (pid {server.pid})"

    def started(self, server: NativeServer) -> str:
        return f"started {server.name} (pid {server.pid}): {' '.join(server.argv[:3])}; log {server.log}"


# NVML and nvidia-smi number GPUs by PCI bus ID, CUDA by default fastest first (CUDA's
# programming guide, "CUDA Environment Variables"): an index the probe read means the same GPU
# to CUDA only in the bus order.
_CUDA_ORDER = ("CUDA_DEVICE_ORDER", "PCI_BUS_ID")


def pinned_gpus(deployment: Deployment) -> dict[str, str]:
    """The vendor's visibility variable for the host GPU indices the deployment was given (a
    container gets them by device request instead); nothing where it was given none, or where
    the plan's runtime.env names the GPUs itself (the user's choice)."""
    pick, indices = deployment.vendor.pick_var, deployment.gpus.indices
    planned = dict(deployment.plan.settings.runtime.env)
    if pick is None or not indices or any(v in planned for v in deployment.vendor.visibility_vars):
        return {}
    env = {pick: ",".join(str(i) for i in indices)}
    if deployment.vendor.platform is Platform.CUDA:
        env.update([_CUDA_ORDER])
    return env


def _abandon(child: subprocess.Popen[bytes]) -> None:
    """Stop an engine we started and could not record: our own child, so its pid is certain."""
    for sig, grace in ((signal.SIGTERM, ABANDON_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, sig)
        try:
            child.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


class NativeRuntime:
    name = "native"
    gates = (CheckId.GPUS, CheckId.GPU_MEMORY, CheckId.MIG, CheckId.DISK, CheckId.CAPACITY, CheckId.API_KEY)

    # A P/D group: runtime/native_group.py's NativeGroupRuntime, the registered one, runs it.
    runs_groups = False

    def dry_run(self, deployment: Deployment) -> DryRun:
        return DryRun("process", tuple(command(deployment)), {"command": command(deployment)})

    def launch(self, deployment: Deployment, options: LaunchOptions) -> LaunchResult:
        if deployment.simulated:
            raise HostPreconditionError(
                "the native runtime runs on this host's own hardware",
                hint="drop --hardware (or use --hardware cpu for the rehearsal)",
            )
        return converge(self.name, ProcessLaunch(deployment, options), deployment, options)

    def servers(self) -> list[ServerStatus]:
        return [server_status(s) for s in recorded()]

    def foreign(self, name: str) -> bool:
        return False  # every record was written by m31ctl

    def logs(self, name: str, follow: bool, tail: int, write: Callable[[str], None]) -> None:
        server = server_named(name)
        self._write_tail(server, tail, write)
        if follow:
            follow_logs(server, self._followed(server), write)

    def _followed(self, server: NativeServer) -> list[tuple[str, str]]:
        """(label, path) of each log `--follow` reads: the server's own ("" : no header)."""
        return [("", server.log)]

    def stop(self, name: str, timeout: int | None, keep: bool, report: Reporter) -> None:
        server = server_named(name)
        stop_server(server, timeout if timeout is not None else server.stop_timeout, report)

    def _write_tail(self, server: NativeServer, tail: int, write: Callable[[str], None]) -> None:
        write(ProcessHandle(server).log_tail(tail))

    def bench_runner(self, deployment: Deployment, shared: Sequence[str] = ()) -> BenchRunner:
        del shared  # the same file system: nothing to share
        return native_bench(deployment.plan.settings.runtime.native_python or sys.executable)

    def run_engine_script(
        self,
        deployment: Deployment,
        script: Path,
        args: Sequence[str],
        timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> ScriptRun:
        return run_script(deployment, script, args, timeout, env)

    def engine_identity(self, deployment: Deployment) -> str | None:
        return python_identity(deployment.plan.settings.runtime.native_python or sys.executable)


def server_status(s: NativeServer) -> ServerStatus:
    """A record as `status` shows it."""
    liveness = s.liveness()
    alive = liveness is Liveness.RUNNING
    return ServerStatus(
        name=s.name,
        runtime=NativeRuntime.name,
        state=liveness.value,
        plan_hash=s.plan_hash,
        recipe=s.recipe,
        variant=s.variant,
        profile=s.profile,
        endpoint=s.base,
        health=health(s.base, timeout=1.0) if alive else None,
        started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s.started_at)),
        pid=s.pid,
        plan=PlanRecord.parse(s.plan),
        gpus=s.gpus,
    )


def server_named(name: str) -> NativeServer:
    """The record of server `name`, refused (exit 6) where there is none."""
    server = load(name)
    if server is None:
        raise HostPreconditionError(f"no native m31ctl server named {name}", hint="see `m31ctl status`")
    return server


def stop_server(server: NativeServer, timeout: int, report: Reporter) -> None:
    """SIGTERM to the process group (vLLM drains), then SIGKILL after the timeout, only to a
    process confirmed as the one m31ctl started. The record goes once the process is gone; a
    process that survives SIGKILL fails the stop; a live pid that cannot be confirmed is never
    signalled: the record is reported as stale, with the way to remove it. A server that is gone
    but left processes of its group running (a killed API server's engine core) has those
    stopped the same way."""
    liveness = server.liveness()
    if liveness is Liveness.UNCONFIRMED:
        raise ConflictError(
            f"{server.name}: its record names pid {server.pid}, which runs but cannot be confirmed as the "
            "server m31ctl started (the record lacks its boot, start time or command line, or /proc "
            "cannot tell); not signalled",
            hint=f"if that server is gone, remove the stale record: rm {server.path}",
        )
    orphans = liveness is Liveness.GONE and server.orphans()
    if liveness is Liveness.RUNNING or orphans:
        what = f"the processes left of {server.name}'s group" if orphans else f"{server.name}"
        report(f"stopping {what} (pid {server.pid}: SIGTERM, then SIGKILL after {timeout} s)")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        if not _wait_gone(server, timeout):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            if not _wait_gone(server, KILL_GRACE_S):
                raise CheckFailed(
                    f"{server.name} (pid {server.pid}) is still running after SIGKILL",
                    hint="it may be stuck in the kernel (D state); see `ps -o stat -p PID`",
                )
    forget(server)


def _wait_gone(server: NativeServer, seconds: float) -> bool:
    """The server and every process of its group: vLLM's multiprocessing resource tracker
    ignores SIGTERM and outlives the server by seconds, and a stop that returned before it went
    left a process of the server running (the soak saw it). A group outlives its leader only
    while members remain, so its id names no one else's processes meanwhile."""
    deadline = time.monotonic() + seconds
    while server.alive() or group_runs(server.pid):
        if time.monotonic() >= deadline:
            return False
        interrupt.sleep(0.2)  # Ctrl-C leaves the drain to the engine (its record stays)
    return True


def run_script(
    deployment: Deployment,
    script: Path,
    args: Sequence[str],
    timeout: float,
    env: Mapping[str, str] | None = None,
) -> ScriptRun:
    """`script` with the native runtime's Python (runtime.native_python, else this one) and the
    environment launch gives the server, plus the plan's Hugging Face cache (what a script
    reads of the checkpoint comes from there) and `env`. A session of its own, so a hang is
    ended with every process it spawned (exit None)."""
    python = deployment.plan.settings.runtime.native_python or sys.executable
    environ = {
        **os.environ,
        "HF_HOME": deployment.hf_cache,
        **pinned_gpus(deployment),
        **dict(build_invocation(deployment).env),
        **dict(env or {}),
    }
    started = time.monotonic()
    try:
        proc = subprocess.Popen(
            [python, str(script), *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=environ,
            start_new_session=True,
        )
    except OSError as exc:
        raise HostPreconditionError(
            f"cannot run the native runtime's Python {python}: {exc.strerror or exc}",
            hint="set runtime.native_python to a Python with vLLM",
        ) from None
    try:
        out, err = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    return ScriptRun(code, out, err, time.monotonic() - started, "natively")
