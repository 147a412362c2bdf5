"""A P/D plan's router in Kubernetes: its pod (vllm-router behind its front), Service and policy.

vllm-router 0.1.17 checks no key and serves worker management beside the API, so it listens on
its pod's loopback alone (ROUTER_BEHIND_FRONT_PORT), and the front (engine/router_front.py, a
second container of the pod, which shares its network namespace) takes the router's public port:
`/health` without a key for the probes, /v1/ with the roles' key, 404 for the rest
(docs/decisions.md, "The router's front"). The Service, the probes and the NetworkPolicy's API
port are the front's; the router's exporter keeps its own port for the scraper.
"""

from __future__ import annotations

from typing import Any

from m31ctl.deployment import CONTAINER_PORT, RENDERED_ROUTER_METRICS_PORT, Deployment, Disaggregated
from m31ctl.engine.router import RouterInvocation, Upstreams, front_invocation
from m31ctl.pair import ROUTER_API_KEY_ENV, ROUTER_LISTEN, group_labels, rendered_router_invocation
from m31ctl.redact import API_KEY_ENV
from m31ctl.render.k8s import (
    API_SERVICE_SUFFIX,
    PART_OF_LABEL,
    ROUTER_API_PORT,
    ROUTER_METRICS_PORT,
    SECRET_SUFFIX,
    k8s_secrets,
    kubelet_literal,
)

# The router pod's share of a node: a Rust proxy, no GPU; its front, a Python proxy of bytes.
ROUTER_CPU = "1"
ROUTER_MEMORY = "1Gi"
FRONT_CPU = "1"
FRONT_MEMORY = "512Mi"
# The router pod's containers: the front first (the Service's target), vllm-router beside it.
FRONT_CONTAINER = "front"
ROUTER_CONTAINER = "router"

# The router pod's init container: both roles answer /health (their download and load can take
# an hour), so the router, which gives up on workers after its own startup timeout, starts last.
WAIT_FOR_ROLES_SCRIPT = """\
import signal, sys, time, urllib.request
budget, urls = int(sys.argv[1]), sys.argv[2:]
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
deadline = time.monotonic() + budget
for url in urls:
    while True:
        try:
            urllib.request.urlopen(url, timeout=5)
            break
        except OSError:
            if time.monotonic() >= deadline:
                print(f"m31ctl: {url} did not answer within {budget} s", file=sys.stderr, flush=True)
                sys.exit(124)
            time.sleep(5)
print("m31ctl: both roles answer /health", flush=True)
"""


def role_service(role: Deployment) -> str:
    """The role's Service (the k8s target's API Service of that engine)."""
    return role.name + API_SERVICE_SUFFIX


def router_labels(deployment: Deployment, group: Disaggregated) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": group.router.name,
        "app.kubernetes.io/managed-by": "m31ctl",
        PART_OF_LABEL: deployment.name,
    }


def k8s_router_invocation(group: Disaggregated) -> RouterInvocation:
    upstreams = Upstreams(*(f"http://{role_service(role)}:{role.network.port}" for role in group.roles))
    return rendered_router_invocation(group, upstreams, fronted=True)


def k8s_front_invocation(group: Disaggregated) -> RouterInvocation:
    """The front on the pod's port, with the key where the roles require one."""
    keyed = API_KEY_ENV in k8s_secrets(group.prefill)[1]
    return front_invocation(
        group.router.image,
        host=ROUTER_LISTEN,
        port=CONTAINER_PORT,
        request_timeout_s=group.router_timeline.request_timeout_s,
        key_env=API_KEY_ENV if keyed else None,
    )


def _key_env(deployment: Deployment, group: Disaggregated, variable: str) -> list[dict[str, Any]]:
    """`variable` set from the group's Secret's API key, where the roles require one."""
    if API_KEY_ENV not in k8s_secrets(group.prefill)[1]:
        return []
    ref = {"name": deployment.name + SECRET_SUFFIX, "key": API_KEY_ENV, "optional": False}
    return [{"name": variable, "valueFrom": {"secretKeyRef": ref}}]


