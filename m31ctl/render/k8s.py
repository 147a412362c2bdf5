"""The Kubernetes target: the documents, built as data (the YAML is only serialized).

One node: a Deployment. A layout over several nodes: a LeaderWorkerSet (kubernetes-sigs/lws), one
pod a node. Either way a claim for the Hugging Face cache, an API Service and a NetworkPolicy.
What the cluster does with each field is written beside it; docs/decisions.md cites the sources.
"""

from __future__ import annotations

import math
import shlex
import textwrap
from typing import Any, NamedTuple

from m31ctl.container import ContainerSpec, render_spec
from m31ctl.deployment import HF_CACHE_IN_CONTAINER, Deployment, Layout
from m31ctl.engine.adapter import DP_RPC_PORT, SIDE_CHANNEL_HOST_ENV, NodeRole, build_invocation
from m31ctl.errors import InputError
from m31ctl.hardware import k8s_product_selector
from m31ctl.labels import Label
from m31ctl.plan.settings import KubernetesSettings
from m31ctl.redact import API_KEY_ENV, HF_TOKEN_ENV
from m31ctl.render.common import engine_secrets, health_command, in_comment, render_template
from m31ctl.render.download import download_step, wait_command
from m31ctl.render.k8s_copies import claim_shared_by, hf_cache_claim, replicas, rollout_note, rollout_of
from m31ctl.render.kubelet_expansion import literal
from m31ctl.revision import is_commit
from m31ctl.timeline import ENDPOINT_REMOVAL_S, ENGINE_READY_ENV, VLLM_HANDSHAKE_S
from m31ctl.units import k8s_quantity

# The Secret and the cache claim are named after the deployment (runtime.container_name): two
# deployments in one namespace must not share a ReadWriteOnce claim (Multi-Attach) or a key.
SECRET_SUFFIX = "-secrets"
HF_CACHE_CLAIM_SUFFIX = "-hf-cache"
PROBE_PERIOD_S = 10
# The API Service's name: LeaderWorkerSet creates the group's headless Service under the LWS's
# own name, and only when no Service has that name; the pods' DNS names (LWS_LEADER_ADDRESS,
# <lws>-0.<lws>.<namespace>) come from it. vLLM's LWS example calls its API Service vllm-leader.
API_SERVICE_SUFFIX = "-api"
# LeaderWorkerSet labels every pod of a group with the set's name (its API reference).
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
RAY_PORT = 6379
_MAX_LABEL = 63
# What every member of a P/D group carries (the roles' pods and the router's): the roles'
# NetworkPolicies admit each other and the router by it (Kubernetes' recommended labels).
PART_OF_LABEL = "app.kubernetes.io/part-of"
# A P/D role advertises its own pod IP to its peer for NIXL's side channel: ZMQ binds an
# address, not a name, and the peer connects to what the role advertises (the downward API).
POD_IP_FIELD = "status.podIP"
# The P/D router pod's port names (render/pd.py). Not "http", the engines' API port: the
# monitoring target's PodMonitor scrapes vLLM's /metrics on "http" and the router's own
# exporter on "metrics", each pod on the ports it has.
ROUTER_API_PORT = "api"
ROUTER_METRICS_PORT = "metrics"


class Group(NamedTuple):
    """The P/D group a role's workload belongs to: one Secret for all members, and a label
    that admits the members to each other."""

    name: str

    @property
    def labels(self) -> dict[str, str]:
        return {PART_OF_LABEL: self.name, "app.kubernetes.io/managed-by": "m31ctl"}


