"""`m31ctl rehearse`: run a plan's exact layout and rendered commands for real, with vLLM's CPU
build, on a private Docker network; then remove everything it made, even on Ctrl-C or failure.

The steps: the plan's rehearsal twin (twin.py) rendered by the normal render code; the manifest
read into pods (pods.py) with the environment the LWS controller and the kubelet give them; the
pods started and probed (kubelet.py); completions and smoke sent through the leader; each node's
log read for its ranks, addresses and, on failure, its own error line (logs.py). Side effects go
through the rehearsal's Docker verbs (docker_verbs.py) over the program's one Docker client
(m31ctl/runtime/engine_api.py), and HTTP to the containers' private addresses.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import json
import os
import secrets
import shutil
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from m31ctl import interrupt
from m31ctl.deployment import Deployment, derive
from m31ctl.errors import HostPreconditionError, InputError, M31Error
from m31ctl.labels import Label
from m31ctl.plan import Plan
from m31ctl.redact import API_KEY_ENV
from m31ctl.rehearsal import docker_verbs, pairing
from m31ctl.rehearsal.kubelet import Kubelet, PodState, claim_volume
from m31ctl.rehearsal.logs import failure_cause, read_log, root_cause
from m31ctl.rehearsal.pods import Manifest, PodRun, ServiceRun, Volume, read_manifest, secret_mark
from m31ctl.rehearsal.result import NodeOutcome, ProbeOutcome, RehearsalResult
from m31ctl.rehearsal.twin import Twin, rehearsal_twin
from m31ctl.render import get_target
from m31ctl.render.k8s import API_SERVICE_SUFFIX
from m31ctl.resources import cache_root
from m31ctl.runtime import engine_api
from m31ctl.served import smoke

BASE_IMAGE = "m31ctl/vllm-cpu:0.32.0"  # scripts/build-rehearsal-image
PYTHON = "/opt/vllm/bin/python"  # the rehearsal image's (vLLM's) Python
# The base image's `vllm` console script fails its own version lookup (the distribution is
# named vllm-cpu), so `vllm serve`, which every rendered command runs, would not start. The
# derived image records a `vllm` distribution with the +cpu version vLLM's platform detection
# reads (vllm/platforms: vllm_version_matches_substr("cpu")); nothing else changes.
SHIM_IMAGE = "m31ctl/vllm-cpu-rehearse:0.32.0"
# The longest one Engine API request may take on a loaded two-core host (the `docker` CLI calls
# it replaced had 20-120 s each); the build, the model and the waits give their own.
REQUEST_TIMEOUT_S = 120.0
BUILD_TIMEOUT_S = 600.0
MODEL_TIMEOUT_S = 600.0


# The slow-load plugin (a vLLM general plugin, m31ctl/rehearsal/slow_load/): installed into the
# derived image's site-packages, acting only where M31CTL_REHEARSAL_LOAD_DELAY_S is set.
SLOW_LOAD_DIR = Path(__file__).resolve().parent / "slow_load"
SITE_PACKAGES = "/opt/vllm/lib/python3.11/site-packages"


def _slow_load_files() -> list[tuple[str, bytes]]:
    return sorted(
        (str(path.relative_to(SLOW_LOAD_DIR)), path.read_bytes())
        for path in SLOW_LOAD_DIR.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    )


def _shim_digest() -> str:
    digest = hashlib.sha256()
    for name, data in _slow_load_files():
        digest.update(name.encode() + b"\0" + data)
    return digest.hexdigest()[:8]


def shim_image(base: str) -> str:
    """The derived image's tag for a base image (another base, e.g. one with Ray, gets its own),
    with the plugin's digest: a changed plugin makes a new image."""
    if base == BASE_IMAGE:
        return f"{SHIM_IMAGE}-{_shim_digest()}"
    name, _, tag = base.rpartition(":") if ":" in base.rsplit("/", 1)[-1] else (base, "", "latest")
    return f"{name}-rehearse:{tag}-{_shim_digest()}"


SHIM_DOCKERFILE = """FROM {base}
RUN d={site}/vllm-0.32.0.dist-info && mkdir -p "$d" \\
 && printf 'Metadata-Version: 2.1\\nName: vllm\\nVersion: 0.32.0+cpu\\n' > "$d/METADATA" \\
 && vllm --version
{plugin}
LABEL {base_label}="{base}"
"""


