"""kubernetes.autoscaling (issue 50): KEDA scales copies of one server on vLLM's queue and KV
cache, adding at most one copy per start and never to zero; the copies share a ReadWriteMany
cache claim; k8s.yaml leaves the replica count to KEDA. The behaviour KEDA hands to the HPA is
checked against Kubernetes' own autoscaling/v2 schema."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from m31ctl.deployment import derive
from m31ctl.errors import InputError
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.render import get_target
from m31ctl.timeline import HPA_MAX_POLICY_PERIOD_S, HPA_MAX_STABILIZATION_S
from tests.conftest import PINNED_COMMIT
from tests.support.render import tool

RWX = "kubernetes.hf_cache_storage_class=nfs-rwx"


def _deployment(hardware: str, *sets: str):  # type: ignore[no-untyped-def]
    return derive(resolve(PlanRequest(hardware=simulated(hardware), sets=sets)), commit=PINNED_COMMIT)


def _files(deployment, target: str) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return {a.name: a.content for a in get_target(target)(deployment)}


def _scaled_object(deployment) -> dict:  # type: ignore[no-untyped-def, type-arg]
    (doc,) = [d for d in yaml.safe_load_all(_files(deployment, "monitoring")["k8s-autoscaling.yaml"]) if d]
    return doc


def test_one_copy_renders_no_autoscaler_and_one_replica():
    deployment = _deployment("b300x4")
    assert "k8s-autoscaling.yaml" not in _files(deployment, "monitoring")
    workload = list(yaml.safe_load_all(_files(deployment, "k8s")["k8s.yaml"]))[1]
    assert workload["spec"]["replicas"] == 1


def test_copies_scale_on_vllms_queue_and_kv_cache_one_per_start(tmp_path):
    deployment = _deployment("b300x4", "kubernetes.autoscaling.max_replicas=3", RWX)
    scaler = _scaled_object(deployment)
    spec = scaler["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment.name}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 3)
    queries = {t["metadata"]["query"].split("(")[1].split("{")[0]: t for t in spec["triggers"]}
    assert set(queries) == {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
    assert queries["vllm:num_requests_waiting"]["metricType"] == "AverageValue"  # per copy
    assert (
        f'm31ctl_deployment="{deployment.name}"' in queries["vllm:kv_cache_usage_perc"]["metadata"]["query"]
    )
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    t = deployment.timeline
    assert behavior["scaleUp"]["policies"] == [
        {"type": "Pods", "value": 1, "periodSeconds": min(t.copy_start_s, HPA_MAX_POLICY_PERIOD_S)}
    ]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == min(t.copy_start_s, HPA_MAX_STABILIZATION_S)
    # KEDA passes the behaviour to an autoscaling/v2 HPA verbatim: Kubernetes' schema must take it.
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": deployment.name},
        "spec": {
            "scaleTargetRef": spec["scaleTargetRef"],
            "minReplicas": 1,
            "maxReplicas": 3,
            "behavior": behavior,
        },
    }
    path = tmp_path / "hpa.yaml"
    path.write_text(yaml.safe_dump(hpa))
    checked = subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(path)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    # The workload leaves its count to KEDA, and the copies share a ReadWriteMany claim.
    claim, workload = list(yaml.safe_load_all(_files(deployment, "k8s")["k8s.yaml"]))[:2]
    assert "replicas" not in workload["spec"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]


def test_copies_without_a_shared_storage_class_are_refused():
    with pytest.raises(InputError, match="max_replicas=2 puts copies on several nodes"):
        get_target("k8s")(_deployment("b300x4", "kubernetes.autoscaling.max_replicas=2"))


def test_a_group_spanning_nodes_scales_its_leader_worker_set():
    deployment = _deployment("h100x4", "parallelism.nodes=2", RWX, "kubernetes.autoscaling.max_replicas=2")
    assert _scaled_object(deployment)["spec"]["scaleTargetRef"]["kind"] == "LeaderWorkerSet"


def test_a_prefill_decode_pair_is_not_autoscaled():
    deployment = _deployment("b300x8", "disaggregation.enabled=true", "kubernetes.autoscaling.max_replicas=2")
    with pytest.raises(InputError, match="prefill/decode"):
        get_target("monitoring")(deployment)
