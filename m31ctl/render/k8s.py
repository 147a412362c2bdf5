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

from m31ctl.container import ContainerSpec
from m31ctl.deployment import HF_CACHE_IN_CONTAINER, Deployment
from m31ctl.engine.adapter import NodeRole, build_invocation
from m31ctl.errors import InputError
from m31ctl.hardware import k8s_product_selector
from m31ctl.plan.settings import KubernetesSettings
from m31ctl.redact import API_KEY_ENV, HF_TOKEN_ENV
from m31ctl.render.common import health_command, in_comment, render_spec, render_template
from m31ctl.render.download import download_command
from m31ctl.render.kube import literal
from m31ctl.units import k8s_quantity

K8S_SECRET = "minimax-m31-flash-secrets"
K8S_HF_CACHE_CLAIM = "minimax-m31-flash-hf-cache"
PROBE_PERIOD_S = 10
# The API Service's name: LeaderWorkerSet creates the group's headless Service under the LWS's
# own name, and only when no Service has that name; the pods' DNS names (LWS_LEADER_ADDRESS,
# <lws>-0.<lws>.<namespace>) come from it. vLLM's LWS example calls its API Service vllm-leader.
API_SERVICE_SUFFIX = "-api"
# LeaderWorkerSet labels every pod of a group with the set's name (its API reference).
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
RAY_PORT = 6379
# How long Ray nodes wait for each other, as vLLM's examples/online_serving/multi-node-serving.sh.
RAY_JOIN_S = 300
_MAX_LABEL = 63


class Pods(NamedTuple):
    """What every document of one render reads."""

    deployment: Deployment
    spec: ContainerSpec
    name: str
    labels: dict[str, str]
    annotations: dict[str, str]
    secrets: tuple[str, ...]  # read from the Secret, by name
    required: tuple[str, ...]  # the pod does not start without these

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
    if deployment.layout.spans_nodes and not k8s.hf_cache_storage_class:
        raise InputError(
            f"the plan spans {deployment.layout.nodes} nodes, which share the Hugging Face cache claim "
            "(ReadWriteMany): with no storage class it takes the cluster's default, and a default "
            "that is ReadWriteOnce-only leaves it Pending",
            hint="name a class that provisions ReadWriteMany volumes (NFS, CephFS, a cloud file "
            "store): --set kubernetes.hf_cache_storage_class=NAME",
        )


def _pods(deployment: Deployment) -> Pods:
    spec = render_spec(deployment, in_pod=True)
    name = spec.name  # a DNS-1123 label already (m31ctl/names.py)
    secrets, required = k8s_secrets(deployment)
    return Pods(
        deployment=deployment,
        spec=spec,
        name=name,
        labels={"app.kubernetes.io/name": name, "app.kubernetes.io/managed-by": "m31ctl"},
        annotations=dict(spec.labels),
        secrets=secrets,
        required=required,
    )


def k8s_documents(deployment: Deployment) -> list[dict[str, Any]]:
    _check(deployment)
    pods = _pods(deployment)
    if deployment.layout.spans_nodes:
        workload = _leader_worker_set(pods)
        members = {LWS_NAME_LABEL: pods.name}
        api_selector = {**members, "role": "leader"}
    else:
        workload = _deployment(pods)
        members = {"app.kubernetes.io/name": pods.name}
        api_selector = members
    return [_hf_cache_claim(pods), workload, _api_service(pods, api_selector), _network_policy(pods, members)]


def _hf_cache_claim(pods: Pods) -> dict[str, Any]:
    """The claim the checkpoint is downloaded into. Pods of one group on several nodes share it,
    so it must then be ReadWriteMany (a file system every node mounts)."""
    k8s = pods.k8s
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany" if pods.deployment.layout.spans_nodes else "ReadWriteOnce"],
        "resources": {"requests": {"storage": k8s_quantity(k8s.hf_cache_size)}},
    }
    if k8s.hf_cache_storage_class:
        spec["storageClassName"] = k8s.hf_cache_storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": K8S_HF_CACHE_CLAIM, "labels": pods.labels},
        "spec": spec,
    }


