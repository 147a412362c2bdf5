"""The Kubernetes workload's copies: how a changed plan replaces them (kubernetes.rollout), their
count where an autoscaler keeps it (kubernetes.autoscaling), and the Hugging Face cache claim they
mount, shared across nodes where pods run on several. render/k8s.py reads these; a new rollout
kind is a row of `ROLLOUTS`."""

from __future__ import annotations

from typing import Any, NamedTuple

from m31ctl.deployment import Deployment
from m31ctl.render.autoscaling import autoscaled
from m31ctl.units import k8s_quantity

HF_CACHE_SIZE_KEY = "kubernetes.hf_cache_size"
UNDOWNLOADED_CACHE = "1Gi"  # the cache claim of a local checkpoint (claim_size)


class Rollout(NamedTuple):
    """What kubernetes.rollout renders for each workload kind."""

    deployment: dict[str, Any]  # a Deployment's spec.strategy
    leader_worker_set: dict[str, Any]  # a LeaderWorkerSet's spec.rolloutStrategy
    note: str


# recreate: the old copy stops before the new one starts, as a Deployment's Recreate does; an LWS
# rolls with maxUnavailable 1 and maxSurge 0 (its defaults, stated: with one replica that is the
# same stop-then-start). surge: one more copy starts, and the old one stops only once it is ready
# (maxUnavailable 0), the zero-downtime pattern of KServe's "Availability" rollout mode and the
# LWS rollout guide (kubernetes-sigs/lws site/content/en/docs/concepts/rollout-strategy).
ROLLOUTS: dict[str, Rollout] = {
    "recreate": Rollout(
        {"type": "Recreate"},
        {"type": "RollingUpdate", "rollingUpdateConfiguration": {"maxUnavailable": 1, "maxSurge": 0}},
        "a changed plan stops the serving copy before its successor starts: about {start_s} s without "
        "service (the timeline's start); kubernetes.rollout=surge starts the new copy first on {gpus} "
        "spare GPUs and stops the old one once the new one is ready.",
    ),
    "surge": Rollout(
        {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        {"type": "RollingUpdate", "rollingUpdateConfiguration": {"maxUnavailable": 0, "maxSurge": 1}},
        "a changed plan starts one more copy ({gpus} GPUs must be free for it) and stops the old one only "
        "once the new one passes its probes, up to {start_s} s later; no request goes unserved.",
    ),
}


def replicas(deployment: Deployment) -> dict[str, int]:
    """One copy, unless KEDA scales them (render --target monitoring writes its ScaledObject):
    then the field is left out, so that applying this file again does not reset the count."""
    return {} if autoscaled(deployment) else {"replicas": 1}


def rollout_of(deployment: Deployment) -> Rollout:
    return ROLLOUTS[deployment.plan.settings.kubernetes.rollout]


def rollout_note(deployment: Deployment) -> str:
    """The header's line: which rollout, and what it costs."""
    rollout = deployment.plan.settings.kubernetes.rollout
    cost = ROLLOUTS[rollout].note.format(start_s=deployment.timeline.start_s, gpus=deployment.serving_gpus)
    return f"Rollout (kubernetes.rollout={rollout}): {cost}"


def claim_shared_by(deployment: Deployment) -> str | None:
    """Why pods on several nodes mount the cache claim at once, or None: a group spanning
    nodes, or copies KEDA may add (a ReadWriteOnce claim holds a second copy's pod Pending on
    another node: Multi-Attach)."""
    if deployment.layout.spans_nodes:
        return f"the plan spans {deployment.layout.nodes} nodes"
    if autoscaled(deployment):
        most = deployment.plan.settings.kubernetes.autoscaling.max_replicas
        return f"kubernetes.autoscaling.max_replicas={most} puts copies on several nodes"
    return None


def roles_share_claim(deployment: Deployment) -> bool:
    """Whether a P/D group's roles mount one cache claim, downloaded into once (by the prefill
    role; the decode's pods wait for its marker, render/download.py): where the plan names
    kubernetes.hf_cache_storage_class, the class a claim shared across nodes must have
    (ReadWriteMany, as the aggregated copies' and a group over nodes'). Without it the claims take
    the cluster's default class, which may be ReadWriteOnce only, and the roles may land on
    different nodes (their podAffinity is preferred, not required): a claim each. The roles read
    one checkpoint at one commit with one draft (plan/disaggregation.py role_settings changes
    neither), so one download serves both."""
    group = deployment.disaggregated
    if group is None or not deployment.plan.settings.kubernetes.hf_cache_storage_class:
        return False
    prefill, decode = group.roles
    assert (prefill.model, prefill.draft.skipped) == (decode.model, decode.draft.skipped)
    return True


def claim_size(deployment: Deployment) -> str:
    """What the cache claim asks for: kubernetes.hf_cache_size where the checkpoint is downloaded
    into it (or the plan sizes it); a local checkpoint is a hostPath and downloads nothing, so the
    claim holds the hub's small files at most (the CPU rehearsal's 600 GiB default would leave it
    Pending on a small cluster)."""
    source = deployment.plan.provenance.get(HF_CACHE_SIZE_KEY)
    if not deployment.model.local or (source is not None and source.layer != "defaults"):
        return k8s_quantity(deployment.plan.settings.kubernetes.hf_cache_size)
    return UNDOWNLOADED_CACHE


def hf_cache_claim(
    deployment: Deployment, name: str, labels: dict[str, str], shared: bool = False
) -> dict[str, Any]:
    """The claim the checkpoint is downloaded into. Pods on several nodes (a group's, copies an
    autoscaler adds, or with `shared` both roles of a P/D group) share it, so it must then be
    ReadWriteMany (a file system every node mounts)."""
    k8s = deployment.plan.settings.kubernetes
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteMany" if shared or claim_shared_by(deployment) else "ReadWriteOnce"],
        "resources": {"requests": {"storage": claim_size(deployment)}},
    }
    if k8s.hf_cache_storage_class:
        spec["storageClassName"] = k8s.hf_cache_storage_class
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": name, "labels": labels},
        "spec": spec,
    }
