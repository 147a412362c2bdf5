"""A Kubernetes pod's spec: the engine container, the download's init container, their volumes,
environment, resources and security, as the kubelet will read them (its `$(NAME)` expansion
escaped). render/k8s_workloads.py puts the pod spec into a Deployment or a LeaderWorkerSet.
"""

from __future__ import annotations

from typing import Any

from m31ctl.deployment import HF_CACHE_IN_CONTAINER
from m31ctl.engine.adapter import SIDE_CHANNEL_HOST_ENV
from m31ctl.hardware import k8s_product_selector
from m31ctl.redact import HF_TOKEN_ENV
from m31ctl.render.common import engine_secrets
from m31ctl.render.download import download_step, wait_command
from m31ctl.render.k8s_pods import Pods
from m31ctl.render.k8s_probes import probes
from m31ctl.render.kubelet_expansion import literal
from m31ctl.timeline import ENDPOINT_REMOVAL_S
from m31ctl.units import k8s_quantity

# A P/D role advertises its own pod IP to its peer for NIXL's side channel: ZMQ binds an
# address, not a name, and the peer connects to what the role advertises (the downward API).
POD_IP_FIELD = "status.podIP"


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


def engine_container(pods: Pods) -> dict[str, Any]:
    """The vLLM container as one node runs it (the LeaderWorkerSet replaces the command)."""
    spec, k8s = pods.spec, pods.k8s
    spans_nodes = pods.deployment.layout.spans_nodes
    # The vendor's device plugin resource; none on the CPU rehearsal (a pod asking for a GPU
    # would stay Pending on a CPU cluster).
    gpu_resource = pods.deployment.vendor.k8s_resource
    resources: dict[str, Any] = {gpu_resource: pods.deployment.layout.gpus_per_node} if gpu_resource else {}
    resources.update(k8s.network_resources if spans_nodes else {})
    rdma = pods.deployment.rdma  # the RDMA device plugin's resource (fabric.rdma)
    resources.update({rdma.resource: rdma.per_pod} if rdma is not None else {})
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
        **probes(pods),
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
    waits for its marker (render/download.py), as do the pods of a P/D role that mounts the claim
    the other role downloads into: one download on a claim, never two racing."""
    step = download_step(pods.deployment, pods.spec.env)
    if step is None:
        return None
    if not leader or not pods.owns_cache:
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


def pod_spec(pods: Pods, engine: dict[str, Any], leader: bool = True) -> dict[str, Any]:
    """The pod around `engine` (the engine container, or a LeaderWorkerSet's leader or worker)."""
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
