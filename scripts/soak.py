"""The soak: a launched CPU rehearsal server under bounded concurrent load for a set time, its
engine killed (SIGKILL) at intervals, and what each runtime does about it measured.

    .venv/bin/python scripts/soak.py --runtime docker --runtime native --duration 300 --interval 30

For each runtime it launches `m31ctl launch --hardware cpu --recipe cpu` on the tiny rehearsal
model (scripts/soak makes it), keeps `--concurrency` clients sending short completions over
loopback, and every `--interval` seconds after the server is back it kills the engine for real:
`kill -9` of vLLM's EngineCore process (`--fault engine`, the default), or of the API server, the
process `launch` started (`--fault server`: in Docker the container's main process). Then:

- docker: the container's restart policy (`unless-stopped`) is what brings it back; the soak only
  watches.
- native: docs/operations.md promises no restart (a native server is a supervised process whose record
  says whether it runs); it promises that `status` tells the truth and that the next `launch`
  converges. The soak waits until `status` no longer reports it running, then runs the same
  `launch` again.

Per fault it reports the recovery time (the kill to the first successful completion sent after
it), every distinct answer `m31ctl status` gave during the outage, and for native the relaunch's
action. At the end, `m31ctl stop` and a search for what is left: a container by the name, a
network, a process carrying the soak's marker in its environment, a file in the state directory.
Prints one JSON report on stdout (progress on stderr); exit 0 only when every fault recovered, no
request failed outside an outage, and nothing was left.

The tiny model, the vLLM build and the rehearsal image come from scripts/setup-vllm,
scripts/build-rehearsal-image and m31ctl/rehearsal/make_tiny_model.py (scripts/soak runs them).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

import vllm_env  # scripts/vllm_env.py: where the tests' vLLM lives

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = vllm_env.python()
MARKER_ENV = "M31CTL_SOAK_MARKER"
# A server that is not back this long after a kill counts as not recovered (the CPU rehearsal
# starts in about a minute here; a busy machine may take several).
RECOVERY_LIMIT_S = 600.0
REQUEST_TIMEOUT_S = 60.0
# How often the outage is watched with `m31ctl status` (each a process start: on a 2-core host a
# tighter watch slows the recovery it measures).
STATUS_EVERY_S = 2.0


STARTED = time.monotonic()


def say(text: str) -> None:
    sys.stderr.write(f"soak: [{time.monotonic() - STARTED:6.1f} s] {text}\n")
    sys.stderr.flush()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def m31ctl(*args: str, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "m31ctl", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# The load.


@dataclass(frozen=True)
class Request:
    sent: float  # monotonic
    done: float
    ok: bool
    error: str | None


class Load:
    """`concurrency` clients, each sending one short completion after another; a failed request
    is followed by a short pause so that an outage is not a busy loop."""

    def __init__(self, base: str, model: str, concurrency: int) -> None:
        self.base, self.model, self.concurrency = base, model, concurrency
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(concurrency)]

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(REQUEST_TIMEOUT_S + 5)

    def _client(self) -> None:
        body = {"model": self.model, "prompt": "The soak test says", "max_tokens": 8, "temperature": 0}
        with httpx.Client(base_url=self.base, timeout=REQUEST_TIMEOUT_S) as client:
            while not self._stop.is_set():
                sent = time.monotonic()
                error: str | None = None
                try:
                    answer = client.post("/v1/completions", json=body)
                    if answer.status_code != 200:
                        error = f"HTTP {answer.status_code}"
                    elif not answer.json().get("choices"):
                        error = "no choices"
                except (httpx.HTTPError, ValueError) as exc:
                    error = type(exc).__name__
                with self._lock:
                    self.requests.append(Request(sent, time.monotonic(), error is None, error))
                if error is not None:
                    self._stop.wait(0.25)

    def first_success_sent_after(self, moment: float) -> float | None:
        with self._lock:
            done = [r.done for r in self.requests if r.ok and r.sent >= moment]
        return min(done) if done else None

    def snapshot(self) -> list[Request]:
        with self._lock:
            return list(self.requests)


# The processes the soak's server runs (a container's processes are host processes too). The
# API server carries the soak's marker in its environment; vLLM's EngineCore and workers retitle
# themselves (setproctitle), which overwrites theirs, so they are found as its descendants.


def _table() -> dict[int, tuple[int, str, str]]:
    """pid -> (ppid, state, start time) of every process."""
    table = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        table[int(proc.name)] = (int(fields[1]), fields[0], fields[19])
    return table


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()


def _marked(marker: str, table: dict[int, tuple[int, str, str]]) -> set[int]:
    needle = f"{MARKER_ENV}={marker}".encode()
    found = set()
    for pid, (_ppid, state, _start) in table.items():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if state != "Z" and needle in environ.split(b"\0"):
            found.add(pid)
    return found


class Processes:
    """Every process of the soak's server seen so far, by (pid, start time): what is still alive
    of them after `stop` was left behind."""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.seen: dict[tuple[int, str], str] = {}

    def sample(self) -> dict[int, str]:
        """The server's live processes now (pid -> command line), remembered."""
        table = _table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _state, _start) in table.items():
            children.setdefault(ppid, []).append(pid)
        todo, now = list(_marked(self.marker, table)), {}
        while todo:
            pid = todo.pop()
            if pid in now or pid not in table or table[pid][1] == "Z":
                continue
            now[pid] = _cmdline(pid)
            self.seen[(pid, table[pid][2])] = now[pid]
            todo += children.get(pid, [])
        return now

    def alive(self) -> list[str]:
        table = _table()
        return [
            f"{pid} {cmd[:80]}"
            for (pid, start), cmd in sorted(self.seen.items())
            if pid in table and table[pid][2] == start and table[pid][1] != "Z"
        ]