def shim_dockerfile(base: str) -> str:
    """The derived image: the `vllm` distribution record, and the slow-load plugin's files
    (base64 in the Dockerfile: a build from a Dockerfile alone has no context to copy from)."""
    lines = [
        f"RUN mkdir -p {SITE_PACKAGES}/{Path(name).parent} && echo {base64.b64encode(data).decode()} "
        f"| base64 -d > {SITE_PACKAGES}/{name}"
        for name, data in _slow_load_files()
    ]
    return SHIM_DOCKERFILE.format(
        base=base, base_label=Label.REHEARSAL_BASE, site=SITE_PACKAGES, plugin="\n".join(lines)
    )


TARGETS = ("k8s",)
PACKAGE_DIR = Path(__file__).resolve().parent
GENERATORS = ("make_tiny_model.py", "make_tiny_moe.py")
TICK_S = 1.0
# How long a node may take to die after the first answers (a rank dying at its first request).
SETTLE_S = 3.0
# How often the logs are read for a fatal traceback while waiting (a failed node may not exit).
FATAL_EVERY_S = 10.0
NOT_EMULATED = {
    "NetworkPolicy": "NetworkPolicy (not enforced: one private Docker network)",
    "PersistentVolumeClaim": "",
    "Service": "",
    "LeaderWorkerSet": "",
    "Deployment": "",
}


# Never emulated: every pod runs on this one host.
SCHEDULING = "scheduling (nodeSelector, tolerations, GPU/RDMA resources, cpu and memory requests)"


class Options(NamedTuple):
    target: str = "k8s"
    keep: bool = False
    timeout_s: int = 600
    base_image: str = BASE_IMAGE
    cache_dir: Path | None = None
    # Rehearse at the plan's own clock scaled by this factor, with a load that long injected
    # into every engine (twin.scaled_clock); None: the tiny model's own start, within timeout_s.
    clock_scale: float | None = None
    # Start the leader this many seconds after its workers (a leader still pulling or downloading).
    leader_delay_s: float = 0.0


class Prepared(NamedTuple):
    twin: Twin
    deployment: Deployment
    manifest: Manifest
    model_dir: Path
    # A P/D plan's aggregated reference server (the twin without disaggregation, rendered by
    # the same code): the pod, and the claims its render declares. None: not a P/D plan.
    reference: PodRun | None = None
    reference_claims: tuple[str, ...] = ()

    @property
    def addressed(self) -> bool:
        """The pods need fixed addresses: one reads its own (status.podIP: a P/D role's NIXL
        side channel binds it), or a Service maps ports (its forwarder needs the target's)."""
        return any(p.fields for p in self.manifest.pods) or bool(self.manifest.forwarded)


def _cache_root(options: Options) -> Path:
    return options.cache_dir if options.cache_dir is not None else cache_root() / "rehearsal"


def model_dir_for(root: Path, moe: bool) -> Path:
    """Where the tiny model for this kind lives: keyed on the generators' bytes, so an edit of
    them makes a new one (the weights are seeded: the same code makes the same model)."""
    digest = hashlib.sha256(b"".join((PACKAGE_DIR / g).read_bytes() for g in GENERATORS)).hexdigest()[:10]
    return root / f"tiny-{'moe' if moe else 'llama'}-{digest}"


def render_documents(deployment: Deployment, target: str) -> list[dict[str, Any]]:
    """The target rendered by the normal render code, read back as the documents it holds."""
    documents: list[dict[str, Any]] = []
    for artifact in get_target(target)(deployment):
        if artifact.name.endswith((".yaml", ".yml")):
            documents += [d for d in yaml.safe_load_all(artifact.content) if d]
    return documents


def prepare(plan: Plan, options: Options) -> Prepared:
    """Everything decided before any container starts: a layout or render m31ctl refuses
    raises here (exit 2), so nothing is left to clean."""
    if options.target not in TARGETS:
        raise InputError(
            f"rehearse runs the {', '.join(TARGETS)} target, not {options.target!r}",
            hint="--target k8s (its LeaderWorkerSet is the multi-node layout worth rehearsing)",
        )
    moe = plan.settings.parallelism.expert
    model_dir = model_dir_for(_cache_root(options), moe)
    twin = rehearsal_twin(
        plan, str(model_dir), shim_image(options.base_image), options.timeout_s, options.clock_scale
    )
    deployment = derive(twin.plan)
    manifest = read_manifest(
        render_documents(deployment, options.target), deployment.name + API_SERVICE_SUFFIX
    )
    if not [p for p in manifest.pods if not p.init]:
        raise InputError(f"the {options.target} render holds no pod to run")
    refuse_secret_expansion(manifest)
    if deployment.disaggregated is None:
        return Prepared(twin, deployment, manifest, model_dir)
    reference, claims = reference_pod(twin.plan, options.target)
    return Prepared(twin, deployment, manifest, model_dir, reference, claims)


