"""The kubelet's part of a rehearsal: the pods started in the LWS controller's order and watched
until the serving pod is ready. Each pod becomes a container on a private Docker network,
started with the pod's own command and args (as expanded), and its probes run as the kubelet
runs them (the actions, HTTP GET or exec with the probe's timeout, are prober.py's); the
startup probe gates liveness and readiness. Periods are shortened to at
most PROBE_PERIOD_S (a rehearsal has no minutes to spare); paths, ports, commands, timeouts and
the order are as rendered. A pod whose container is killed and started again in place, or that
has more than one (a P/D router pod: the front on its port, the router on its loopback), runs
in a sandbox: Kubernetes' pause container, holding the pod's network namespace (address,
hostname, DNS names). The kubelet owns what is done to a pod's container (run detached, in its
sandbox, exec, kill, start again in place) and its look at it (status, exit code, address) over
the program's one client (engine_api), whose refusals() say why the Engine refused; what the
rest of the rehearsal asks of Docker (image, volumes, a container run to its end, logs,
cleanup) is docker_verbs.py's."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from m31ctl import interrupt
from m31ctl.labels import Label
from m31ctl.rehearsal import docker_verbs
from m31ctl.rehearsal.docker_verbs import Ran, run_exit_code
from m31ctl.rehearsal.logs import fatal_line
from m31ctl.rehearsal.pods import NAMESPACE, PodRun, Probe, Volume
from m31ctl.rehearsal.prober import exec_in, exec_probe, http_probe, tcp_probe
from m31ctl.rehearsal.session import Options, Progress
from m31ctl.runtime.engine_api import refusals
from m31ctl.units import quantity_bytes

PROBE_PERIOD_S = 2.0
TICK_S = 1.0
# How often the logs are read for a fatal traceback while waiting (a failed node may not exit).
FATAL_EVERY_S = 10.0
KILL_POLL_S = 0.5


def _mount(volume: Volume, session: str) -> dict[str, Any]:
    """The volume as the Engine API's HostConfig.Mounts entry (what `docker run --mount` sends)."""
    if volume.kind in ("claim", "host"):  # a Docker volume of the session, or a bind mount
        claim = volume.kind == "claim"
        source = claim_volume(session, volume.source) if claim else volume.source
        return {"Type": "volume" if claim else "bind", "Source": source, "Target": volume.target,
                "ReadOnly": volume.read_only}  # fmt: skip
    tmpfs = {"TmpfsOptions": {"SizeBytes": quantity_bytes(volume.size)}} if volume.size else {}
    return {"Type": "tmpfs", "Target": volume.target, **tmpfs}


def claim_volume(session: str, claim: str) -> str:
    return f"m31ctl-rh-{session}-{claim}"


def container_name(session: str, pod: PodRun) -> str:
    suffix = f"-init-{pod.container}" if pod.init else ""
    return f"m31ctl-rh-{session}-{pod.pod}{suffix}"[:120]


def sidecar_name(session: str, pod: PodRun, sidecar: PodRun) -> str:
    """The container of `sidecar`, one of `pod`'s other containers (PodRun.sidecars)."""
    return f"{container_name(session, pod)[:100]}-{sidecar.container}"[:120]


def sandbox_name(session: str, pod: PodRun) -> str:
    return f"{container_name(session, pod)[:112]}-sandbox"


def sandbox_args(pod: PodRun, session: str, network: str, address: str = "") -> dict[str, Any]:
    """The pod's sandbox: its address, hostname and DNS names outlive a kill of its container, as
    a kubelet's pod keeps its IP while its container restarts. It runs nothing but a sleep."""
    return {
        "name": sandbox_name(session, pod),
        "image": pod.image,
        "labels": {Label.REHEARSAL: session},
        "hostname": pod.hostname[:63],
        "entrypoint": ["sleep"],
        "command": ["infinity"],
        "host": {},
        "network": network,
        "aliases": list(pod.aliases),
        "address": address or None,
    }


def in_sandbox(create: dict[str, Any], sandbox: str) -> dict[str, Any]:
    """A pod's container run in its sandbox's network namespace: the address, hostname and names
    are the sandbox's (Docker refuses a hostname of its own in another container's namespace)."""
    moved = {k: v for k, v in create.items() if k not in ("network", "aliases", "address", "hostname")}
    moved["host"] = {**create["host"], "network_mode": f"container:{sandbox}"}
    return moved


# The downward API's fields the rehearsal fills (Kubernetes: pods/fieldRef); the pod's address
# is the one the cluster assigned it on the rehearsal network (cluster.pod_addresses).
def field_values(pod: PodRun, address: str) -> list[tuple[str, str]]:
    known = {"status.podIP": address, "metadata.name": pod.pod, "metadata.namespace": NAMESPACE}
    return [(name, known.get(path, "")) for name, path in pod.fields]


