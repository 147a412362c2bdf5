"""`launch --runtime native`: vLLM from a local Python as a supervised process.

It behaves like the container runtime: the same plan, argv and readiness; a state file per
server (pid, plan hash, port, log) stands in for the container's labels, so status, logs and
stop act on our processes only and a relaunch of the same plan changes nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m31ctl.container import local_url
from m31ctl.engine.adapter import build_invocation
from m31ctl.errors import ConflictError, HostPreconditionError
from m31ctl.launcher import LaunchResult, api_key_for, ensure_port_free
from m31ctl.plan import Plan, require_fit
from m31ctl.readiness import ProcessState, Reporter, health, models, wait_ready

API_SERVER = "vllm.entrypoints.openai.api_server"


def state_dir() -> Path:
    base = os.environ.get("M31CTL_STATE_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "m31ctl"
    )
    return Path(base) / "native"


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

    @property
    def base(self) -> str:
        return local_url(self.bind, self.port)

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return _not_zombie(self.pid)


def _not_zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _path(name: str) -> Path:
    return state_dir() / f"{name}.json"


def load(name: str) -> NativeServer | None:
    try:
        data = json.loads(_path(name).read_text())
    except (OSError, ValueError):
        return None
    data["argv"] = tuple(data["argv"])
    return NativeServer(**data)


def servers() -> list[NativeServer]:
    directory = state_dir()
    if not directory.is_dir():
        return []
    found = [load(p.stem) for p in sorted(directory.glob("*.json"))]
    return [s for s in found if s is not None]


def _save(server: NativeServer) -> None:
    directory = state_dir()
    directory.mkdir(parents=True, exist_ok=True)
    tmp = _path(server.name).with_suffix(".tmp")
    data = {**server.__dict__, "argv": list(server.argv)}
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


def command(plan: Plan) -> list[str]:
    """The API server module with the adapter's argv: `vllm serve MODEL ...` = `--model MODEL ...`."""
    inv = build_invocation(plan)
    runtime = plan.settings.runtime
    python = runtime.native_python or sys.executable
    model, *rest = inv.args
    return [
        python,
        "-m",
        API_SERVER,
        "--model",
        model,
        *rest,
        "--host",
        runtime.bind,
        "--port",
        str(runtime.port),
    ]


def launch(
    plan: Plan,
    *,
    timeout: float | None,
    detach: bool,
    yes: bool,
    confirm: Any,
    report: Reporter,
    environ: dict[str, str] | None = None,
) -> LaunchResult:
    environ = dict(os.environ if environ is None else environ)
    require_fit(plan)
    runtime = plan.settings.runtime
    name = runtime.container_name
    api_key = api_key_for(plan, environ)
    if plan.hardware.vendor != "cpu" and plan.hardware.source.startswith("simulated"):
        raise HostPreconditionError(
            "the native runtime runs on this host's own hardware",
            hint="drop --hardware (or use --hardware cpu for the rehearsal)",
        )
    timeout = float(timeout if timeout is not None else runtime.startup_timeout)
    served = plan.settings.model.served_name
    existing = load(name)
    action = "created"
    if existing is not None and existing.alive():
        if existing.plan_hash == plan.hash:
            if served in (models(existing.base, api_key) or []):
                return LaunchResult("unchanged", name, existing.base, plan.hash, True)
            report(f"{name} (pid {existing.pid}) runs this plan already; waiting for it")
            timings, phases = (
                ({}, [])
                if detach
                else wait_ready(ProcessHandle(existing), existing.base, served, timeout, report, api_key)
            )
            return LaunchResult("adopted", name, existing.base, plan.hash, not detach, timings, phases)
        question = f"{name} runs plan {existing.plan_hash}; replace it with plan {plan.hash}?"
        if not (yes or confirm(question)):
            raise ConflictError(
                f"{name} runs another plan ({existing.plan_hash}); not replaced",
                hint="pass --yes to restart it with this plan",
            )
        stop_server(existing, existing.stop_timeout, report)
        action = "recreated"
    ensure_port_free(runtime.bind, runtime.port)
    argv = command(plan)
    log_path = state_dir() / f"{name}.log"
    state_dir().mkdir(parents=True, exist_ok=True)
    env = {**environ, **dict(build_invocation(plan).env)}
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
        bind=runtime.bind,
        port=runtime.port,
        log=str(log_path),
        argv=tuple(argv),
        started_at=time.time(),
        stop_timeout=plan.settings.serving.shutdown_timeout + 30,
    )
    _save(server)
    report(f"started {name} (pid {child.pid}): {argv[0]} -m {API_SERVER}; log {log_path}")
    if detach:
        return LaunchResult(action, name, server.base, plan.hash, False)
    started = time.monotonic()
    timings, phases = wait_ready(ProcessHandle(server, child), server.base, served, timeout, report, api_key)
    timings["total_since_create"] = time.monotonic() - started
    return LaunchResult(action, name, server.base, plan.hash, True, timings, phases)


def stop_server(server: NativeServer, timeout: int, report: Reporter) -> None:
    """SIGTERM to the process group (vLLM drains), then SIGKILL after the timeout."""
    if server.alive():
        report(f"stopping {server.name} (pid {server.pid}: SIGTERM, then SIGKILL after {timeout} s)")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while server.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        if server.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
    _path(server.name).unlink(missing_ok=True)


def select(name: str | None) -> list[NativeServer]:
    found = servers()
    if name is None:
        return found
    chosen = [s for s in found if s.name == name]
    if not chosen:
        raise HostPreconditionError(
            f"no native m31ctl server named {name}", hint="see `m31ctl status --runtime native`"
        )
    return chosen


def stop(name: str | None, timeout: int | None, report: Reporter) -> list[str]:
    stopped = []
    for server in select(name):
        stop_server(server, timeout if timeout is not None else server.stop_timeout, report)
        stopped.append(server.name)
    return stopped


def status() -> list[dict[str, Any]]:
    rows = []
    for s in servers():
        alive = s.alive()
        rows.append(
            {
                "name": s.name,
                "state": "running" if alive else "exited",
                "plan_hash": s.plan_hash,
                "recipe": s.recipe,
                "variant": s.variant,
                "profile": s.profile,
                "image": None,
                "endpoint": s.base,
                "health": health(s.base, timeout=1.0) if alive else None,
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(s.started_at)),
                "restart_count": 0,
                "pid": s.pid,
                "runtime": "native",
            }
        )
    return rows


def logs(name: str | None, follow: bool, tail: int) -> None:
    for server in select(name):
        handle = ProcessHandle(server)
        sys.stdout.write(handle.log_tail(tail))
        sys.stdout.flush()
        if follow:
            with open(server.log, "rb") as log:
                log.seek(0, os.SEEK_END)
                while server.alive():
                    chunk = log.read()
                    if chunk:
                        sys.stdout.write(chunk.decode("utf-8", "replace"))
                        sys.stdout.flush()
                    else:
                        time.sleep(0.3)
