"""kubernetes.autoscaling (issue 50): KEDA scales copies of one server on vLLM's queue and KV
cache, adding at most one copy per start and never to zero; the copies share a ReadWriteMany
cache claim; k8s.yaml leaves the replica count to KEDA. The behaviour KEDA hands to the HPA is
checked against Kubernetes' own autoscaling/v2 schema; every rendered ScaledObject against KEDA's
own CRD and its prometheus scaler's parameters (tests/fixtures/schemas/keda/, KEDA v2.20.2, its
README says how they were taken)."""

from __future__ import annotations

import copy
import json
import math
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
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
KEDA = Path(__file__).parent.parent / "fixtures" / "schemas" / "keda"
# The CRD's one CEL rule (x-kubernetes-validations), checked by hand below: a vendored CRD with
# another rule fails the test instead of leaving that rule unchecked.
MIN_LE_MAX = (
    "!has(self.minReplicaCount) || self.minReplicaCount <= "
    "(has(self.maxReplicaCount) ? self.maxReplicaCount : 100)"
)
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


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
    # A lost scrape is an error KEDA reports (the HPA keeps its copies), never a reading of 0.
    assert {t["metadata"]["ignoreNullValues"] for t in spec["triggers"]} == {"false"}
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


# --- KEDA's own schemas ---------------------------------------------------------------------------
def _strict(node: Any) -> Any:
    """An openAPIV3Schema as the API server applies it under field validation Strict (kubectl's
    default): an object that declares its properties rejects any other field (a structural CRD
    would otherwise prune it silently); a map (additionalProperties) or a preserved object keeps
    what it declares."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {
        k: {n: _strict(s) for n, s in v.items()} if k == "properties" else _strict(v) for k, v in node.items()
    }
    if (
        "properties" in node
        and "additionalProperties" not in node
        and not node.get("x-kubernetes-preserve-unknown-fields")
    ):
        out["additionalProperties"] = False
    return out


def _cel_rules(node: Any) -> list[str]:
    if isinstance(node, list):
        return [r for n in node for r in _cel_rules(n)]
    if not isinstance(node, dict):
        return []
    own = [" ".join(r["rule"].split()) for r in node.get("x-kubernetes-validations", [])]
    return own + [r for k, v in node.items() if k != "x-kubernetes-validations" for r in _cel_rules(v)]


INT32 = jsonschema.FormatChecker()
INT32.checks("int32")(lambda v: not isinstance(v, int) or -(2**31) <= v < 2**31)


def keda_errors(doc: dict[str, Any]) -> list[str]:
    """What KEDA's CRD (as the API server applies it) and its prometheus scaler find wrong."""
    crd = yaml.safe_load((KEDA / "keda.sh_scaledobjects.yaml").read_text())
    group, _, version_name = doc["apiVersion"].partition("/")
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == version_name]
    assert (group, doc["kind"], version["served"]) == (
        crd["spec"]["group"],
        crd["spec"]["names"]["kind"],
        True,
    )
    schema = version["schema"]["openAPIV3Schema"]
    assert _cel_rules(schema) == [MIN_LE_MAX]
    validator = jsonschema.Draft4Validator(_strict(schema), format_checker=INT32)
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
    spec = doc.get("spec", {})
    if isinstance(spec.get("minReplicaCount"), int) and spec["minReplicaCount"] > spec.get(
        "maxReplicaCount", 100
    ):
        errors.append("spec: minReplicaCount must be less than or equal to maxReplicaCount")
    if not DNS_SUBDOMAIN.fullmatch(doc["metadata"]["name"]) or len(doc["metadata"]["name"]) > 253:
        errors.append(f"metadata.name: {doc['metadata']['name']!r} is not a DNS subdomain")
    # The CRD types a trigger's metadata as a map of strings only; KEDA's generated scaler schema
    # says which keys the prometheus scaler reads and which it needs.
    (scaler,) = json.loads((KEDA / "scalers-schema.prometheus.json").read_text())["scalers"]
    params = {p["name"]: p for p in scaler["parameters"]}
    needed = {n for n, p in params.items() if not p.get("optional") and "default" not in p}
    for i, trigger in enumerate(spec.get("triggers", [])):
        metadata = trigger.get("metadata", {})
        if trigger.get("type") != scaler["type"]:
            errors.append(f"spec.triggers.{i}.type: {trigger.get('type')!r} is not the prometheus scaler")
            continue
        errors += [
            f"spec.triggers.{i}.metadata: {k!r} is no parameter of the scaler"
            for k in set(metadata) - set(params)
        ]
        errors += [f"spec.triggers.{i}.metadata: {k!r} is required" for k in sorted(needed - set(metadata))]
        if trigger.get("metricType") not in ("AverageValue", "Value"):  # Utilization is for cpu/memory
            errors.append(f"spec.triggers.{i}.metricType: {trigger.get('metricType')!r}")
        for key in ("threshold", "activationThreshold"):  # float64 in prometheusMetadata
            if isinstance(metadata.get(key), str):
                try:
                    number = float(metadata[key])
                except ValueError:
                    number = math.nan
                # The threshold becomes the HPA's target, which Kubernetes requires to be positive.
                if not math.isfinite(number) or (key == "threshold" and number <= 0):
                    errors.append(f"spec.triggers.{i}.metadata.{key}: {metadata[key]!r}")
    return errors