class Pods(NamedTuple):
    """What every document of one render reads."""

    deployment: Deployment
    spec: ContainerSpec
    name: str
    labels: dict[str, str]
    annotations: dict[str, str]
    secrets: tuple[str, ...]  # read from the Secret, by name
    required: tuple[str, ...]  # the pod does not start without these
    group: Group | None = None  # a P/D role's group; None for an aggregated server

    @property
    def secret_name(self) -> str:
        return (self.group.name if self.group else self.name) + SECRET_SUFFIX

    @property
    def claim_name(self) -> str:
        return self.name + HF_CACHE_CLAIM_SUFFIX

    @property
    def k8s(self) -> KubernetesSettings:
        return self.deployment.plan.settings.kubernetes

    @property
    def downloads(self) -> bool:
        """A hub checkpoint is fetched by an init container (a local one is a hostPath)."""
        return not self.deployment.model.local


def k8s_secrets(deployment: Deployment) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The Deployment's secrets, plus the API key unless kubernetes.require_api_key=false: a
    Service puts the API on the cluster network, where runtime.bind's loopback default means
    nothing, and the key guards /v1 only (the NetworkPolicy keeps the rest in)."""
    names, required = deployment.secrets.names, deployment.secrets.required
    if deployment.plan.settings.kubernetes.require_api_key and API_KEY_ENV not in required:
        names = (*[n for n in names if n != API_KEY_ENV], API_KEY_ENV)
        required = (*required, API_KEY_ENV)
    return names, required


def _check(deployment: Deployment) -> None:
    """Refuse what the cluster would refuse or leave pending, naming the setting to change."""
    name = deployment.name
    service = name + API_SERVICE_SUFFIX
    if len(service) > _MAX_LABEL or not name[0].isalpha():
        raise InputError(
            f"runtime.container_name={name!r} names the Kubernetes objects, and the API Service "
            f"{service!r} must be a DNS-1035 label (a letter first, at most {_MAX_LABEL} characters)",
            hint=f"use a name that starts with a letter, at most {_MAX_LABEL - len(API_SERVICE_SUFFIX)} long",
        )
    k8s = deployment.plan.settings.kubernetes
    shared_by = claim_shared_by(deployment)
    if shared_by and not k8s.hf_cache_storage_class:
        raise InputError(
            f"{shared_by}, which share the Hugging Face cache claim (ReadWriteMany): with no storage "
            "class it takes the cluster's default, and a default that is ReadWriteOnce-only leaves "
            "it Pending",
            hint="name a class that provisions ReadWriteMany volumes (NFS, CephFS, a cloud file "
            "store): --set kubernetes.hf_cache_storage_class=NAME",
        )


def _pods(deployment: Deployment, group: Group | None = None) -> Pods:
    spec = render_spec(deployment, in_pod=True)
    name = spec.name  # a DNS-1123 label already (m31ctl/names.py)
    secrets, required = k8s_secrets(deployment)
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/managed-by": "m31ctl"}
    if group is not None:
        labels[PART_OF_LABEL] = group.name
    return Pods(
        deployment=deployment,
        spec=spec,
        name=name,
        labels=labels,
        annotations=dict(spec.labels),
        secrets=secrets,
        required=required,
        group=group,
    )


def k8s_documents(deployment: Deployment, group: Group | None = None) -> list[dict[str, Any]]:
    """The claim, the workload, the API Service and the NetworkPolicy of one engine: the
    aggregated server, or a P/D role of `group` (render/pd.py adds the router)."""
    _check(deployment)
    pods = _pods(deployment, group)
    if deployment.layout.spans_nodes:
        workload = _leader_worker_set(pods)
        members = {LWS_NAME_LABEL: pods.name}
        api_selector = {**members, "role": "leader"}
    else:
        workload = _deployment(pods)
        members = {"app.kubernetes.io/name": pods.name}
        api_selector = members
    return [
        hf_cache_claim(pods.deployment, pods.claim_name, pods.labels),
        workload,
        _api_service(pods, api_selector),
        _network_policy(pods, members),
    ]


def _volumes(pods: Pods) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes and the engine container's mounts of them."""
    spec = pods.spec
    volumes: list[dict[str, Any]] = [
        {"name": "hf-cache", "persistentVolumeClaim": {"claimName": pods.claim_name}},
    ]
    mounts: list[dict[str, Any]] = [{"name": "hf-cache", "mountPath": HF_CACHE_IN_CONTAINER}]
    for index, mount in enumerate(m for m in spec.mounts if m.target != HF_CACHE_IN_CONTAINER):
        # A local checkpoint: the directory on the node (every node, when the group spans nodes).
        volumes.append({"name": f"model-{index}", "hostPath": {"path": mount.source, "type": "Directory"}})
        mounts.append({"name": f"model-{index}", "mountPath": mount.target, "readOnly": True})
    if not spec.ipc_host:
        size = k8s_quantity(spec.shm_size or "64g")
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": size}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


