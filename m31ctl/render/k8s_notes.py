"""The Kubernetes manifest's header notes: what it needs from the cluster that no field can say
(the Secret, who the network admits, the download, the clocks, the rollout, limits, Pod Security)."""

from __future__ import annotations

import textwrap

from m31ctl.deployment import HF_CACHE_IN_CONTAINER, Deployment, Layout
from m31ctl.labels import Label
from m31ctl.redact import API_KEY_ENV
from m31ctl.render.common import in_comment
from m31ctl.render.k8s_copies import rollout_note
from m31ctl.render.k8s_pods import RAY_PORT, Group, Pods, pods_of
from m31ctl.render.k8s_probes import readiness_note
from m31ctl.revision import is_commit
from m31ctl.timeline import ENDPOINT_REMOVAL_S, ENGINE_READY_ENV, VLLM_HANDSHAKE_S


def k8s_comments(deployment: Deployment, group: Group | None = None) -> list[str]:
    """The header's notes: what the manifest needs from the cluster that no field can say."""
    pods = pods_of(deployment, group)
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
    if pods.downloads and not pods.owns_cache:
        notes.append(
            f"Download: none; the init container waits up to {deployment.timeline.checkpoint_wait_s} s for "
            f"{pods.group and pods.group.cache_owner}'s download into the claim both roles mount "
            f"({pods.claim_name}). The engine then serves that snapshot offline, and the startup probe allows "
            f"{spec.startup_timeout} s to load and compile (runtime.load_and_compile_s)."
        )
    elif pods.downloads:
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
    notes.append(readiness_note(pods))
    if spec.ulimits:
        wanted = ", ".join(f"{n}={'unlimited' if soft == -1 else soft}" for n, soft, _ in spec.ulimits)
        unit = " and ".join(
            f"Limit{n.upper()}={'infinity' if soft == -1 else soft}" for n, soft, _ in spec.ulimits
        )
        notes.append(
            f"Limits: Kubernetes sets no ulimits; the nodes' container runtime must give containers "
            f"{wanted} (containerd: {unit} in containerd.service; CRI-O: default_ulimits in crio.conf)."
        )
    if deployment.rdma is not None:
        notes.append(rdma_note(deployment))
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


def rdma_note(deployment: Deployment) -> str:
    """What the pods ask of the cluster for RDMA (fabric.rdma: Deployment.rdma)."""
    rdma = deployment.rdma
    assert rdma is not None
    env = dict(rdma.env)
    kv = deployment.kv_transfer
    uses = [f"{name}={value}" for name, value in env.items()]
    if kv is not None and kv.ucx_transports:
        uses.append(f"UCX_TLS={kv.ucx_transports}")
        if kv.ucx_net_devices:
            uses.append(f"UCX_NET_DEVICES={kv.ucx_net_devices}")
    hcas = ", ".join(rdma.devices) if rdma.devices else "every HCA the pod is given"
    return (
        f"RDMA (fabric.rdma): each pod asks {rdma.per_pod} {rdma.resource} of the cluster's RDMA device "
        f"plugin (it hands the pod /dev/infiniband) and adds capability {', '.join(rdma.capabilities)} "
        f"to pin the memory it registers; HCA ports: {hcas}"
        + (f"; {', '.join(uses)}" if uses else "")
        + ". Nodes without the resource never schedule the pods."
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