SCALED_PLANS = {
    "deployment": ("b300x4", "kubernetes.autoscaling.max_replicas=3", RWX),
    "leader-worker-set": ("h100x4", "parallelism.nodes=2", RWX, "kubernetes.autoscaling.max_replicas=2"),
    "edges": ("h200x8", RWX, "kubernetes.autoscaling.max_replicas=64", "kubernetes.autoscaling.waiting_per_replica=1",
              "kubernetes.autoscaling.kv_cache_usage=1", "runtime.container_name=m3-flash-0"),
    "rehearsal": ("cpu", "kubernetes.autoscaling.max_replicas=2", RWX, "kubernetes.autoscaling.kv_cache_usage=0.5",
                  "kubernetes.autoscaling.prometheus_url=http://127.0.0.1:9090"),
}  # fmt: skip


@pytest.mark.parametrize("key", SCALED_PLANS)
def test_every_rendered_scaled_object_validates_against_kedas_crd(key):
    hardware, *sets = SCALED_PLANS[key]
    scaler = _scaled_object(_deployment(hardware, *sets))
    assert keda_errors(scaler) == []


# Each a mistake the validation must catch (the API server, KEDA or the HPA it makes would refuse it,
# or KEDA would ignore the key): what it does to the rendered object, and the words.
BROKEN = {
    "threshold as a number": (lambda s: s["spec"]["triggers"][0]["metadata"].update(threshold=8), "is not of type 'string'"),
    "an HPA field name": (lambda s: s["spec"].update(minReplicas=1), "Additional properties"),
    "a misspelt behaviour": (
        lambda s: s["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleUp"].update(stabilisationWindowSeconds=0),
        "Additional properties",
    ),
    "more than int32": (lambda s: s["spec"].update(maxReplicaCount=2**31), "is not a 'int32'"),
    "min above max": (lambda s: s["spec"].update(minReplicaCount=4), "minReplicaCount must be less than"),
    "no threshold": (lambda s: s["spec"]["triggers"][1]["metadata"].pop("threshold"), "'threshold' is required"),
    "a misspelt scaler key": (lambda s: s["spec"]["triggers"][1]["metadata"].update(treshold="1"), "no parameter"),
    "a zero threshold": (lambda s: s["spec"]["triggers"][1]["metadata"].update(threshold="0"), "threshold: '0'"),
    "no triggers": (lambda s: s["spec"].update(triggers=[]), "should be non-empty"),
}  # fmt: skip


def test_the_validation_catches_what_the_cluster_would_refuse_or_ignore():
    rendered = _scaled_object(_deployment(*SCALED_PLANS["deployment"]))
    for what, (breaks, words) in BROKEN.items():
        broken = copy.deepcopy(rendered)
        breaks(broken)
        errors = keda_errors(broken)
        assert any(words in e for e in errors), (what, errors)