def _env(pods: Pods, values: dict[str, str], secrets: tuple[str, ...]) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in values.items()]
    for secret in secrets:
        # Fail closed: a required key missing from the Secret keeps the pod from starting.
        optional = secret not in pods.required
        ref = {"name": pods.secret_name, "key": secret, "optional": optional}
        env.append({"name": secret, "valueFrom": {"secretKeyRef": ref}})
    return env


def _probes(pods: Pods) -> dict[str, Any]:
    """The startup probe allows the timeline's readiness wait (the group's join, loading and
    compiling, the API: the init container downloaded before it), in whole probe periods."""
    spec = pods.spec
    return {
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": max(1, math.ceil(spec.startup_timeout / PROBE_PERIOD_S)),
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 30,
            "timeoutSeconds": 10,
            "failureThreshold": 3,
        },
        # An exec probe: an httpGet probe would need the API key written into the manifest.
        "readinessProbe": {
            "exec": {"command": health_command(spec, "/v1/models")},
            "periodSeconds": PROBE_PERIOD_S,
            "timeoutSeconds": 10,
        },
    }


def _security_context(pods: Pods) -> dict[str, Any] | None:
    """What the Docker targets add for the vendor (AMD: SYS_PTRACE, and seccomp Unconfined where
    runtime.seccomp_unconfined), only under kubernetes.pod_security=privileged: Pod Security
    "baseline" rejects both, and a kubelet without --seccomp-default runs pods unconfined."""
    if pods.k8s.pod_security != "privileged":
        return None
    spec = pods.spec
    security: dict[str, Any] = {}
    if spec.cap_add:
        security["capabilities"] = {"add": list(spec.cap_add)}
    if "seccomp=unconfined" in spec.security_opt:
        security["seccompProfile"] = {"type": "Unconfined"}
    return security or None


def _cpu_and_memory(pods: Pods) -> dict[str, Any]:
    """Every container's CPU and memory (kubernetes.cpu, kubernetes.memory)."""
    return {"cpu": pods.k8s.cpu, "memory": k8s_quantity(pods.k8s.memory)}


def _guaranteed(resources: dict[str, Any]) -> dict[str, Any]:
    """Requests equal to limits, in every container, init containers included: the pod's QoS
    class is Guaranteed only then (one container without them makes it Burstable), and only a
    Guaranteed pod gets exclusive CPUs from the kubelet's CPU Manager (static policy, integer CPUs)
    aligned by the Topology Manager with its GPUs and NICs, and is evicted last under memory
    pressure (Kubernetes docs, "Pod Quality of Service Classes", "Control CPU Management
    Policies"). An init container asking as much as the engine adds nothing to the pod's
    request, the larger of the two ("Init Containers", resource sharing)."""
    return {"limits": dict(resources), "requests": dict(resources)}