# The aggregated reference server's pod (and container) name in a P/D rehearsal.
REFERENCE_POD = "reference"


def reference_pod(paired: Plan, target: str) -> tuple[PodRun, tuple[str, ...]]:
    """The P/D twin's aggregated twin (the same settings, disaggregation off) rendered by the
    normal render code: its serving pod, renamed and without the Service names (those are the
    pair's), and the claims it mounts."""
    settings = paired.settings
    alone = settings.model_copy(
        update={"disaggregation": settings.disaggregation.model_copy(update={"enabled": False})}
    )
    deployment = derive(paired._replace(settings=alone))
    manifest = read_manifest(render_documents(deployment, target), deployment.name + API_SERVICE_SUFFIX)
    pod = next(p for p in manifest.pods if p.pod == manifest.api_pod and not p.init)
    return pod._replace(pod=REFERENCE_POD, hostname=REFERENCE_POD, aliases=()), manifest.claims


def refuse_secret_expansion(manifest: Manifest) -> None:
    """A command or args word the kubelet would expand into a secret's value (argv is visible
    in ps and in the node's logs): refused before anything starts."""
    for pod in manifest.pods:
        words = [*(pod.command or ()), *(pod.args or ())]
        leaked = [name for name, _ in pod.secrets if any(secret_mark(name) in w for w in words)]
        if leaked:
            raise InputError(
                f"pod {pod.pod}: its command expands the secret {leaked[0]} into argv "
                "(visible in ps and the node's logs)",
                hint="read the secret from the environment inside the process, never via $(NAME)",
            )


def ensure_image(client: Any, base: str) -> str:
    if engine_api.local_image(client, base) is None:
        raise HostPreconditionError(
            f"the rehearsal image {base} is not here", hint="build it: scripts/build-rehearsal-image"
        )
    shim = shim_image(base)
    if engine_api.local_image(client, shim) is None:
        failed = docker_verbs.build_image(client, shim, shim_dockerfile(base), BUILD_TIMEOUT_S)
        if failed is not None:
            raise HostPreconditionError(f"building {shim} failed: {failed.strip()[-500:]}")
    return shim