def run_args(pod: PodRun, session: str, network: str, address: str = "") -> dict[str, Any]:
    """run_detached's arguments for one pod's container: what the kubelet would hand
    the runtime. Environment values here are the plan's (settings refuse secrets in them); the
    secrets' values are added by Kubelet.start, into the API request only (never any argv)."""
    host: dict[str, Any] = {"mounts": [_mount(volume, session) for volume in pod.volumes]}
    if pod.cap_add:
        host["cap_add"] = list(pod.cap_add)
    if pod.unconfined:
        host["security_opt"] = ["seccomp=unconfined"]
    if pod.ipc_host:
        host["ipc_mode"] = "host"
    # Kubernetes: `command` replaces the image's ENTRYPOINT, `args` its CMD; absent, the image's.
    if pod.command:
        entrypoint, command = [pod.command[0]], [*pod.command[1:], *(pod.args or ())]
    else:
        entrypoint, command = None, list(pod.args or ())
    return {
        "name": container_name(session, pod),
        "image": pod.image,
        "labels": {Label.REHEARSAL: session},
        "hostname": pod.hostname[:63],
        "environment": [f"{name}={value}" for name, value in (*pod.env, *field_values(pod, address))],
        "entrypoint": entrypoint,
        "command": command or None,
        "host": host,
        "network": network,
        "aliases": list(pod.aliases),
        "address": address or None,
    }


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
    sandbox: str = ""  # the pod's sandbox container holding its address ("": none)

    @property
    def started(self) -> bool:
        """The startup probe passed (or there is none): liveness and readiness may run."""
        startup = [p for p in self.probes if p.probe.kind == "startup"]
        return all(p.passes for p in startup)


def container_state(client: Any, container: str) -> tuple[str, int, str]:
    """The kubelet's look at one container: (status, exit code, IP on its network); status ''
    when the Engine knows no such container (or refused to say)."""
    with refusals() as refused:
        info = client.api.inspect_container(container)
    if refused.reason is not None:
        return "", -1, ""
    networks = (info.get("NetworkSettings") or {}).get("Networks") or {}
    ip = next((n["IPAddress"] for n in networks.values() if n.get("IPAddress")), "")
    state = info.get("State") or {}
    return str(state.get("Status", "")), int(state.get("ExitCode", -1)), ip


def run_detached(
    client: Any,
    *,
    host: Mapping[str, Any],
    network: str | None = None,
    aliases: Sequence[str] = (),
    address: str | None = None,
    **create: Any,
) -> Ran:
    """`docker run -d`: create (`create`: the Engine API's create_container arguments; `host`:
    create_host_config's) and start. Ran(0, id, "") when started, else run's exit code and the
    engine's reason (a container created but not started stays, with its labels)."""
    host_config = client.api.create_host_config(**host, **({"network_mode": network} if network else {}))
    if network:
        endpoint = client.api.create_endpoint_config(aliases=list(aliases) or None, ipv4_address=address)
        create["networking_config"] = client.api.create_networking_config({network: endpoint})
    created: dict[str, Any] = {}
    with refusals() as refused:
        created = client.api.create_container(host_config=host_config, **create)
        client.api.start(created["Id"])
    if refused.reason is not None:
        return Ran(run_exit_code(refused.reason), "", refused.reason)
    return Ran(0, str(created["Id"]), "")