def _engine_container(pods: Pods) -> dict[str, Any]:
    """The vLLM container as one node runs it (the LeaderWorkerSet replaces the command)."""
    spec, k8s = pods.spec, pods.k8s
    spans_nodes = pods.deployment.layout.spans_nodes
    # The vendor's device plugin resource; none on the CPU rehearsal (a pod asking for a GPU
    # would stay Pending on a CPU cluster).
    gpu_resource = pods.deployment.vendor.k8s_resource
    resources: dict[str, Any] = {gpu_resource: pods.deployment.layout.gpus_per_node} if gpu_resource else {}
    resources.update(k8s.network_resources if spans_nodes else {})
    resources.update(_cpu_and_memory(pods))
    env = {**dict(spec.env), **(dict(sorted(k8s.network_env.items())) if spans_nodes else {})}
    _, mounts = _volumes(pods)
    env_entries = _env(pods, env, engine_secrets(pods.secrets))  # the token is the download's only
    if pods.deployment.kv_transfer is not None:
        # The adapter's loopback placeholder becomes the pod's own IP, set by the kubelet.
        pod_ip = {"name": SIDE_CHANNEL_HOST_ENV, "valueFrom": {"fieldRef": {"fieldPath": POD_IP_FIELD}}}
        env_entries = [pod_ip if e["name"] == SIDE_CHANNEL_HOST_ENV else e for e in env_entries]
    container: dict[str, Any] = {
        "name": "vllm",
        "image": spec.image,
        "args": list(spec.args),
        "env": env_entries,
        "ports": [{"name": "http", "containerPort": spec.container_port, "protocol": "TCP"}],
        "resources": _guaranteed(resources),
        "volumeMounts": mounts,
        **_probes(pods),
        # Serve on until the endpoints dropped the pod, then drain (timeline.py ENDPOINT_REMOVAL_S).
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(ENDPOINT_REMOVAL_S)]}}},
    }
    security = _security_context(pods)
    if security:
        container["securityContext"] = security
    return container


def _download_container(pods: Pods, leader: bool = True) -> dict[str, Any] | None:
    """The checkpoint download as an init container, with its own budget (timeline.download).
    In a group that shares the claim only the leader downloads; the workers' init container
    waits for its marker (render/download.py)."""
    step = download_step(pods.deployment, pods.spec.env)
    if step is None:
        return None
    if not leader:
        return {
            "name": "wait-for-checkpoint",
            "image": pods.spec.image,
            "command": wait_command(pods.deployment, step),
            "env": [],
            "resources": _guaranteed(_cpu_and_memory(pods)),
            "volumeMounts": [{"name": "hf-cache", "mountPath": HF_CACHE_IN_CONTAINER, "readOnly": True}],
        }
    return {
        "name": "download",
        "image": pods.spec.image,
        "command": step.command,
        # The engine's environment (HF_ENDPOINT, proxies) but GPU visibility and what only the
        # engine reads (offline mode): it uses no GPU and must reach the hub.
        "env": _env(pods, dict(step.env), (HF_TOKEN_ENV,)),
        "resources": _guaranteed(_cpu_and_memory(pods)),
        "volumeMounts": [{"name": "hf-cache", "mountPath": HF_CACHE_IN_CONTAINER}],
    }


def kubelet_literal(container: dict[str, Any]) -> dict[str, Any]:
    """The kubelet expands $(NAME) in command, args and env values (m31ctl/render/kubelet_expansion.py): every
    `$` of those is doubled, so each reaches the process as the plan wrote it."""
    escaped = dict(container)
    for key in ("command", "args"):
        if key in escaped:
            escaped[key] = [literal(word) for word in escaped[key]]
    escaped["env"] = [
        {**entry, "value": literal(entry["value"])} if "value" in entry else entry for entry in escaped["env"]
    ]
    return escaped


