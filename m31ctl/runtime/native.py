"""The `native` runtime: vLLM from a local Python as a supervised process.

It behaves like the container runtime: the same plan, argv (from the engine adapter) and
readiness; a state file per server (pid, plan hash, port, log) stands in for the container's
labels, so status, logs and stop act on our processes only and a relaunch of the same plan
changes nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from m31ctl.deployment import Deployment
from m31ctl.engine.adapter import build_invocation, native_command
from m31ctl.errors import CheckFailed, HostPreconditionError
from m31ctl.names import check_name, name_problem
from m31ctl.netaddr import local_url
from m31ctl.resources import state_root
from m31ctl.runtime.base import DryRun, LaunchOptions, LaunchResult, Reporter, ScriptRun, ServerStatus
from m31ctl.runtime.converge import Action, Existing, decide
from m31ctl.runtime.gates import CheckId
from m31ctl.runtime.launching import api_key_for, confirm_or_refuse, ensure_port_free, watchdog_for
from m31ctl.runtime.phases import Phase
from m31ctl.runtime.readiness import ProcessState, health, models, wait_ready

# After SIGKILL, how long the kernel may take to reap the process group before stop gives up.
KILL_GRACE_S = 5.0


def state_dir() -> Path:
    return state_root() / "native"


@dataclass(frozen=True)
class NativeServer:
    name: str
    pid: int
    plan_hash: str
    recipe: str
    variant: str
    profile: str
    bind: str
    port: int
    log: str
    argv: tuple[str, ...]
    started_at: float
    stop_timeout: int
    # Which process the pid meant when we started it (boot id and kernel start time): after a
    # crash or a reboot the pid may belong to someone else, whom status must not show and stop
    # must never signal. None on a system without /proc (the pid alone is trusted there).
    identity: str | None = None

    @property
    def base(self) -> str:
        return local_url(self.bind, self.port)

    def alive(self) -> bool:
        if self.identity is not None and process_identity(self.pid) != self.identity:
            return False  # gone, or the pid was reused by another process
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return _not_zombie(self.pid)


def process_identity(pid: int) -> str | None:
    """'BOOT_ID:STARTTIME' of a live process: the kernel's start time (in clock ticks since boot,
    field 22 of /proc/PID/stat) is fixed for the life of a process and differs for a reused pid."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return f"{boot}:{fields[19]}" if len(fields) > 19 else None


def _not_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _path(name: str) -> Path:
    # Names are checked at plan time; checked again here because this one becomes a file path.
    return state_dir() / f"{check_name(name, 'server name')}.json"


def load(name: str) -> NativeServer | None:
    """The recorded server, or None (a missing or unreadable state file records nothing)."""
    try:
        data = json.loads(_path(name).read_text(encoding="utf-8"))
        data["argv"] = tuple(data["argv"])
        return NativeServer(**data)
    except (OSError, ValueError, TypeError, KeyError):
        return None


def recorded() -> list[NativeServer]:
    directory = state_dir()
    if not directory.is_dir():
        return []
    found = [load(p.stem) for p in sorted(directory.glob("*.json")) if name_problem(p.stem) is None]
    return [s for s in found if s is not None]


def _save(server: NativeServer) -> None:
    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True)
    tmp = _path(server.name).with_suffix(".tmp")
    data = {**asdict(server), "argv": list(server.argv)}
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, _path(server.name))