class Kubelet:
    """Starts pods, probes them, reads their logs and kills or restarts their containers, through
    the Docker client (engine_api.connect); `clock` is injectable for tests."""

    def __init__(
        self,
        client: Any,
        session: str,
        network: str,
        clock: Callable[[], float] = time.monotonic,
        addresses: Mapping[str, str] | None = None,
        secrets: Mapping[str, str] | None = None,
        sandboxed: frozenset[str] = frozenset(),
    ):
        self.client, self.session, self.network, self.clock = client, session, network, clock
        # pod name -> its fixed address (a manifest that reads status.podIP needs one known
        # before the pod starts); an init container runs without one (it ends before the pod's
        # containers start, and two containers cannot hold one address on one network).
        self.addresses = dict(addresses or {})
        # variable -> the value of the Secret key it reads (secretKeyRef), as the kubelet reads
        # the cluster's Secrets; a pod gets those it names, into the API request only.
        self.secrets = dict(secrets or {})
        # Pods whose container the rehearsal kills and starts again in place: each gets a sandbox
        # holding its address (sandbox_args). Without one, a killed container's address vanishes
        # from the network and a peer's connection to it goes unanswered until the kernel's
        # neighbour entry fails (measured here: 39 s; up to about 70 s), where the kubelet's pod
        # refuses it at once.
        self.sandboxed = sandboxed

    def _create(self, pod: PodRun, address: str) -> dict[str, Any]:
        create = run_args(pod, self.session, self.network, address)
        create["environment"] += [
            f"{name}={self.secrets[name]}" for name, _ in pod.secrets if name in self.secrets
        ]
        return create

    def start(self, pod: PodRun) -> PodState:
        address = "" if pod.init else self.addresses.get(pod.pod, "")
        create = self._create(pod, address)
        sandbox = ""
        if (pod.pod in self.sandboxed or pod.sidecars) and not pod.init:  # a pod of several: one namespace
            sandbox = sandbox_name(self.session, pod)
            made = run_detached(self.client, **sandbox_args(pod, self.session, self.network, address))
            done = made if not made.ok else run_detached(self.client, **in_sandbox(create, sandbox))
            for sidecar in pod.sidecars if done.ok else ():
                beside = {**self._create(sidecar, address), "name": sidecar_name(self.session, pod, sidecar)}
                done = run_detached(self.client, **in_sandbox(beside, sandbox))
                if not done.ok:
                    break
        else:
            done = run_detached(self.client, **create)
        state = PodState(pod, container_name(self.session, pod), self.clock(), sandbox=sandbox)
        if not done.ok:
            state.status, state.exit_code = "not started", done.code
            state.start_error = done.err.strip()[-300:]
            state.probes = [ProbeState(p) for p in pod.probes]
            return state
        state.probes = [ProbeState(p, next_at=state.started_at + p.initial_delay_s) for p in pod.probes]
        return state

    def run_to_completion(
        self, pod: PodRun, timeout: float, meanwhile: Callable[[], None] | None = None
    ) -> PodState:
        """An init container: it must exit 0 before the pod's containers start; looked at every
        TICK_S, as the kubelet relists its containers. `meanwhile` runs between looks (the
        kubelet probes the other pods while this one initializes: a P/D router's init waits on
        the roles, whose own probes go on)."""
        state = self.start(pod)
        deadline = self.clock() + timeout
        while state.status == "running":
            self.refresh(state)
            if state.status == "running" and self.clock() > deadline:
                self.kill(state)
                state.status, state.exit_code = "exited", -1
            elif state.status == "running":
                if meanwhile is not None:
                    meanwhile()
                interrupt.sleep(TICK_S)  # Ctrl-C and SIGTERM end the wait here
        return state

    def kill(self, state: PodState) -> str | None:
        """SIGKILL (`docker kill`), as a node lost or an OOM kill ends a process; None when
        done, else the engine's reason."""
        with refusals() as refused:
            self.client.api.kill(state.name)
        return refused.reason

    def kill_until_ended(self, state: PodState, bound_s: float) -> str | None:
        """SIGKILL the pod's container and wait until it has ended (the kill is a state, not the
        moment `docker kill` returns), within `bound_s`; None once ended, else why not."""
        refused = self.kill(state)
        if refused is not None:
            return refused
        deadline = self.clock() + bound_s
        while True:
            self.refresh(state)
            if state.status != "running":
                return None
            if self.clock() > deadline:
                return f"{state.name} still runs {bound_s:.0f} s after SIGKILL"
            interrupt.sleep(KILL_POLL_S)  # Ctrl-C and SIGTERM end the wait here

    def start_in_place(self, state: PodState) -> str | None:
        """The ended container started again (`docker start`: its name, address and
        environment), as the kubelet restarts a pod's container in place; None when started,
        else the engine's reason."""
        with refusals() as refused:
            self.client.api.start(state.name)
        if refused.reason is None:
            state.status, state.exit_code = "running", None
        return refused.reason

    def log(self, state: PodState, tail: int | None = None) -> str:
        """The container's log (`kubectl logs`), stdout then stderr, each line with its time: as
        the `docker logs` CLI's two streams were read back to back."""
        return "".join(docker_verbs.logs_by_stream(self.client, state.name, tail))

    def exec_beside(self, state: PodState, container: str, argv: Sequence[str], timeout: float) -> Ran:
        """`kubectl exec -c CONTAINER`: a command in another of the pod's containers."""
        sidecar = next((s for s in state.pod.sidecars if s.container == container), None)
        if sidecar is None:
            return Ran(1, "", f"pod {state.pod.pod} has no container {container!r}")
        return exec_in(self.client, sidecar_name(self.session, state.pod, sidecar), argv, timeout)

    def refresh(self, state: PodState) -> None:
        status, code, ip = container_state(self.client, state.name)
        if state.sandbox and not ip:  # the address is the sandbox's
            ip = container_state(self.client, state.sandbox)[2]
        state.ip = ip or state.ip
        if status in ("exited", "dead", ""):
            state.status, state.exit_code = "exited", code
        for sidecar in state.pod.sidecars if state.status == "running" else ():
            status, code, _ = container_state(self.client, sidecar_name(self.session, state.pod, sidecar))
            if status in ("exited", "dead", ""):  # the pod's other container ended: it is not running
                state.status, state.exit_code = "exited", code
                state.start_error = f"its container {sidecar.container} exited with {code}"

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
                ok, detail = exec_probe(self.client, state.name, ps.probe)
            elif not state.ip:
                ok, detail = False, "no IP"
            else:
                over_network = tcp_probe if ps.probe.action == "tcp" else http_probe
                ok, detail = over_network(state.ip, ps.probe, ps.probe.timeout_s)
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