def _pod_spec(pods: Pods, engine: dict[str, Any], leader: bool = True) -> dict[str, Any]:
    spec, k8s, plan = pods.spec, pods.k8s, pods.deployment.plan
    volumes, _mounts = _volumes(pods)
    pod: dict[str, Any] = {
        # Service links would put <SERVICE>_PORT=tcp://... of every Service of the namespace into
        # the environment: a Service named vllm gives VLLM_PORT, which vLLM refuses (vllm/envs.py).
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": pods.deployment.timeline.pod_grace_s,
    }
    selector = {**k8s_product_selector(plan.hardware), **k8s.node_selector}
    if selector:
        pod["nodeSelector"] = selector
    if k8s.tolerations:
        pod["tolerations"] = [dict(t) for t in k8s.tolerations]
    if spec.ipc_host:
        pod["hostIPC"] = True
    download = _download_container(pods, leader)
    if download is not None:
        pod["initContainers"] = [kubelet_literal(download)]
    pod["containers"] = [kubelet_literal(engine)]
    pod["volumes"] = volumes
    return pod


def _deployment(pods: Pods) -> dict[str, Any]:
    template = {"metadata": {"labels": pods.labels, "annotations": pods.annotations}}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": pods.name, "labels": pods.labels, "annotations": pods.annotations},
        "spec": {
            **replicas(pods.deployment),
            "strategy": rollout_of(pods.deployment).deployment,
            # The default 600 s would call every rollout failed (ProgressDeadlineExceeded) long
            # before the image pull, the download and the load are done (m31ctl/timeline.py).
            "progressDeadlineSeconds": pods.deployment.timeline.progress_deadline_s,
            "selector": {"matchLabels": {"app.kubernetes.io/name": pods.name}},
            "template": {**template, "spec": _pod_spec(pods, _engine_container(pods))},
        },
    }


# The leader's IP address, which the pod script resolves from LWS_LEADER_ADDRESS (a DNS name
# the LWS injects) before vLLM starts: ZMQ binds an address, not a name (KServe's LWS pods
# resolve it the same way, with getent). As a shell word.
LEADER_IP = '"${leader_ip}"'
LWS_WORKER_INDEX = "LWS_WORKER_INDEX"


def _serve_line(pods: Pods, role: NodeRole) -> str:
    """`vllm serve ...` for one pod: every word quoted except the LWS expansions the role
    carries, which the pod's shell expands."""
    words = build_invocation(pods.deployment, node=role).serve_argv
    live = {role.leader_address, role.start_rank}
    return " ".join(w if w in live else shlex.quote(w) for w in words)


def pod_script(pods: Pods, leader: bool) -> str:
    """One pod's `/bin/sh -c` script (templates/lws-pod.sh.j2)."""
    layout = pods.deployment.layout
    start_rank = f'"$(({LWS_WORKER_INDEX} * {layout.data_local}))"'
    role = NodeRole(leader, LEADER_IP, "0" if leader else start_rank)
    timeline = pods.deployment.timeline
    return render_template(
        "lws-pod.sh.j2",
        leader=leader,
        over_ray=layout.over_ray,
        serve=_serve_line(pods, role),
        nodes=layout.nodes,
        ray_port=RAY_PORT,
        dp_port=DP_RPC_PORT,
        join_s=timeline.join.seconds,
        leader_wait_s=timeline.leader_wait_s,
        handshake_s=VLLM_HANDSHAKE_S,
    )


