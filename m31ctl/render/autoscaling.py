"""kubernetes.autoscaling: copies of one server scaled by KEDA on vLLM's own load metrics.

A KEDA ScaledObject (keda.sh/v1alpha1) drives a HorizontalPodAutoscaler over the k8s target's
workload (a Deployment, or a LeaderWorkerSet through its scale subresource) from two Prometheus
queries on the series the PodMonitor scrapes: requests waiting per copy
(`vllm:num_requests_waiting`, averaged over the copies by KEDA's AverageValue) and the copies'
mean KV cache usage (`vllm:kv_cache_usage_perc`), the two signals llm-d's and the vLLM
production stack's autoscaling examples use. Never to zero: a copy serves only a whole start
(m31ctl/timeline.py) after it is asked for, so scaling adds at most one copy per start and removes
one only after the load stayed low for as long as bringing it back would take. The copies share
the cache claim (ReadWriteMany, so a storage class is required, as for a group spanning nodes).
"""

from __future__ import annotations

from typing import Any

from m31ctl.deployment import Deployment
from m31ctl.errors import InputError

AUTOSCALING_FILE = "k8s-autoscaling.yaml"
POLLING_INTERVAL_S = 15  # KEDA's own default; the PodMonitor scrapes as often


def autoscaled(deployment: Deployment) -> bool:
    return deployment.plan.settings.kubernetes.autoscaling.max_replicas > 1


def _workload(deployment: Deployment) -> dict[str, str]:
    if deployment.layout.spans_nodes:
        return {
            "apiVersion": "leaderworkerset.x-k8s.io/v1",
            "kind": "LeaderWorkerSet",
            "name": deployment.name,
        }
    return {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment.name}


def scaled_object(deployment: Deployment, selector: str) -> dict[str, Any]:
    """The ScaledObject for the k8s target's workload; `selector` is the PromQL label selector the
    monitoring target's rules use (one label, set by the PodMonitor)."""
    if deployment.disaggregated is not None:
        raise InputError(
            "kubernetes.autoscaling.max_replicas scales copies of one server; a prefill/decode pair's "
            "roles are not autoscaled",
            hint="set kubernetes.autoscaling.max_replicas=1 for a prefill/decode plan",
        )
    scaling = deployment.plan.settings.kubernetes.autoscaling
    timeline = deployment.timeline

    def trigger(query: str, threshold: str, metric_type: str) -> dict[str, Any]:
        # ignoreNullValues "false": an empty answer (a lost scrape target, a selector that matches
        # nothing) is an error KEDA reports, and the HPA keeps the copies it has; KEDA's default
        # reads it as 0 and would remove copies that take the timeline's whole start to return.
        metadata = {"serverAddress": scaling.prometheus_url, "query": query, "threshold": threshold}
        return {
            "type": "prometheus",
            "metricType": metric_type,
            "metadata": metadata | {"ignoreNullValues": "false"},
        }

    one_copy_per = {"type": "Pods", "value": 1}
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": deployment.name, "labels": {"app.kubernetes.io/managed-by": "m31ctl"}},
        "spec": {
            "scaleTargetRef": _workload(deployment),
            "minReplicaCount": 1,
            "maxReplicaCount": scaling.max_replicas,
            "pollingInterval": POLLING_INTERVAL_S,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleUp": {
                            "stabilizationWindowSeconds": 0,
                            "policies": [{**one_copy_per, "periodSeconds": timeline.scale_up_period_s}],
                        },
                        "scaleDown": {
                            "stabilizationWindowSeconds": timeline.scale_down_window_s,
                            "policies": [{**one_copy_per, "periodSeconds": timeline.scale_up_period_s}],
                        },
                    }
                }
            },
            "triggers": [
                # AverageValue: KEDA divides the sum by the copies, so the threshold is per copy.
                trigger(
                    f"sum(vllm:num_requests_waiting{selector})",
                    str(scaling.waiting_per_replica),
                    "AverageValue",
                ),
                trigger(f"avg(vllm:kv_cache_usage_perc{selector})", f"{scaling.kv_cache_usage:g}", "Value"),
            ],
        },
    }


def autoscaling_notes(deployment: Deployment) -> list[str]:
    scaling = deployment.plan.settings.kubernetes.autoscaling
    timeline = deployment.timeline
    return [
        f"# KEDA scales {deployment.name} from 1 to {scaling.max_replicas} copies (kubernetes.autoscaling) on",
        f"# vLLM's queue (more than {scaling.waiting_per_replica} waiting per copy) and KV cache (above "
        f"{scaling.kv_cache_usage:g} full).",
        f"# A new copy serves about {timeline.copy_start_s} s after it is asked for (image pull and load): set",
        "# the thresholds low enough that the load's growth over that time still fits; one copy is",
        f"# added per {timeline.scale_up_period_s} s and one removed after {timeline.scale_down_window_s} s of low load.",
        "# Needs KEDA and the PodMonitor of k8s-monitoring.yaml; k8s.yaml leaves replicas to KEDA.",
    ]