def fault_target(processes: Processes, fault: str) -> tuple[int, str] | None:
    """The engine: vLLM's EngineCore process where it runs apart (it titles itself so), else the
    API server, whose process holds the engine; or, with `server`, the API server, the process
    `launch` started (in Docker the container's main process)."""
    now = processes.sample()
    engines = sorted((pid, cmd) for pid, cmd in now.items() if "EngineCore" in cmd)
    if fault == "engine" and engines:
        return engines[0]
    servers = sorted((pid, cmd) for pid, cmd in now.items() if "vllm.entrypoints" in cmd)
    return servers[0] if servers else None


# One runtime's soak.


@dataclass
class Fault:
    at_s: float  # since the load started
    killed_pid: int
    killed: str
    recovered_s: float | None = None
    status_seen: list[dict[str, Any]] = field(default_factory=list)
    relaunch: dict[str, Any] | None = None


def _result(stdout: str) -> Any:
    """What `m31ctl ... --json` ended with: its envelope's data (docs/json.md), the whole of stdout
    (one document) or a stream's last line; ValueError for anything else (an error's envelope)."""
    try:
        envelope = json.loads(stdout)
    except ValueError:
        envelope = json.loads((stdout.strip().splitlines() or [""])[-1])
    if not isinstance(envelope, dict) or envelope.get("m31ctl") != 1 or envelope.get("ok") is not True:
        raise ValueError(f"not a result: {str(envelope)[:200]}")
    return envelope["data"]