def _leader_worker_set(pods: Pods) -> dict[str, Any]:
    """A layout wider than one node, as a LeaderWorkerSet, one node a pod.

    Data parallelism across nodes: every pod runs `vllm serve` with its local DP ranks; the
    leader serves the API, the workers run --headless from their first rank (vLLM's data-parallel
    deployment). TP within a node and PP across nodes: the leader starts the Ray head, waits for
    the group and runs `vllm serve` with the Ray executor; workers join its Ray cluster."""
    engine = _engine_container(pods)
    leader = {k: v for k, v in engine.items() if k != "args"}
    leader["command"] = ["/bin/sh", "-c", pod_script(pods, leader=True)]
    worker = {
        k: v
        for k, v in engine.items()
        if k not in ("args", "startupProbe", "livenessProbe", "readinessProbe", "ports")
    }
    worker.update(name="vllm-worker", command=["/bin/sh", "-c", pod_script(pods, leader=False)])
    meta = {"labels": pods.labels, "annotations": pods.annotations}
    return {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": pods.name, **meta},
        "spec": {
            **replicas(pods.deployment),
            # The workers start with the leader, not after it is Ready: the leader becomes Ready
            # only once the workers joined it (vLLM's DP handshake, Ray's node count), so
            # LeaderReady would deadlock. Each worker waits for the leader's address and port
            # itself (templates/lws-pod.sh.j2).
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": rollout_of(pods.deployment).leader_worker_set,
            "leaderWorkerTemplate": {
                "size": pods.deployment.layout.nodes,
                # One lost pod breaks the group's collectives: restart the whole group (each
                # member then waits for the leader again, so the group cannot loop on its order).
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {
                    "metadata": {
                        "labels": {**pods.labels, "role": "leader"},
                        "annotations": pods.annotations,
                    },
                    "spec": _pod_spec(pods, leader),
                },
                "workerTemplate": {"metadata": meta, "spec": _pod_spec(pods, worker, leader=False)},
            },
        },
    }


