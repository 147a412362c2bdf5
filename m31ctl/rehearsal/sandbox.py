"""A pod's sandbox in the rehearsal: Kubernetes' pause container, which holds the pod's network
namespace (address, hostname, DNS names) for every container of the pod. The kubelet
(kubelet.py) runs a pod in one when its container is killed and started again in place, or when
the pod has more than one container (a P/D router pod: the front on the pod's port, the router
on the pod's loopback), as a kubelet runs every container of a pod in one sandbox."""

from __future__ import annotations

from typing import Any

from m31ctl.labels import Label
from m31ctl.rehearsal.pods import PodRun


def container_name(session: str, pod: PodRun) -> str:
    suffix = f"-init-{pod.container}" if pod.init else ""
    return f"m31ctl-rh-{session}-{pod.pod}{suffix}"[:120]


def sidecar_name(session: str, pod: PodRun, sidecar: PodRun) -> str:
    """The container of `sidecar`, one of `pod`'s other containers (PodRun.sidecars)."""
    return f"{container_name(session, pod)[:100]}-{sidecar.container}"[:120]


def sandbox_name(session: str, pod: PodRun) -> str:
    return f"{container_name(session, pod)[:112]}-sandbox"


def sandbox_args(pod: PodRun, session: str, network: str, address: str = "") -> dict[str, Any]:
    """The pod's sandbox (Kubernetes' pause container): it holds the pod's network namespace, so
    the pod's address, hostname and DNS names outlive a kill of its container, as a kubelet's pod
    keeps its IP while its container restarts. It runs nothing but a sleep."""
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