def _volumes(pods: Pods) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes and the engine container's mounts of them."""
    spec = pods.spec
    volumes: list[dict[str, Any]] = [
        {"name": "hf-cache", "persistentVolumeClaim": {"claimName": K8S_HF_CACHE_CLAIM}},
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
        ref = {"name": K8S_SECRET, "key": secret, "optional": optional}
        env.append({"name": secret, "valueFrom": {"secretKeyRef": ref}})
    return env


def _startup_s(pods: Pods) -> int:
    """What the startup probe allows: loading and compiling when the init container downloaded
    the checkpoint (budgets.load_and_compile_s), otherwise the whole startup budget; plus the
    Ray nodes' join on a leader over Ray."""
    budgets = pods.deployment.budgets
    seconds = budgets.load_and_compile_s if pods.downloads else budgets.startup_s
    return seconds + (RAY_JOIN_S if pods.deployment.layout.over_ray else 0)


def _probes(pods: Pods) -> dict[str, Any]:
    spec = pods.spec
    return {
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": max(1, math.ceil(_startup_s(pods) / PROBE_PERIOD_S)),
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


def _engine_container(pods: Pods) -> dict[str, Any]:
    """The vLLM container as one node runs it (the LeaderWorkerSet replaces the command)."""
    spec, k8s = pods.spec, pods.k8s
    spans_nodes = pods.deployment.layout.spans_nodes
    gpu_resource = pods.deployment.vendor.k8s_resource or "nvidia.com/gpu"
    resources = {gpu_resource: pods.deployment.layout.gpus_per_node}
    resources.update(k8s.network_resources if spans_nodes else {})
    env = {**dict(spec.env), **(dict(sorted(k8s.network_env.items())) if spans_nodes else {})}
    _, mounts = _volumes(pods)
    container: dict[str, Any] = {
        "name": "vllm",
        "image": spec.image,
        "args": list(spec.args),
        "env": _env(pods, env, pods.secrets),
        "ports": [{"name": "http", "containerPort": spec.container_port, "protocol": "TCP"}],
        "resources": {
            "limits": dict(resources),
            "requests": {**resources, "cpu": k8s.cpu, "memory": k8s_quantity(k8s.memory)},
        },
        "volumeMounts": mounts,
        **_probes(pods),
    }
    security = _security_context(pods)
    if security:
        container["securityContext"] = security
    return container


def _download_container(pods: Pods) -> dict[str, Any] | None:
    """The checkpoint download as an init container, with its own budget (budgets.download_s)."""
    command = download_command(pods.deployment)
    if not pods.downloads or command is None:
        return None
    visibility = pods.deployment.vendor.visibility_vars
    return {
        "name": "download",
        "image": pods.spec.image,
        "command": command,
        # The engine's environment (HF_ENDPOINT, proxies) but GPU visibility: it uses no GPU.
        "env": _env(pods, {k: v for k, v in pods.spec.env if k not in visibility}, (HF_TOKEN_ENV,)),
        "volumeMounts": [{"name": "hf-cache", "mountPath": HF_CACHE_IN_CONTAINER}],
    }


def _kubelet_literal(container: dict[str, Any]) -> dict[str, Any]:
    """The kubelet expands $(NAME) in command, args and env values (m31ctl/render/kube.py): every
    `$` of those is doubled, so each reaches the process as the plan wrote it."""
    escaped = dict(container)
    for key in ("command", "args"):
        if key in escaped:
            escaped[key] = [literal(word) for word in escaped[key]]
    escaped["env"] = [
        {**entry, "value": literal(entry["value"])} if "value" in entry else entry for entry in escaped["env"]
    ]
    return escaped


def _pod_spec(pods: Pods, engine: dict[str, Any]) -> dict[str, Any]:
    spec, k8s, plan = pods.spec, pods.k8s, pods.deployment.plan
    volumes, _mounts = _volumes(pods)
    pod: dict[str, Any] = {
        # Service links would put <SERVICE>_PORT=tcp://... of every Service of the namespace into
        # the environment: a Service named vllm gives VLLM_PORT, which vLLM refuses (vllm/envs.py).
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": spec.stop_timeout,
    }
    selector = {**k8s_product_selector(plan.hardware), **k8s.node_selector}
    if selector:
        pod["nodeSelector"] = selector
    if k8s.tolerations:
        pod["tolerations"] = [dict(t) for t in k8s.tolerations]
    if spec.ipc_host:
        pod["hostIPC"] = True
    download = _download_container(pods)
    if download is not None:
        pod["initContainers"] = [_kubelet_literal(download)]
    pod["containers"] = [_kubelet_literal(engine)]
    pod["volumes"] = volumes
    return pod


def _deployment(pods: Pods) -> dict[str, Any]:
    template = {"metadata": {"labels": pods.labels, "annotations": pods.annotations}}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": pods.name, "labels": pods.labels, "annotations": pods.annotations},
        "spec": {
            "replicas": 1,
            # One pod holds all the GPUs: never run two during a rollout.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": {"app.kubernetes.io/name": pods.name}},
            "template": {**template, "spec": _pod_spec(pods, _engine_container(pods))},
        },
    }


# The LWS variables (injected into every container of a group's pods), as shell words.
LWS_LEADER = '"${LWS_LEADER_ADDRESS}"'
LWS_WORKER_INDEX = "LWS_WORKER_INDEX"


def _serve_line(pods: Pods, role: NodeRole) -> str:
    """`vllm serve ...` for one pod: every word quoted except the LWS expansions the role
    carries, which the pod's shell expands."""
    words = ["vllm", "serve", *build_invocation(pods.deployment, node=role).args]
    live = {role.leader_address, role.start_rank}
    return " ".join(w if w in live else shlex.quote(w) for w in words)


def pod_script(pods: Pods, leader: bool) -> str:
    """One pod's `/bin/sh -c` script (templates/lws-pod.sh.j2)."""
    layout = pods.deployment.layout
    start_rank = f'"$(({LWS_WORKER_INDEX} * {layout.data_local}))"'
    role = NodeRole(leader, LWS_LEADER, "0" if leader else start_rank)
    return render_template(
        "lws-pod.sh.j2",
        leader=leader,
        over_ray=layout.over_ray,
        serve=_serve_line(pods, role),
        nodes=layout.nodes,
        ray_port=RAY_PORT,
        join_s=RAY_JOIN_S,
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
            "replicas": 1,
            "leaderWorkerTemplate": {
                "size": pods.deployment.layout.nodes,
                # One lost pod breaks the group's collectives: restart the whole group.
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {
                    "metadata": {
                        "labels": {**pods.labels, "role": "leader"},
                        "annotations": pods.annotations,
                    },
                    "spec": _pod_spec(pods, leader),
                },
                "workerTemplate": {"metadata": meta, "spec": _pod_spec(pods, worker)},
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
    if pods.deployment.layout.spans_nodes:
        ingress.append({"from": [{"podSelector": {"matchLabels": members}}]})
    if pods.k8s.api_clients:
        ingress.append(
            {
                "from": [dict(peer) for peer in pods.k8s.api_clients],
                "ports": [{"protocol": "TCP", "port": pods.spec.container_port}],
            }
        )
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": pods.name, "labels": pods.labels},
        "spec": {"podSelector": {"matchLabels": members}, "policyTypes": ["Ingress"], "ingress": ingress},
    }


def k8s_comments(deployment: Deployment) -> list[str]:
    """The header's notes: what the manifest needs from the cluster that no field can say."""
    pods = _pods(deployment)
    spec, layout = pods.spec, deployment.layout
    notes = [
        f"Secrets: create them first, e.g. kubectl create secret generic {K8S_SECRET} "
        "--from-env-file=FILE (NAME=value lines, no quotes)."
        + (
            f" The pods need {API_KEY_ENV}: the Service puts the API on the cluster network and "
            "vLLM's key guards /v1 only (kubernetes.require_api_key=false serves without it)."
            if API_KEY_ENV in pods.required
            else ""
        ),
        f"Network: the NetworkPolicy admits kubernetes.api_clients to port {spec.container_port}"
        + (", and the group's pods to each other on every port" if layout.spans_nodes else "")
        + ", where the cluster's network plugin enforces NetworkPolicy. Routes outside /v1 "
        "(/invocations, /pause, /metrics, ...) answer without the key: keep kubernetes.api_clients "
        "to the clients you mean.",
    ]
    if pods.downloads:
        notes.append(
            f"Download: the init container fetches {in_comment(deployment.model.reference, 'model.path')} "
            "into the claim within "
            f"{deployment.budgets.download_s} s (runtime.download_mbps); the startup probe then allows "
            f"{_startup_s(pods)} s to load and compile (runtime.load_and_compile_s)."
        )
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