def _api_service(pods: Pods, selector: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": pods.name + API_SERVICE_SUFFIX, "labels": pods.labels},
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [{"name": "http", "port": pods.spec.host_port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def _network_policy(pods: Pods, members: dict[str, str]) -> dict[str, Any]:
    """Ingress to the pods: kubernetes.api_clients on the API port; in a group, the group's own
    pods on every port. Ray's 6379 and vLLM's DP RPC port are fixed, but torch.distributed's store
    (vLLM picks free ports), Ray's workers and NCCL's bootstrap listen on ports chosen at start,
    so peers cannot be limited to a list of ports. The kubelet's probes come from the node, which
    NetworkPolicy does not block."""
    ingress: list[dict[str, Any]] = []
    if pods.group is not None:
        # A P/D role: its group's pods (the peer role, the router) on every port: NIXL's side
        # channel, and UCX's TCP transport on ports it picks at start. Clients go through the router.
        ingress.append({"from": [{"podSelector": {"matchLabels": pods.group.labels}}]})
        return _policy(pods, members, ingress)
    if pods.deployment.layout.spans_nodes:
        ingress.append({"from": [{"podSelector": {"matchLabels": members}}]})
    if pods.k8s.api_clients:
        ingress.append(
            {
                "from": [dict(peer) for peer in pods.k8s.api_clients],
                "ports": [{"protocol": "TCP", "port": pods.spec.container_port}],
            }
        )
    return _policy(pods, members, ingress)


def _policy(pods: Pods, members: dict[str, str], ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": pods.name, "labels": pods.labels},
        "spec": {"podSelector": {"matchLabels": members}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def k8s_comments(deployment: Deployment, group: Group | None = None) -> list[str]:
    """The header's notes: what the manifest needs from the cluster that no field can say."""
    pods = _pods(deployment, group)
    spec, layout = pods.spec, deployment.layout
    notes = [
        f"Secrets: create them first, e.g. kubectl create secret generic {pods.secret_name} "
        "--from-env-file=FILE (NAME=value lines, no quotes)."
        + (
            f" The pods need {API_KEY_ENV}: the Service puts the API on the cluster network and "
            "vLLM's key guards /v1 only (kubernetes.require_api_key=false serves without it)."
            if API_KEY_ENV in pods.required
            else ""
        ),
    ]
    if group is None:  # a P/D role admits its group only (render/pd.py says so once)
        notes.append(network_note(pods, layout))
    if pods.downloads:
        notes.append(
            f"Download: the init container fetches {in_comment(deployment.model.reference, 'model.path')} "
            f"at {'commit' if is_commit(deployment.model.commit or '') else 'revision'} {deployment.model.commit} into the claim within "
            f"{deployment.timeline.download_s} s (runtime.download_mbps)"
            + (
                "; the other pods of the group wait for it rather than download it too"
                if layout.spans_nodes
                else ""
            )
            + f". The engine then serves that snapshot offline (a restart never downloads), and the startup "
            f"probe allows {spec.startup_timeout} s to load and compile (runtime.load_and_compile_s) "
            f"with vLLM's {ENGINE_READY_ENV} raised to {deployment.timeline.engine_ready_s} s."
        )
    notes.append(
        "Clocks (m31ctl/timeline.py): "
        + (
            f"progressDeadlineSeconds {deployment.timeline.progress_deadline_s} covers the image pull, the download "
            "and the load; "
            if not layout.spans_nodes
            else f"each worker waits up to {deployment.timeline.leader_wait_s} s for the leader's address and port "
            f"before starting vLLM, whose own handshake gives up after {VLLM_HANDSHAKE_S} s; "
        )
        + f"terminationGracePeriodSeconds {deployment.timeline.pod_grace_s} is the preStop wait for the endpoints to "
        f"drop the pod ({ENDPOINT_REMOVAL_S} s), vLLM's drain (serving.shutdown_timeout) and the workers' exit."
    )
    notes.append(rollout_note(deployment))
    if spec.ulimits:
        wanted = ", ".join(f"{n}={'unlimited' if soft == -1 else soft}" for n, soft, _ in spec.ulimits)
        unit = " and ".join(
            f"Limit{n.upper()}={'infinity' if soft == -1 else soft}" for n, soft, _ in spec.ulimits
        )
        notes.append(
            f"Limits: Kubernetes sets no ulimits; the nodes' container runtime must give containers "
            f"{wanted} (containerd: {unit} in containerd.service; CRI-O: default_ulimits in crio.conf)."
        )
    notes += _pod_security_notes(pods)
    return [f"# {line}" for note in notes for line in textwrap.wrap(note, width=98, break_on_hyphens=False)]


def network_note(pods: Pods, layout: Layout) -> str:
    """Who the API's NetworkPolicy admits, and what it cannot keep apart."""
    return (
        f"Network: the NetworkPolicy admits kubernetes.api_clients to port {pods.spec.container_port}"
        + (", and the group's pods to each other on every port" if layout.spans_nodes else "")
        + ", where the cluster's network plugin enforces NetworkPolicy. Routes outside /v1 "
        "(/invocations, /tokenize, /pause, /metrics, ...) answer without the key on that port, and "
        f"NetworkPolicy cannot tell paths apart: by default only pods labelled {Label.API_CLIENT}=true "
        "are admitted (kubernetes.api_clients); a client that must reach /v1 alone goes through a "
        "gateway that routes /v1 only."
        + (
            f" Ray's ports ({RAY_PORT}, 10001) have no authentication: the policy's group rule is what "
            "keeps other pods off them."
            if layout.over_ray
            else ""
        )
    )


def _pod_security_notes(pods: Pods) -> list[str]:
    spec = pods.spec
    docker_only = [f"capability {cap}" for cap in spec.cap_add]
    if "seccomp=unconfined" in spec.security_opt:
        docker_only.append("seccomp profile Unconfined (runtime.seccomp_unconfined)")
    privileged = pods.k8s.pod_security == "privileged"
    outside = list(docker_only) if privileged else []
    if any(m.target != HF_CACHE_IN_CONTAINER for m in spec.mounts):
        outside.append("a hostPath volume (the local model.path)")
    if spec.ipc_host:
        outside.append("hostIPC (runtime.ipc_host)")
    notes = []
    if docker_only and not privileged:
        notes.append(
            f'Pod Security: left out, as Pod Security "baseline" rejects them: {", ".join(docker_only)}, '
            "which the Docker targets add; a kubelet without --seccomp-default runs containers unconfined "
            "anyway. kubernetes.pod_security=privileged adds them."
        )
    if outside:
        notes.append(
            f'Pod Security: the pods have {", ".join(outside)}, which Pod Security "baseline" rejects: '
            "the namespace must allow privileged pods."
        )
    return notes
