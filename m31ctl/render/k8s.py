"""The Kubernetes target: the documents, built as data (the YAML is only serialized).

One node: a Deployment. A layout over several nodes: a LeaderWorkerSet (kubernetes-sigs/lws), one
pod a node. Either way a claim for the Hugging Face cache, an API Service and a NetworkPolicy.
What the cluster does with each field is written beside it; docs/decisions.md cites the sources.
The target's parts, each its own module: k8s_pods.py (the names and labels every document
shares), k8s_containers.py (the pod spec), k8s_probes.py, k8s_workloads.py (Deployment, LWS),
k8s_copies.py (rollout, replicas, the cache claim) and k8s_notes.py (the header's notes). Other
modules import the target from here.
"""

from __future__ import annotations

from typing import Any

from m31ctl.deployment import Deployment
from m31ctl.errors import InputError
from m31ctl.render.k8s_containers import kubelet_literal
from m31ctl.render.k8s_copies import claim_shared_by, hf_cache_claim
from m31ctl.render.k8s_notes import k8s_comments
from m31ctl.render.k8s_pods import (
    API_SERVICE_SUFFIX,
    LWS_NAME_LABEL,
    PART_OF_LABEL,
    ROUTER_API_PORT,
    ROUTER_METRICS_PORT,
    SECRET_SUFFIX,
    Group,
    Pods,
    k8s_secrets,
    pods_of,
)
from m31ctl.render.k8s_workloads import deployment_workload, leader_worker_set

__all__ = [
    "API_SERVICE_SUFFIX",
    "PART_OF_LABEL",
    "ROUTER_API_PORT",
    "ROUTER_METRICS_PORT",
    "SECRET_SUFFIX",
    "Group",
    "k8s_comments",
    "k8s_documents",
    "k8s_secrets",
    "kubelet_literal",
]

_MAX_LABEL = 63


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


def k8s_documents(deployment: Deployment, group: Group | None = None) -> list[dict[str, Any]]:
    """The claim, the workload, the API Service and the NetworkPolicy of one engine: the
    aggregated server, or a P/D role of `group` (render/pd.py adds the router)."""
    _check(deployment)
    pods = pods_of(deployment, group)
    if deployment.layout.spans_nodes:
        workload = leader_worker_set(pods)
        members = {LWS_NAME_LABEL: pods.name}
        api_selector = {**members, "role": "leader"}
    else:
        workload = deployment_workload(pods)
        members = {"app.kubernetes.io/name": pods.name}
        api_selector = members
    # A P/D role that mounts its group's claim: the group's documents carry it (render/pd.py).
    shared = pods.group is not None and pods.group.claim_name is not None
    claims = [] if shared else [hf_cache_claim(pods.deployment, pods.claim_name, pods.labels)]
    return [*claims, workload, _api_service(pods, api_selector), _network_policy(pods, members)]


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
