"""What every Kubernetes document of one render reads: the engine's pods (`Pods`), the P/D group
they may belong to, and the names and labels the documents share. render/k8s.py builds the
documents from these; render/pd.py and render/observability.py select on the same labels.
"""

from __future__ import annotations

from typing import NamedTuple

from m31ctl.container import ContainerSpec, render_spec
from m31ctl.deployment import Deployment
from m31ctl.plan.settings import KubernetesSettings
from m31ctl.redact import API_KEY_ENV

# The Secret and the cache claim are named after the deployment (runtime.container_name): two
# deployments in one namespace must not share a ReadWriteOnce claim (Multi-Attach) or a key.
SECRET_SUFFIX = "-secrets"
HF_CACHE_CLAIM_SUFFIX = "-hf-cache"
# The API Service's name: LeaderWorkerSet creates the group's headless Service under the LWS's
# own name, and only when no Service has that name; the pods' DNS names (LWS_LEADER_ADDRESS,
# <lws>-0.<lws>.<namespace>) come from it. vLLM's LWS example calls its API Service vllm-leader.
API_SERVICE_SUFFIX = "-api"
# LeaderWorkerSet labels every pod of a group with the set's name (its API reference).
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
RAY_PORT = 6379
# What every member of a P/D group carries (the roles' pods and the router's): the roles'
# NetworkPolicies admit each other and the router by it (Kubernetes' recommended labels).
PART_OF_LABEL = "app.kubernetes.io/part-of"
# The P/D router pod's port names (render/pd.py). Not "http", the engines' API port: the
# monitoring target's PodMonitor scrapes vLLM's /metrics on "http" and the router's own
# exporter on "metrics", each pod on the ports it has.
ROUTER_API_PORT = "api"
ROUTER_METRICS_PORT = "metrics"


class Group(NamedTuple):
    """The P/D group a role's workload belongs to: one Secret for all members, and a label
    that admits the members to each other."""

    name: str
    # The role whose pods download the checkpoint into the group's one cache claim, which every
    # role mounts (render/k8s_copies.py roles_share_claim); None: each role has a claim of its own.
    cache_owner: str | None = None

    @property
    def labels(self) -> dict[str, str]:
        return {PART_OF_LABEL: self.name, "app.kubernetes.io/managed-by": "m31ctl"}

    @property
    def claim_name(self) -> str | None:
        """The cache claim every role mounts, or None where each has its own."""
        # Not the aggregated server's claim name: a claim's access modes cannot change once made.
        return f"{self.name}-pd{HF_CACHE_CLAIM_SUFFIX}" if self.cache_owner else None


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
        shared = self.group.claim_name if self.group is not None else None
        return shared or self.name + HF_CACHE_CLAIM_SUFFIX

    @property
    def owns_cache(self) -> bool:
        """These pods download into their claim (a leader's); False for a P/D role that mounts the
        claim another role downloads into, whose pods wait for that download's marker."""
        return self.group is None or self.group.cache_owner in (None, self.name)

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


def pods_of(deployment: Deployment, group: Group | None = None) -> Pods:
    """The engine's pods as every document names, labels and secures them."""
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