def _status_answer(env: dict[str, str], name: str, runtime: str) -> dict[str, Any]:
    done = m31ctl("status", "--runtime", runtime, "--json", env=env, timeout=120)
    try:
        rows = _result(done.stdout)["containers"]
    except (ValueError, KeyError, TypeError):
        return {"exit": done.returncode, "error": (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
    row = next((r for r in rows if r.get("name") == name), None)
    if row is None:
        return {"exit": done.returncode, "listed": False}
    answer = {"state": row.get("state"), "health": row.get("health")}
    if runtime == "docker":
        answer["restart_count"] = row.get("restart_count")
    return answer


def _outage(
    runtime: str,
    env: dict[str, str],
    name: str,
    launch_args: list[str],
    load: Load,
    fault: Fault,
    killed_at: float,
    processes: Processes,
) -> None:
    """Watch `status` until a completion sent after the kill succeeds; natively, relaunch once
    status no longer says it runs (docs/operations.md: the next launch converges)."""
    deadline = killed_at + RECOVERY_LIMIT_S
    relaunch: threading.Thread | None = None
    while time.monotonic() < deadline:
        back = load.first_success_sent_after(killed_at)
        if back is not None:
            fault.recovered_s = round(back - killed_at, 2)
            break
        processes.sample()
        answer = _status_answer(env, name, runtime)
        answer_at = round(time.monotonic() - killed_at, 1)
        if not fault.status_seen or {k: v for k, v in fault.status_seen[-1].items() if k != "t_s"} != answer:
            fault.status_seen.append({"t_s": answer_at, **answer})
        if runtime == "native" and relaunch is None and answer.get("state") != "running":
            relaunch = threading.Thread(target=_relaunch, args=(env, launch_args, fault, killed_at))
            relaunch.start()
        time.sleep(STATUS_EVERY_S)
    if relaunch is not None:
        relaunch.join()


def _relaunch(env: dict[str, str], launch_args: list[str], fault: Fault, killed_at: float) -> None:
    started = time.monotonic()
    done = m31ctl(*launch_args, env=env)
    try:
        result = _result(done.stdout)
    except (ValueError, IndexError):
        result = {}
    fault.relaunch = {
        "exit": done.returncode,
        "action": result.get("action"),
        "started_after_s": round(started - killed_at, 1),
        "took_s": round(time.monotonic() - started, 1),
        "error": None if done.returncode == 0 else (done.stderr.strip().splitlines() or ["?"])[-1][:300],
    }


def _leftovers(
    runtime: str, name: str, processes: Processes, state: Path, networks_before: set[str]
) -> dict[str, Any]:
    left: dict[str, Any] = {
        "processes": processes.alive() + [f"{pid} {cmd[:80]}" for pid, cmd in processes.sample().items()],
        "state_files": sorted(
            p.relative_to(state).as_posix() for p in state.rglob("*") if p.is_file() and p.suffix != ".log"
        ),
        "logs_kept": sorted(p.relative_to(state).as_posix() for p in state.rglob("*.log")),
    }
    if runtime == "docker":
        from m31ctl.runtime.engine_api import connect

        # The plain list calls: the SDK's models inspect each item, and other jobs' containers
        # come and go meanwhile.
        api = connect().api
        found = api.containers(all=True, filters={"name": name})
        left["containers"] = [n.lstrip("/") for c in found for n in c.get("Names", []) if n == f"/{name}"]
        left["networks"] = sorted(n["Name"] for n in api.networks() if n["Id"] not in networks_before)
    return left


def _networks() -> set[str]:
    from m31ctl.runtime.engine_api import connect

    return {n["Id"] for n in connect().api.networks()}


def soak(runtime: str, args: argparse.Namespace, model: Path, workdir: Path) -> dict[str, Any]:
    name = f"m31ctl-soak-{runtime}-{uuid.uuid4().hex[:6]}"
    marker = uuid.uuid4().hex
    port = free_port()
    state = workdir / f"state-{runtime}"
    env = {**os.environ, "M31CTL_STATE_DIR": str(state)}
    launch_args = [
        "launch", "--hardware", "cpu", "--recipe", "cpu", "--runtime", runtime, "--name", name,
        "--port", str(port), "--set", f"model.path={model}", "--set", f"runtime.env.{MARKER_ENV}={marker}",
        "--timeout", "600", "--yes", "--json",
    ]  # fmt: skip
    if runtime == "native":
        launch_args += ["--set", f"runtime.native_python={args.vllm_python}"]
    networks_before = _networks() if runtime == "docker" else set()
    processes = Processes(marker)
    report: dict[str, Any] = {"runtime": runtime, "name": name, "fault": args.fault}
    say(f"{runtime}: launching {name} on 127.0.0.1:{port}")
    started = time.monotonic()
    launched = m31ctl(*launch_args, env=env)
    if launched.returncode != 0:
        report["launch"] = {"exit": launched.returncode, "error": launched.stderr.strip()[-600:]}
        m31ctl("stop", "--name", name, env=env)
        report["left"] = _leftovers(runtime, name, processes, state, networks_before)
        return report
    report["launch"] = {"exit": 0, "ready_s": round(time.monotonic() - started, 1)}
    processes.sample()
    say(
        f"{runtime}: ready after {report['launch']['ready_s']} s; load x{args.concurrency} for {args.duration} s"
    )
    faults: list[Fault] = []
    base = f"http://127.0.0.1:{port}"
    served = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    with Load(base, served, args.concurrency) as load:
        began = time.monotonic()
        end = began + args.duration
        next_fault = began + args.interval
        while time.monotonic() < end:
            if time.monotonic() < next_fault:
                time.sleep(min(0.5, max(0.0, next_fault - time.monotonic())))
                continue
            target = fault_target(processes, args.fault)
            if target is None:
                say(f"{runtime}: no {args.fault} process to kill (marker {marker})")
                break
            killed_at = time.monotonic()
            with contextlib.suppress(ProcessLookupError):
                os.kill(target[0], signal.SIGKILL)
            fault = Fault(round(killed_at - began, 1), target[0], target[1][:80])
            faults.append(fault)
            say(f"{runtime}: kill -9 {target[0]} ({target[1][:40]}) at {fault.at_s} s")
            _outage(runtime, env, name, launch_args, load, fault, killed_at, processes)
            say(f"{runtime}: recovered after {fault.recovered_s} s; status said {fault.status_seen}")
            if fault.recovered_s is None:
                break
            next_fault = time.monotonic() + args.interval
        requests = load.snapshot()
        load_s = time.monotonic() - began
    report["load"] = _figures(requests, faults, began, load_s)
    report["faults"] = [asdict(f) for f in faults]
    report["processes_seen"] = sorted({cmd[:60] for cmd in processes.seen.values()})
    processes.sample()
    report["logs"] = _logs_after(env, name)
    stopped = m31ctl("stop", "--name", name, "--json", env=env)
    report["stop"] = {"exit": stopped.returncode}
    report["left"] = _leftovers(runtime, name, processes, state, networks_before)
    return report


# vLLM's line once its API server listens (entrypoints/openai/api_server.py, entry.py in 0.32).
SERVER_STARTED = "Starting vLLM server on"


def _logs_after(env: dict[str, str], name: str) -> dict[str, Any]:
    """What `m31ctl logs` shows after the faults: it answers, and the engine's starts are in it
    (Docker keeps a restarted container's earlier output; natively the log file is appended)."""
    shown = m31ctl("logs", "--name", name, "--tail", "5000", env=env, timeout=120)
    answer: dict[str, Any] = {
        "exit": shown.returncode,
        "lines": len(shown.stdout.splitlines()),
        "server_starts": shown.stdout.count(SERVER_STARTED),
    }
    if not answer["server_starts"]:  # the evidence, for a run that cannot be repeated
        answer["last_lines"] = shown.stdout.splitlines()[-20:] + shown.stderr.splitlines()[-5:]
    return answer


def _figures(requests: list[Request], faults: list[Fault], began: float, seconds: float) -> dict[str, Any]:
    """Requests sent and failed, and how many failures fell outside every outage (a kill to its
    recovery: those should be none)."""
    outages = [
        (began + f.at_s, began + f.at_s + (f.recovered_s if f.recovered_s is not None else RECOVERY_LIMIT_S))
        for f in faults
    ]
    failed = [r for r in requests if not r.ok]
    outside = [r for r in failed if not any(start - 0.5 <= r.done <= stop + 0.5 for start, stop in outages)]
    ok = [r.done - r.sent for r in requests if r.ok]
    kinds: dict[str, int] = {}
    for r in failed:
        kinds[r.error or "?"] = kinds.get(r.error or "?", 0) + 1
    return {
        "seconds": round(seconds, 1),
        "sent": len(requests),
        "succeeded": len(ok),
        "failed": len(failed),
        "failed_outside_outages": len(outside),
        "failures_by_kind": kinds,
        "latency_median_s": round(sorted(ok)[len(ok) // 2], 3) if ok else None,
    }


def verdict(report: dict[str, Any]) -> list[str]:
    """What went wrong in one runtime's soak (empty: it passed)."""
    problems = []
    if report["launch"]["exit"] != 0:
        problems.append(f"launch failed: {report['launch'].get('error')}")
        return problems
    if not report["faults"]:
        problems.append("no fault was injected (the duration is shorter than the interval?)")
    for fault in report["faults"]:
        if fault["recovered_s"] is None:
            problems.append(f"the kill at {fault['at_s']} s never recovered")
    if report["load"]["failed_outside_outages"]:
        problems.append(f"{report['load']['failed_outside_outages']} requests failed outside an outage")
    logs = report.get("logs", {})
    if logs.get("exit") != 0 or not logs.get("lines"):
        problems.append(f"m31ctl logs after the faults: {logs}")
    if report["stop"]["exit"] != 0:
        problems.append(f"stop exited {report['stop']['exit']}")
    left = report["left"]
    for what in ("processes", "state_files", "containers", "networks"):
        if left.get(what):
            problems.append(f"left after stop: {what} {left[what]}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime", action="append", choices=("docker", "native"))
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of load per runtime")
    parser.add_argument("--interval", type=float, default=30.0, help="seconds of load between faults")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--fault", choices=("engine", "server"), default="engine")
    parser.add_argument("--model", type=Path, default=ROOT / ".cache" / "rehearsal-model")
    parser.add_argument("--vllm-python", default=str(VLLM_PYTHON))
    parser.add_argument("--parallel", action="store_true", help="soak the runtimes at the same time")
    parser.add_argument("-o", "--output", type=Path, help="also write the report here")
    args = parser.parse_args()
    runtimes = args.runtime or ["docker", "native"]
    if not (args.model / "config.json").is_file():
        say(f"no tiny model at {args.model}: scripts/soak makes it")
        return 2
    reports: dict[str, dict[str, Any]] = {}

    def one(runtime: str, workdir: Path) -> None:
        report = soak(runtime, args, args.model, workdir)
        report["problems"] = verdict(report)
        reports[runtime] = report
        problems = report["problems"]
        say(f"{runtime}: {'passed' if not problems else 'FAILED: ' + '; '.join(problems)}")

    with tempfile.TemporaryDirectory(prefix="m31ctl-soak-") as workdir:
        if args.parallel:
            threads = [threading.Thread(target=one, args=(r, Path(workdir))) for r in runtimes]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        else:
            for runtime in runtimes:
                one(runtime, Path(workdir))
    text = json.dumps({"soak": [reports[r] for r in runtimes if r in reports]}, indent=1)
    sys.stdout.write(text + "\n")
    if args.output:
        args.output.write_text(text + "\n")
    passed = len(reports) == len(runtimes) and all(not r["problems"] for r in reports.values())
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