class ProcessHandle:
    """A native server as readiness sees it; exit codes come from our own child when we have it."""

    kind = "process"

    def __init__(self, server: NativeServer, child: subprocess.Popen[bytes] | None = None) -> None:
        self.server = server
        self.child = child
        self.name = server.name

    def state(self) -> ProcessState:
        if self.child is not None:
            code = self.child.poll()
            return ProcessState(running=code is None, dead=code is not None, exit_code=code)
        alive = self.server.alive()
        return ProcessState(running=alive, dead=not alive)

    def log_tail(self, lines: int) -> str:
        try:
            with open(self.server.log, "rb") as handle:
                handle.seek(0, os.SEEK_END)
                size = handle.tell()
                handle.seek(max(0, size - 64 * 1024))
                text = handle.read().decode("utf-8", "replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:]) + "\n"


def command(deployment: Deployment) -> list[str]:
    runtime = deployment.plan.settings.runtime
    return native_command(deployment, runtime.native_python or sys.executable)


def _existing(server: NativeServer | None, served: str, api_key: str | None) -> Existing | None:
    if server is None:
        return None
    alive = server.alive()
    return Existing(
        owned=True,  # state files are ours by construction
        plan_hash=server.plan_hash,
        state="running" if alive else "exited",
        serving=alive and served in (models(server.base, api_key) or []),
    )


class NativeRuntime:
    name = "native"
    gates = (CheckId.GPUS, CheckId.GPU_MEMORY, CheckId.MIG, CheckId.DISK, CheckId.CAPACITY, CheckId.API_KEY)

    def dry_run(self, deployment: Deployment) -> DryRun:
        return DryRun("process", tuple(command(deployment)), {"command": command(deployment)})

    def launch(self, deployment: Deployment, options: LaunchOptions) -> LaunchResult:
        plan = deployment.plan
        environ = dict(options.environ)
        name = deployment.name
        api_key = api_key_for(deployment, environ)
        if deployment.simulated:
            raise HostPreconditionError(
                "the native runtime runs on this host's own hardware",
                hint="drop --hardware (or use --hardware cpu for the rehearsal)",
            )
        timeout = float(options.timeout if options.timeout is not None else deployment.budgets.startup_s)
        served = plan.settings.model.served_name
        existing = load(name)
        decision = decide(_existing(existing, served, api_key), plan.hash)
        confirm_or_refuse(decision, name, plan.hash, options)
        if existing is not None and decision.action is Action.UNCHANGED:
            return LaunchResult(Action.UNCHANGED.value, name, self.name, existing.base, plan.hash, True)

        def wait(handle: ProcessHandle, base: str) -> tuple[dict[str, float], tuple[Phase, ...]]:
            return wait_ready(
                handle,
                base,
                served,
                timeout,
                options.report,
                api_key,
                on_phase=options.on_phase,
                watchdog=watchdog_for(deployment, options.diagnostics),
            )

        if existing is not None and decision.action is Action.ADOPT:
            options.report(f"{name} (pid {existing.pid}) runs this plan already; waiting for it")
            if options.detach:
                return LaunchResult(Action.ADOPT.value, name, self.name, existing.base, plan.hash, False)
            timings, phases = wait(ProcessHandle(existing), existing.base)
            return LaunchResult(
                Action.ADOPT.value, name, self.name, existing.base, plan.hash, True, timings, phases
            )
        if existing is not None and decision.action is Action.RECREATE:
            stop_server(existing, existing.stop_timeout, options.report)
        ensure_port_free(deployment.network.bind, deployment.network.port)
        argv = command(deployment)
        log_path = state_dir() / f"{name}.log"
        state_dir().mkdir(parents=True, exist_ok=True)
        env = {**environ, **dict(build_invocation(deployment).env)}
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
        server = NativeServer(
            name=name,
            pid=child.pid,
            plan_hash=plan.hash,
            recipe=plan.recipe.recipe,
            variant=plan.variant,
            profile=plan.profile,
            bind=deployment.network.bind,
            port=deployment.network.port,
            log=str(log_path),
            argv=tuple(argv),
            started_at=time.time(),
            stop_timeout=deployment.budgets.stop_s,
            identity=process_identity(child.pid),
        )
        _save(server)
        options.report(f"started {name} (pid {child.pid}): {' '.join(argv[:3])}; log {log_path}")
        if options.detach:
            return LaunchResult(decision.action.value, name, self.name, server.base, plan.hash, False)
        started = time.monotonic()
        timings, phases = wait(ProcessHandle(server, child), server.base)
        timings["total_since_create"] = time.monotonic() - started
        return LaunchResult(
            decision.action.value, name, self.name, server.base, plan.hash, True, timings, phases
        )

    def servers(self) -> list[ServerStatus]:
        rows = []
        for s in recorded():
            alive = s.alive()
            rows.append(
                ServerStatus(
                    name=s.name,
                    runtime=self.name,
                    state="running" if alive else "exited",
                    plan_hash=s.plan_hash,
                    recipe=s.recipe,
                    variant=s.variant,
                    profile=s.profile,
                    endpoint=s.base,
                    health=health(s.base, timeout=1.0) if alive else None,
                    started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s.started_at)),
                    pid=s.pid,
                )
            )
        return rows

    def foreign(self, name: str) -> bool:
        return False  # every state file was written by m31ctl

    def logs(self, name: str, follow: bool, tail: int, write: Callable[[str], None]) -> None:
        server = _named(name)
        write(ProcessHandle(server).log_tail(tail))
        if follow:
            with open(server.log, "rb") as log:
                log.seek(0, os.SEEK_END)
                while server.alive():
                    chunk = log.read()
                    if chunk:
                        write(chunk.decode("utf-8", "replace"))
                    else:
                        time.sleep(0.3)

    def stop(self, name: str, timeout: int | None, keep: bool, report: Reporter) -> None:
        server = _named(name)
        stop_server(server, timeout if timeout is not None else server.stop_timeout, report)

    def run_engine_script(
        self,
        deployment: Deployment,
        script: Path,
        args: Sequence[str],
        timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> ScriptRun:
        return run_script(deployment, script, args, timeout, env)


def _named(name: str) -> NativeServer:
    server = load(name)
    if server is None:
        raise HostPreconditionError(f"no native m31ctl server named {name}", hint="see `m31ctl status`")
    return server


def stop_server(server: NativeServer, timeout: int, report: Reporter) -> None:
    """SIGTERM to the process group (vLLM drains), then SIGKILL after the timeout. The state
    file goes only once the process is gone; if it survives SIGKILL, stop fails."""
    if server.alive():
        report(f"stopping {server.name} (pid {server.pid}: SIGTERM, then SIGKILL after {timeout} s)")
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
    _path(server.name).unlink(missing_ok=True)


def _wait_gone(server: NativeServer, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while server.alive():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.2)
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
