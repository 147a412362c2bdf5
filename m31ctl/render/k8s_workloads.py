"""The engine's workload: a Deployment on one node, or a LeaderWorkerSet (kubernetes-sigs/lws), one
pod a node, whose pods start vLLM from a shell script (templates/lws-pod.sh.j2)."""

from __future__ import annotations

import shlex
from typing import Any

from m31ctl.engine.adapter import DP_RPC_PORT, NodeRole, build_invocation
from m31ctl.render.common import render_template
from m31ctl.render.k8s_containers import engine_container, pod_spec
from m31ctl.render.k8s_copies import replicas, rollout_of
from m31ctl.render.k8s_pods import RAY_PORT, Pods
from m31ctl.timeline import VLLM_HANDSHAKE_S

# The leader's IP address, which the pod script resolves from LWS_LEADER_ADDRESS (a DNS name
# the LWS injects) before vLLM starts: ZMQ binds an address, not a name (KServe's LWS pods
# resolve it the same way, with getent). As a shell word.
LEADER_IP = '"${leader_ip}"'
LWS_WORKER_INDEX = "LWS_WORKER_INDEX"


def deployment_workload(pods: Pods) -> dict[str, Any]:
    """One node's engine as a Deployment."""
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
            "template": {**template, "spec": pod_spec(pods, engine_container(pods))},
        },
    }


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


def leader_worker_set(pods: Pods) -> dict[str, Any]:
    """A layout wider than one node, as a LeaderWorkerSet, one node a pod.

    Data parallelism across nodes: every pod runs `vllm serve` with its local DP ranks; the
    leader serves the API, the workers run --headless from their first rank (vLLM's data-parallel
    deployment). TP within a node and PP across nodes: the leader starts the Ray head, waits for
    the group and runs `vllm serve` with the Ray executor; workers join its Ray cluster."""
    engine = engine_container(pods)
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
                    "spec": pod_spec(pods, leader),
                },
                "workerTemplate": {"metadata": meta, "spec": pod_spec(pods, worker, leader=False)},
            },
        },
    }