def _containers(deployment: Deployment, group: Disaggregated) -> list[dict[str, Any]]:
    """The front (the pod's API port, its probes on the unauthenticated /health, which it
    forwards to the router: ready only when both answer; alive while it accepts connections),
    then vllm-router on loopback, alive while its exporter answers (the only port of it the
    kubelet, which probes the pod's address, can reach)."""
    router, front = k8s_router_invocation(group), k8s_front_invocation(group)
    front_resources = {"cpu": FRONT_CPU, "memory": FRONT_MEMORY}
    router_resources = {"cpu": ROUTER_CPU, "memory": ROUTER_MEMORY}
    api_port = {"name": ROUTER_API_PORT, "containerPort": CONTAINER_PORT, "protocol": "TCP"}
    metrics_port = {
        "name": ROUTER_METRICS_PORT,
        "containerPort": RENDERED_ROUTER_METRICS_PORT,
        "protocol": "TCP",
    }
    return [
        {
            "name": FRONT_CONTAINER,
            "image": front.image,
            "command": list(front.argv),
            "env": _key_env(deployment, group, API_KEY_ENV),
            "ports": [api_port],
            "resources": {"limits": dict(front_resources), "requests": dict(front_resources)},
            "readinessProbe": {
                "httpGet": {"path": "/health", "port": ROUTER_API_PORT},
                "periodSeconds": 10,
                "timeoutSeconds": 5,
            },
            "livenessProbe": {
                "tcpSocket": {"port": ROUTER_API_PORT},
                "periodSeconds": 30,
                "failureThreshold": 3,
            },
        },
        {
            "name": ROUTER_CONTAINER,
            "image": router.image,
            "command": list(router.argv),
            "env": _key_env(deployment, group, ROUTER_API_KEY_ENV),
            "ports": [metrics_port],
            "resources": {"limits": dict(router_resources), "requests": dict(router_resources)},
            "livenessProbe": {
                "httpGet": {"path": "/metrics", "port": ROUTER_METRICS_PORT},
                "periodSeconds": 30,
                "timeoutSeconds": 5,
                "failureThreshold": 3,
            },
        },
    ]


def _router_pod(deployment: Deployment, group: Disaggregated) -> dict[str, Any]:
    """The router's pod: an init container waiting for both roles' /health, then the front and
    vllm-router, which drain side by side within the pod's grace."""
    wait = {
        "name": "wait-for-roles",
        "image": group.router.image,
        "command": [
            "python3",
            "-c",
            WAIT_FOR_ROLES_SCRIPT,
            str(group.router_timeline.roles_wait_s),
            *(f"http://{role_service(role)}:{role.network.port}/health" for role in group.roles),
        ],
        "env": [],
    }
    return {
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": group.router_timeline.stop_s,
        "initContainers": [kubelet_literal(wait)],
        "containers": [kubelet_literal(c) for c in _containers(deployment, group)],
    }


def k8s_router(deployment: Deployment, group: Disaggregated) -> list[dict[str, Any]]:
    router = group.router
    labels = router_labels(deployment, group)
    annotations = dict(group_labels(deployment))
    selector = {"app.kubernetes.io/name": router.name}
    workload = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": router.name, "labels": labels, "annotations": annotations},
        "spec": {
            "replicas": 1,
            # The init container waits for the roles' download and load.
            "progressDeadlineSeconds": group.router_timeline.progress_deadline_s,
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": labels, "annotations": annotations},
                "spec": _router_pod(deployment, group),
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        # The aggregated server's API Service name: clients address a P/D plan as they would it.
        "metadata": {"name": deployment.name + API_SERVICE_SUFFIX, "labels": labels},
        "spec": {
            "type": "ClusterIP",
            "selector": selector,
            "ports": [
                {
                    "name": "http",
                    "port": router.network.port,
                    "targetPort": ROUTER_API_PORT,
                    "protocol": "TCP",
                }
            ],
        },
    }
    return [workload, service, _router_policy(deployment, router.name, labels)]


def _router_policy(deployment: Deployment, name: str, labels: dict[str, str]) -> dict[str, Any]:
    """Only the plan's API clients reach the router's pod (the aggregated server's NetworkPolicy
    rule), on its API port (the front's) and its metrics port: an engine's /metrics is on its
    API port, so whoever reaches an aggregated server reaches its metrics; the router's exporter
    listens apart (--prometheus-port). The monitoring target's scraper is admitted by
    k8s-monitoring.yaml."""
    k8s = deployment.plan.settings.kubernetes
    ports = [{"protocol": "TCP", "port": port} for port in (CONTAINER_PORT, RENDERED_ROUTER_METRICS_PORT)]
    ingress = [{"from": [dict(p) for p in k8s.api_clients], "ports": ports}] if k8s.api_clients else []
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": name}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
