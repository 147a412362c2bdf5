"""The kubelet's part of a rehearsal: each pod becomes a container on a private Docker network,
started with the pod's own command and args (as expanded), and its probes run as the kubelet
runs them: HTTP GET to the pod's IP and the probe's port, exec inside the container with the
probe's timeout; the startup probe gates liveness and readiness. Periods are shortened to at
most PROBE_PERIOD_S (a rehearsal has no minutes to spare); paths, ports, commands, timeouts
and the order are as rendered."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from m31ctl.rehearsal.dockercli import SESSION_LABEL, DockerCLI, Done
from m31ctl.rehearsal.pods import PodRun, Probe, Volume
from m31ctl.units import quantity_bytes

PROBE_PERIOD_S = 2.0


def container_name(session: str, pod: PodRun) -> str:
    suffix = f"-init-{pod.container}" if pod.init else ""
    return f"m31ctl-rh-{session}-{pod.pod}{suffix}"[:120]


def _mount(volume: Volume, session: str) -> list[str]:
    if volume.kind == "claim":
        ro = ",readonly" if volume.read_only else ""
        return [
            "--mount",
            f"type=volume,source={claim_volume(session, volume.source)},target={volume.target}{ro}",
        ]
    if volume.kind == "host":
        ro = ",readonly" if volume.read_only else ""
        return ["--mount", f"type=bind,source={volume.source},target={volume.target}{ro}"]
    size = f",tmpfs-size={quantity_bytes(volume.size)}" if volume.size else ""
    return ["--mount", f"type=tmpfs,destination={volume.target}{size}"]


def claim_volume(session: str, claim: str) -> str:
    return f"m31ctl-rh-{session}-{claim}"


def run_args(pod: PodRun, session: str, network: str) -> list[str]:
    """`docker run` arguments for one pod's container: what the kubelet would hand the runtime.
    Environment values here are the plan's (settings refuse secrets in them); secrets follow by
    name (`-e NAME`), their values in the docker process's environment only."""
    args = ["run", "-d", "--name", container_name(session, pod), "--label", f"{SESSION_LABEL}={session}"]
    args += ["--network", network, "--hostname", pod.hostname[:63]]
    for alias in pod.aliases:
        args += ["--network-alias", alias]
    for name, value in pod.env:
        args += ["-e", f"{name}={value}"]
    for name, _optional in pod.secrets:
        args += ["-e", name]
    for volume in pod.volumes:
        args += _mount(volume, session)
    for cap in pod.cap_add:
        args += ["--cap-add", cap]
    if pod.unconfined:
        args += ["--security-opt", "seccomp=unconfined"]
    if pod.ipc_host:
        args += ["--ipc", "host"]
    # Kubernetes: `command` replaces the image's ENTRYPOINT, `args` its CMD; absent, the image's.
    if pod.command:
        args += ["--entrypoint", pod.command[0], pod.image, *pod.command[1:], *(pod.args or ())]
    elif pod.args is not None:
        args += [pod.image, *pod.args]
    else:
        args += [pod.image]
    return args


@dataclass
class ProbeState:
    probe: Probe
    attempts: int = 0
    passes: int = 0
    failures_in_row: int = 0
    first_pass_s: float | None = None
    last_error: str = ""
    next_at: float = 0.0


@dataclass
class PodState:
    pod: PodRun
    name: str
    started_at: float
    started_wall: float = field(default_factory=time.time)  # to compare with log timestamps
    start_error: str = ""
    ip: str = ""
    status: str = "running"
    exit_code: int | None = None
    ready_s: float | None = None
    probes: list[ProbeState] = field(default_factory=list)

    @property
    def started(self) -> bool:
        """The startup probe passed (or there is none): liveness and readiness may run."""
        startup = [p for p in self.probes if p.probe.kind == "startup"]
        return all(p.passes for p in startup)


def http_probe(ip: str, probe: Probe, timeout: float) -> tuple[bool, str]:
    """HTTP GET as the kubelet sends it: 200-399 passes; no credentials (a probe carries none)."""
    url = f"http://{ip}:{probe.port}{probe.path}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return 200 <= answer.status < 400, f"HTTP {answer.status}"
    except urllib.error.HTTPError as exc:
        return False, f"HTTP {exc.code}"
    except (OSError, ValueError) as exc:
        return False, str(exc)[:200]


def exec_probe(docker: DockerCLI, container: str, probe: Probe) -> tuple[bool, str]:
    done: Done = docker.exec(container, probe.command, timeout=probe.timeout_s)
    return done.ok, f"exit {done.code}" + (f": {done.err.strip()[-200:]}" if done.err.strip() else "")


class Kubelet:
    """Starts pods and probes them; `clock` is injectable for tests."""

    def __init__(
        self, docker: DockerCLI, session: str, network: str, clock: Callable[[], float] = time.monotonic
    ):
        self.docker, self.session, self.network, self.clock = docker, session, network, clock

    def start(self, pod: PodRun, secrets: dict[str, str]) -> PodState:
        wanted = {name: secrets[name] for name, _ in pod.secrets if name in secrets}
        done = self.docker.run(run_args(pod, self.session, self.network), secrets=wanted, timeout=120)
        state = PodState(pod, container_name(self.session, pod), self.clock())
        if not done.ok:
            state.status, state.exit_code = "not started", done.code
            state.start_error = done.err.strip()[-300:]
            state.probes = [ProbeState(p) for p in pod.probes]
            return state
        state.probes = [ProbeState(p, next_at=state.started_at + p.initial_delay_s) for p in pod.probes]
        return state

    def run_to_completion(self, pod: PodRun, secrets: dict[str, str], timeout: float) -> PodState:
        """An init container: it must exit 0 before the pod's containers start."""
        state = self.start(pod, secrets)
        if state.status == "running":
            done = self.docker.run(["wait", state.name], timeout=timeout)
            state.exit_code = int(done.out.strip() or -1) if done.ok else -1
            state.status = "exited"
        return state

    def refresh(self, state: PodState) -> None:
        status, code, ip = self.docker.state(state.name)
        state.ip = ip or state.ip
        if status in ("exited", "dead", ""):
            state.status, state.exit_code = "exited", code

    def probe_once(self, state: PodState) -> None:
        """Run each probe that is due, in the kubelet's order: startup first, then the others."""
        now = self.clock()
        for ps in state.probes:
            if ps.probe.kind != "startup" and not state.started:
                continue
            if now < ps.next_at or (ps.probe.kind == "startup" and ps.passes):
                continue
            ps.next_at = now + min(ps.probe.period_s, PROBE_PERIOD_S)
            ps.attempts += 1
            if ps.probe.action == "exec":
                ok, detail = exec_probe(self.docker, state.name, ps.probe)
            else:
                ok, detail = (
                    http_probe(state.ip, ps.probe, ps.probe.timeout_s) if state.ip else (False, "no IP")
                )
            if ok:
                ps.passes += 1
                ps.failures_in_row = 0
                if ps.first_pass_s is None:
                    ps.first_pass_s = round(self.clock() - state.started_at, 1)
            else:
                ps.failures_in_row += 1
                ps.last_error = detail
        readiness = [p for p in state.probes if p.probe.kind == "readiness"]
        if (
            state.ready_s is None
            and state.started
            and all(p.passes and not p.failures_in_row for p in readiness)
        ):
            state.ready_s = round(self.clock() - state.started_at, 1)