def _start_each(kubelet: Kubelet, pods: list[PodRun], timeout: float, progress: Progress) -> list[PodState]:
    states: list[PodState] = []
    for pod in pods:
        if pod.init:
            progress(f"{pod.pod}: init container {pod.container} runs to its end before the pod starts")
            running = [s for s in states if not s.pod.init and s.status == "running"]

            def probe_the_others(running: list[PodState] = running) -> None:
                for other in running:
                    kubelet.refresh(other)
                    kubelet.probe_once(other)

            state = kubelet.run_to_completion(pod, timeout, probe_the_others if running else None)
            states.append(state)
            if state.exit_code != 0:
                break
        else:
            states.append(kubelet.start(pod))
    return states


def start_and_watch(
    kubelet: Kubelet,
    pods: tuple[PodRun, ...],
    forwarders: Sequence[PodRun],
    serving_pod: str,
    ready_s: float,
    options: Options,
    progress: Progress,
) -> tuple[list[PodState], str | None, PodState | None]:
    """The Services' forwarders (kube-proxy is up before any pod), then each pod's init containers
    to completion, then its container; the leader first (the LWS controller creates the group's
    pods together; the order only saves the workers a retry). With --leader-delay, the workers
    first and the rest that much later, as a leader pod still pulling its image or downloading
    would start. Then watched until the serving pod is ready, within its rendered startup
    probe's budget (`ready_s`): the states, why not (None: ready) and the serving pod's state
    (None: an init container failed before it started)."""
    timeout = options.timeout_s
    states = _start_each(kubelet, list(forwarders), timeout, progress)
    if options.leader_delay_s > 0:
        states += _start_each(kubelet, [p for p in pods if p.role == "worker"], timeout, progress)
        interrupt.sleep(options.leader_delay_s)
        states += _start_each(kubelet, [p for p in pods if p.role != "worker"], timeout, progress)
    else:
        states += _start_each(kubelet, list(pods), timeout, progress)
    progress(f"started {len(states)} container(s) on network {kubelet.network}")
    failed_init = [s for s in states if s.pod.init and s.exit_code != 0]
    if failed_init:  # the kubelet never starts the pod's containers after a failed init
        first = failed_init[0]
        how = (
            f"did not end within {options.timeout_s} s (raise --timeout)"
            if first.exit_code == -1
            else f"exited with {first.exit_code}"
        )
        return states, f"init container {first.pod.container} of {first.pod.pod} {how}", None
    deadline = kubelet.clock() + max(options.timeout_s, ready_s)
    serving = next(s for s in states if s.pod.pod == serving_pod and not s.pod.init)
    return states, watch(kubelet, states, serving, deadline, progress), serving


def watch(
    kubelet: Kubelet, states: list[PodState], leader: PodState, deadline: float, progress: Progress
) -> str | None:
    """Probe until the serving pod (`leader`, one of `states`) is ready; why not, when a container
    ended, a node's vLLM printed a fatal traceback (checked every FATAL_EVERY_S), or time ran out."""
    announced = False
    next_scan = kubelet.clock() + FATAL_EVERY_S
    while True:
        for state in states:
            if state.status == "running":
                kubelet.refresh(state)
            if state.status != "running" and not state.pod.init:
                return f"{state.pod.pod} ({state.pod.role}) exited with code {state.exit_code}"
            if state.pod.init and state.exit_code not in (0, None):
                return (
                    f"init container {state.pod.container} of {state.pod.pod} exited with {state.exit_code}"
                )
        for state in states:  # the serving pods' own probes (a P/D pair's roles and router)
            if state.pod.role in ("leader", "server") and not state.pod.init and state.status == "running":
                kubelet.probe_once(state)
        if leader.ready_s is not None:
            return None
        if not announced and leader.started:
            progress(f"{leader.pod.pod}: startup probe passed")
            announced = True
        if kubelet.clock() > next_scan:
            next_scan = kubelet.clock() + FATAL_EVERY_S
            for state in states:
                line = fatal_line(kubelet.log(state, tail=400)) if state.status == "running" else None
                if line:
                    return f"{state.pod.pod} ({state.pod.role}): vLLM failed: {line}"
        if kubelet.clock() > deadline:
            return f"{leader.pod.pod} not ready within {deadline - leader.started_at:.0f} s"
        interrupt.sleep(TICK_S)  # Ctrl-C and SIGTERM end the wait here
