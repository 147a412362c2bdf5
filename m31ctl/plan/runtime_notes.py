"""Plan warnings about the runtime the plan will meet: what its settings cannot make safe alone."""

from __future__ import annotations

from m31ctl.hardware import Hardware, vendor_facts
from m31ctl.plan.rdma import RDMA_CAPABILITIES
from m31ctl.plan.settings import PlanSettings

# An image reference pinned to its content (a registry digest) rather than a movable tag.
_DIGEST = "@sha256:"


def runtime_warnings(settings: PlanSettings, hw: Hardware) -> tuple[str, ...]:
    notes = []
    image = settings.engine.image
    if _DIGEST not in image:
        notes.append(
            f"engine.image {image} is a tag, which its registry can move to another image: `m31ctl lock` "
            "records its digest, and --locked FILE launches and renders by it (or set engine.image to "
            "NAME@sha256:DIGEST)"
        )
    bind = settings.runtime.bind
    if settings.runtime.exposed:
        # vLLM 0.32 entrypoints/serve/middleware/authenticate.py: GUARDED_PREFIX.
        notes.append(
            f"runtime.bind={bind} exposes the API, and vLLM's key guards only /v1, /v2, /inference and "
            "/cohere: /invocations (the same inference), /pause, /tokenize, /metrics and more answer "
            "without it (vLLM's security guide); keep the port on a trusted network or behind a proxy "
            "that passes /v1 only"
        )
    k8s = settings.kubernetes
    added = [f"capability {cap}" for cap in vendor_facts(hw.vendor).cap_add]
    if settings.fabric.rdma is not None:
        added += [f"capability {cap} (fabric.rdma)" for cap in RDMA_CAPABILITIES]
    if settings.runtime.seccomp_unconfined:
        added.append("seccomp profile Unconfined")
    if k8s.pod_security == "privileged" and added:
        notes.append(
            f"kubernetes.pod_security=privileged: the Kubernetes pods add {' and '.join(added)}, which "
            'Pod Security "baseline" rejects: their namespace must allow privileged pods'
        )
    return tuple(notes)