def ensure_model(client: Any, base: str, model_dir: Path, moe: bool, session: str) -> None:
    """The tiny model, made inside the rehearsal image (it has torch and transformers) on the
    first run of a kind, then reused. Made under a temporary name and renamed: a Ctrl-C never
    leaves half a model behind under the real name."""
    if (model_dir / "config.json").is_file():
        return
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = model_dir.with_name(f"{model_dir.name}.{session}.tmp")
    generator = GENERATORS[1] if moe else GENERATORS[0]
    mounts = [
        {"Type": "bind", "Source": str(PACKAGE_DIR), "Target": "/m31ctl-rehearsal", "ReadOnly": True},
        {"Type": "bind", "Source": str(model_dir.parent), "Target": "/out", "ReadOnly": False},
    ]
    try:
        done = docker_verbs.run_to_end(
            client,
            MODEL_TIMEOUT_S,
            host={"mounts": mounts, "network_mode": "none"},
            image=base,
            labels={Label.REHEARSAL: session},
            user=f"{os.getuid()}:{os.getgid()}",
            environment=["HOME=/tmp"],
            entrypoint=[PYTHON],
            command=[f"/m31ctl-rehearsal/{generator}", f"/out/{scratch.name}"],
        )
        if not done.ok:
            raise HostPreconditionError(f"making the tiny model failed: {done.err.strip()[-500:]}")
        for path in [scratch, *scratch.iterdir()]:
            path.chmod(0o755 if path.is_dir() else 0o644)  # mounted read-only, read by any user
        scratch.rename(model_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # gone when renamed; half a model otherwise


def required_secrets(manifest: Manifest) -> list[str]:
    """The secrets a pod cannot start without (secretKeyRef without optional: the kubelet holds
    the pod in CreateContainerConfigError until the Secret has them)."""
    return sorted({name for pod in manifest.pods for name, optional in pod.secrets if not optional})


@contextmanager
def secret_values(manifest: Manifest) -> Iterator[dict[str, str]]:
    """Values for the required secrets: the user's exported one, else a fresh one for this
    rehearsal. VLLM_API_KEY is also set in this process while it runs, so smoke sends it.
    Optional secrets (HF_TOKEN: the tiny model is local) are not passed."""
    required = required_secrets(manifest)
    refs = {name: ref for pod in manifest.pods for name, ref in pod.secret_refs if name in required}
    by_ref: dict[str, str] = {}
    for name in required:  # one value per Secret key, whichever variable reads it
        exported = os.environ.get(name)
        if exported:
            by_ref.setdefault(refs.get(name, name), exported)
    values = {name: by_ref.setdefault(refs.get(name, name), secrets.token_urlsafe(24)) for name in required}
    saved = os.environ.get(API_KEY_ENV)
    if API_KEY_ENV in values:
        os.environ[API_KEY_ENV] = values[API_KEY_ENV]
    try:
        yield values
    finally:
        if saved is None:
            os.environ.pop(API_KEY_ENV, None)


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (a CI job cancelled, `docker stop` of a runner) stops a rehearsal as Ctrl-C does,
    through the cleanup; by default it would end the process with everything left running. Both
    are recorded and taken at the waits' checks (m31ctl.interrupt), never raised mid-step."""
    with interrupt.handling():
        yield


@contextmanager
def no_interrupts() -> Iterator[None]:
    """Cleanup runs to its end: a second Ctrl-C (or a SIGTERM) while removing would leave
    things behind, so it only asks, and a third abandons the cleanup (m31ctl.interrupt.shielded)."""
    with interrupt.shielded():
        yield


Progress = Callable[[str], None]


def start_pods(
    kubelet: Kubelet,
    manifest: Manifest,
    keys: dict[str, str],
    timeout: float,
    leader_delay_s: float = 0.0,
    progress: Progress = lambda _: None,
) -> list[PodState]:
    """Each pod's init containers to completion, then its container; the leader first (the LWS
    controller creates the group's pods together; the order only saves the workers a retry).
    With `leader_delay_s`, the workers first and the rest that much later, as a leader pod still
    pulling its image or downloading would start."""
    if leader_delay_s > 0:
        workers = [p for p in manifest.pods if p.role == "worker"]
        first = _start_each(kubelet, workers, keys, timeout, progress)
        interrupt.sleep(leader_delay_s)
        rest = [p for p in manifest.pods if p.role != "worker"]
        return first + _start_each(kubelet, rest, keys, timeout, progress)
    return _start_each(kubelet, list(manifest.pods), keys, timeout, progress)


def _start_each(
    kubelet: Kubelet, pods: list[PodRun], keys: dict[str, str], timeout: float, progress: Progress
) -> list[PodState]:
    states: list[PodState] = []
    for pod in pods:
        if pod.init:
            progress(f"{pod.pod}: init container {pod.container} runs to its end before the pod starts")
            running = [s for s in states if not s.pod.init and s.status == "running"]

            def probe_the_others(running: list[PodState] = running) -> None:
                for other in running:
                    kubelet.refresh(other)
                    kubelet.probe_once(other)

            state = kubelet.run_to_completion(pod, keys, timeout, probe_the_others if running else None)
            states.append(state)
            if state.exit_code != 0:
                break
        else:
            states.append(kubelet.start(pod, keys))
    return states


def serving_state(states: list[PodState], api_pod: str = "") -> PodState:
    """The pod clients reach (the API Service's: a P/D plan's router), else the first leader."""
    serving = [s for s in states if s.pod.role in ("leader", "server") and not s.pod.init]
    return next((s for s in serving if s.pod.pod == api_pod), serving[0])


def fatal_in_log(client: Any, state: PodState) -> str | None:
    """A node whose vLLM printed a fatal traceback but whose container lives on (a failing API
    server child leaves the parent `vllm serve` waiting): its final exception line."""
    text = "".join(docker_verbs.logs_by_stream(client, state.name, tail=400))
    if "Traceback (most recent call last)" not in text:
        return None
    return read_log(text).error_line


def watch(
    kubelet: Kubelet, states: list[PodState], deadline: float, progress: Progress, api_pod: str = ""
) -> str | None:
    """Probe until the serving pod is ready; why not, when a container ended, a node's vLLM
    printed a fatal traceback (checked every FATAL_EVERY_S), or time ran out."""
    leader = serving_state(states, api_pod)
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
                line = fatal_in_log(kubelet.client, state) if state.status == "running" else None
                if line:
                    return f"{state.pod.pod} ({state.pod.role}): vLLM failed: {line}"
        if kubelet.clock() > deadline:
            return f"{leader.pod.pod} not ready within {deadline - leader.started_at:.0f} s"
        interrupt.sleep(TICK_S)  # Ctrl-C and SIGTERM end the wait here


def new_session() -> str:
    return uuid.uuid4().hex[:8]


def completions(endpoint: str, model: str, count: int, headers: dict[str, str], timeout: float) -> int:
    """`count` completions at once through the leader (data-parallel ranks each get some: the
    coordinator balances by load); how many were answered 200 with text."""
    body = json.dumps({"model": model, "prompt": "The rehearsal says", "max_tokens": 8, "temperature": 0})

    def one(_: int) -> bool:
        request = urllib.request.Request(
            f"{endpoint}/v1/completions",
            data=body.encode(),
            headers={"Content-Type": "application/json", **headers},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                data = json.loads(answer.read(1 << 20))
            return answer.status == 200 and bool(data.get("choices"))
        except (OSError, ValueError):
            return False

    with ThreadPoolExecutor(max_workers=count) as pool:
        return sum(pool.map(one, range(count)))


class Served(NamedTuple):
    endpoint: str
    sent: int
    answered: int
    smoke: dict[str, Any]

    @property
    def ok(self) -> bool:
        return self.answered == self.sent and bool(self.smoke.get("ok"))


def api_port(pod: PodRun, prepared: Prepared) -> int:
    """The port a pod serves its API on: vLLM's is named http, vllm-router's (a P/D plan's
    front) api; else the plan's container port."""
    ports = dict(pod.ports)
    return ports.get("http") or ports.get("api") or prepared.deployment.network.container_port


def serve_checks(prepared: Prepared, leader: PodState, timeout: float) -> Served:
    """Completions and smoke through the leader, at its pod address and the Service's target
    port (where the Service sends in-cluster clients)."""
    port = api_port(leader.pod, prepared)
    endpoint = f"http://{leader.ip}:{port}"
    served_name = prepared.twin.plan.settings.model.served_name
    count = max(2, 2 * prepared.twin.plan.settings.parallelism.data)
    answered = completions(endpoint, served_name, count, smoke.auth_headers(), timeout)
    try:
        found = smoke.run(endpoint, served_name, max_tokens=16, timeout=timeout).to_json()
    except M31Error as exc:  # the server stopped answering: a finding of the rehearsal, not its end
        found = {"endpoint": endpoint, "ok": False, "error": str(exc)}
    return Served(endpoint, count, answered, found)


def node_outcomes(client: Any, states: list[PodState], run_failed: bool) -> tuple[NodeOutcome, ...]:
    """Each node as it ended: vLLM's rank lines, its time to ready, and, when the rehearsal
    failed, its own error line and the likely cause."""
    out = []
    for state in states:
        # stdout, then stderr: as the `docker logs` CLI's two streams were read back to back
        text = (
            "".join(docker_verbs.logs_by_stream(client, state.name)) if state.status != "not started" else ""
        )
        log = read_log(text)
        ended_badly = state.exit_code not in (None, 0)
        line = log.error_line if (ended_badly or run_failed) else None
        if state.status == "not started":  # docker refused to create it: its message is the line
            line = state.start_error or line
        ready = state.ready_s
        if ready is None and log.engine_ready_at is not None:
            ready = round(log.engine_ready_at - state.started_wall, 1)
        out.append(
            NodeOutcome(
                pod=state.pod.pod,
                role=state.pod.role if not state.pod.init else f"init ({state.pod.container})",
                worker_index=state.pod.worker_index,
                container=state.name,
                address=state.ip,
                command=(*(state.pod.command or ()), *(state.pod.args or ())),
                ranks=log.ranks,
                ready_s=ready,
                exit_code=state.exit_code if state.status != "running" else None,
                error_line=line,
                cause=failure_cause(line, text, state.exit_code) if line else None,
            )
        )
    return tuple(out)


def probe_outcomes(states: list[PodState]) -> tuple[ProbeOutcome, ...]:
    return tuple(
        ProbeOutcome(
            s.pod.pod,
            p.probe.describe(),
            p.attempts,
            bool(p.passes) and not p.failures_in_row,
            p.first_pass_s,
            p.last_error,
        )
        for s in states
        for p in s.probes
    )


def _layout_words(prepared: Prepared) -> str:
    group = prepared.deployment.disaggregated
    if group is not None:
        roles = " + ".join(
            f"{r.kv_transfer.role.value} TP{r.layout.tensor}" for r in group.roles if r.kv_transfer
        )
        return f"P/D pair: {roles}, one Deployment each, behind vllm-router (with an aggregated reference)"
    par = prepared.twin.plan.settings.parallelism
    kind = "LeaderWorkerSet" if par.nodes > 1 else "Deployment"
    shape = f"TP{par.tensor} PP{par.pipeline} DP{par.data}" + (" EP" if par.expert else "")
    return f"{shape} on {par.nodes} node(s) ({kind}), {prepared.twin.ranks_per_node} rank(s) a node"


def failing_node(nodes: tuple[NodeOutcome, ...]) -> NodeOutcome | None:
    """The node to blame: one that ended badly, else one whose error line names a cause of its
    own (a worker's NotImplementedError rather than the leader's "Worker failed, see above"),
    else the first with an error line."""
    ended = [n for n in nodes if n.exit_code not in (None, 0)]
    rooted = [n for n in nodes if root_cause(n.error_line)]
    ranked = [n for n in ended if root_cause(n.error_line)] + ended + rooted
    return next(iter(ranked), next((n for n in nodes if n.error_line), None))


class Run(NamedTuple):
    """What happened between the first container and the cleanup."""

    states: list[PodState]
    why: str | None  # why it did not serve; None when it served
    served: Served | None
    pairing: pairing.PairingOutcome | None = None  # a P/D plan's proof (pairing.py)


# Fixed addresses on the rehearsal network start at this host of its subnet (Docker takes .1).
FIRST_POD_HOST = 10
FORWARDER_MOUNT = "/m31ctl-rehearsal"


def forwarder_pod(service: ServiceRun, image: str, addresses: dict[str, str]) -> PodRun:
    """A Service that maps ports, as kube-proxy gives it: a container holding the Service's DNS
    names that forwards each port to the selected pod's address and target port (forwarder.py)."""
    rules = tuple(f"{port}={addresses[service.pod]}:{target}" for port, target in service.ports)
    return PodRun(
        pod=service.forwarder_pod,
        container="forwarder",
        role="service",
        worker_index=0,
        image=image,
        command=(PYTHON, f"{FORWARDER_MOUNT}/forwarder.py"),
        args=rules,
        env=(),
        secrets=(),
        volumes=(Volume("host", str(PACKAGE_DIR), FORWARDER_MOUNT, True),),
        ports=(),
        probes=(),
        hostname=service.forwarder_pod[:63],
        aliases=service.dns_names,
        cap_add=(),
        unconfined=False,
        ipc_host=False,
    )


def pod_addresses(subnet: str, prepared: Prepared) -> dict[str, str]:
    """Each pod's fixed address (and the forwarders' and the reference's), in manifest order."""
    names = list(dict.fromkeys(p.pod for p in prepared.manifest.pods if not p.init))
    names += [s.forwarder_pod for s in prepared.manifest.forwarded]
    names += [prepared.reference.pod] if prepared.reference else []
    network = ipaddress.ip_network(subnet)
    return {name: str(network[FIRST_POD_HOST + index]) for index, name in enumerate(names)}


def _network(client: Any, prepared: Prepared, session: str) -> tuple[str, dict[str, str], str | None]:
    """The rehearsal's network (with a subnet of its own when pods need fixed addresses), its
    volumes, and the addresses; or why the network could not be made."""
    network, labels = f"m31ctl-rh-{session}", {Label.REHEARSAL: session}
    subnet = docker_verbs.free_subnet(client, network, labels) if prepared.addressed else None
    if prepared.addressed and subnet is None:
        return network, {}, "no free subnet for the rehearsal network (docker network create failed)"
    refused = engine_api.create_network(client, network, labels, subnet)
    if refused is not None:
        return network, {}, f"docker network create failed: {refused.strip()[-300:]}"
    for claim in (*prepared.manifest.claims, *prepared.reference_claims):
        # Not checked here: a volume the engine refused shows as the pod's own start error.
        docker_verbs.create_volume(client, claim_volume(session, claim), labels)
    return network, (pod_addresses(subnet, prepared) if subnet else {}), None


def run_pods(client: Any, prepared: Prepared, session: str, options: Options, progress: Progress) -> Run:
    network, addresses, refused = _network(client, prepared, session)
    if refused is not None:
        return Run([], refused, None)
    kubelet = Kubelet(client, session, network, addresses=addresses)
    image = prepared.twin.plan.settings.engine.image
    with secret_values(prepared.manifest) as keys:
        states = [kubelet.start(forwarder_pod(s, image, addresses), {}) for s in prepared.manifest.forwarded]
        states += start_pods(
            kubelet, prepared.manifest, keys, options.timeout_s, options.leader_delay_s, progress
        )
        progress(f"started {len(states)} container(s) on network {network}")
        failed_init = [s for s in states if s.pod.init and s.exit_code != 0]
        if failed_init:  # the kubelet never starts the pod's containers after a failed init
            first = failed_init[0]
            how = (
                f"did not end within {options.timeout_s} s (raise --timeout)"
                if first.exit_code == -1
                else f"exited with {first.exit_code}"
            )
            return Run(states, f"init container {first.pod.container} of {first.pod.pod} {how}", None)
        # The rendered startup probe's own budget (the timeline's readiness wait) bounds the wait.
        deadline = kubelet.clock() + max(options.timeout_s, prepared.deployment.timeline.ready_s)
        why = watch(kubelet, states, deadline, progress, prepared.manifest.api_pod)
        if why is not None:
            return Run(states, why, None)
        run = _serve(kubelet, prepared, states, options, progress)
        if run.why is None and prepared.reference is not None:
            return _prove_pair(kubelet, prepared, run, keys, options, progress)
        return run


def _serve(
    kubelet: Kubelet, prepared: Prepared, states: list[PodState], options: Options, progress: Progress
) -> Run:
    leader = serving_state(states, prepared.manifest.api_pod)
    progress(f"{leader.pod.pod} ready after {leader.ready_s} s: sending completions and smoke")
    served = serve_checks(prepared, leader, timeout=min(120.0, options.timeout_s))
    time.sleep(SETTLE_S)  # a rank that dies at its first request takes a moment to be seen
    for state in states:
        kubelet.refresh(state)
    ended = [s for s in states if s.status != "running" and not s.pod.init]
    if ended:
        first = ended[0]
        return Run(states, f"{first.pod.pod} ({first.pod.role}) exited with code {first.exit_code} "
                           "after the first requests", served)  # fmt: skip
    if not served.ok:
        return Run(states, f"{served.answered} of {served.sent} completions answered; smoke ok: "
                           f"{served.smoke.get('ok')}", served)  # fmt: skip
    return Run(states, None, served)


def _engine_url(prepared: Prepared, role: Deployment, states: list[PodState]) -> tuple[str, PodState]:
    """A P/D role's base URL on the rehearsal network (its pod's address and vLLM's port, as
    the role's API Service targets it) and its pod."""
    service = next(s for s in prepared.manifest.services if s.name == role.name + API_SERVICE_SUFFIX)
    state = next(s for s in states if s.pod.pod == service.pod and not s.pod.init)
    return f"http://{state.ip}:{service.ports[0][1]}", state


def _prove_pair(
    kubelet: Kubelet, prepared: Prepared, run: Run, keys: dict[str, str], options: Options, progress: Progress
) -> Run:
    group = prepared.deployment.disaggregated
    assert group is not None and prepared.reference is not None and run.served is not None
    decode, decode_state = _engine_url(prepared, group.decode, run.states)
    _, prefill = _engine_url(prepared, group.prefill, run.states)
    reference = prepared.reference
    started: list[PodState] = []

    def start_reference(budget_s: float) -> tuple[str, str | None]:
        # The pair's checks are done; its engines busy-poll a core each, and a third vLLM
        # start beside them on a host of few cores does not finish (seen here on two cores).
        progress("stopping prefill and decode; starting the aggregated reference server (the same twin, "
                 "disaggregation off)")  # fmt: skip
        for role in (prefill, decode_state):
            docker_verbs.kill(kubelet.client, role.name)
        state = kubelet.start(reference, keys)
        started.append(state)
        why = watch(kubelet, [state], kubelet.clock() + budget_s, progress)
        port = api_port(reference, prepared)
        return f"http://{state.ip}:{port}", why

    pair = pairing.Pair(
        router=run.served.endpoint,
        decode=decode,
        kill_prefill=lambda: docker_verbs.kill(kubelet.client, prefill.name),
        start_prefill=lambda: docker_verbs.start_again(kubelet.client, prefill.name),
        start_reference=start_reference,
        model=prepared.twin.plan.settings.model.served_name,
    )
    progress("proving the pair: parity with an aggregated server, KV transfer, prefill killed and back")
    outcome = pairing.prove(pair, budget_s=max(float(options.timeout_s), 120.0), progress=progress)
    for role in (prefill, decode_state):
        kubelet.refresh(role)
    why = None if outcome.ok else f"the pair: {outcome.failure}"
    return Run([*run.states, *started], why, run.served, outcome)


def rehearse(
    plan: Plan,
    options: Options,
    client: Any | None = None,
    progress: Progress = lambda _: None,
) -> RehearsalResult:
    """Rehearse `plan`: refused layouts raise before any container (InputError, exit 2); the
    result says whether it served. Everything made is removed unless options.keep, also when
    this raises (Ctrl-C included). Engine errors end it through engine_api's one boundary (lost
    engine: 3; refused request: 6)."""
    started = time.monotonic()
    prepared = prepare(plan, options)
    with engine_api.engine_boundary("rehearsing"):
        client = client or engine_api.connect(timeout=REQUEST_TIMEOUT_S)
        timings: dict[str, float] = {}
        image = ensure_image(client, options.base_image)
        timings["image_s"] = round(time.monotonic() - started, 1)
        session = new_session()
        with sigterm_interrupts():
            return _rehearse_session(prepared, options, client, image, session, timings, started, progress)


def _rehearse_session(
    prepared: Prepared,
    options: Options,
    client: Any,
    image: str,
    session: str,
    timings: dict[str, float],
    started: float,
    progress: Progress,
) -> RehearsalResult:
    run = Run([], "interrupted", None)
    try:
        model_started = time.monotonic()
        ensure_model(client, image, prepared.model_dir, prepared.twin.moe, session)
        timings["model_s"] = round(time.monotonic() - model_started, 1)
        progress(f"rehearsing {_layout_words(prepared)}")
        run = run_pods(client, prepared, session, options, progress)
        nodes = node_outcomes(client, run.states, run.why is not None)
    finally:
        leftovers: list[str] = []
        if not options.keep:
            with no_interrupts():
                problems = docker_verbs.remove_labelled(client, Label.REHEARSAL, session)
                leftovers = engine_api.labelled(client, Label.REHEARSAL, session) + problems
    timings["total_s"] = round(time.monotonic() - started, 1)
    return assemble(prepared, run, nodes, timings, tuple(leftovers), options.keep)._replace(session=session)


def assemble(
    prepared: Prepared,
    run: Run,
    nodes: tuple[NodeOutcome, ...],
    timings: dict[str, float],
    leftovers: tuple[str, ...],
    kept: bool,
) -> RehearsalResult:
    blamed = failing_node(nodes) if run.why is not None else None
    not_emulated = (
        *sorted({NOT_EMULATED.get(k, f"{k} (not emulated)") for k in prepared.manifest.kinds} - {""}),
        SCHEDULING,
    )
    return RehearsalResult(
        served=run.why is None,
        plan_hash=prepared.twin.original.hash,
        twin_hash=prepared.twin.plan.hash,
        layout=_layout_words(prepared),
        changes=prepared.twin.changes,
        nodes=nodes,
        probes=probe_outcomes(run.states),
        endpoint=run.served.endpoint if run.served else "",
        completions=run.served.answered if run.served else 0,
        smoke=run.served.smoke if run.served else None,
        failure=run.why,
        failing_node=blamed.pod if blamed else None,
        error_line=blamed.error_line if blamed else None,
        cause=blamed.cause if blamed else None,
        not_emulated=not_emulated,
        timings_s=timings,
        cleaned=not kept and not leftovers,
        leftovers=leftovers,
        kept=kept,
        pairing=run.pairing,
    )
