"""`render --target monitoring`: how to watch the running server. A Prometheus scrape
configuration, alert rules, a Grafana dashboard and, for Kubernetes, a PodMonitor and a
PrometheusRule for the Prometheus Operator with a NetworkPolicy that admits the scraper to the
metrics port alone. Pure: the Deployment in, artifacts out, every file data serialized to YAML
or JSON.

Every query reads vLLM 0.32's own metric names (vllm/v1/metrics/loggers.py, spec_decode/metrics.py,
kv_transfer/kv_connector/v1/nixl/stats.py; a counter `vllm:x` is exported as `vllm:x_total`), all
on the API port's /metrics, which vLLM's API key does not guard. Series are selected by one
target label, `m31ctl_deployment`, that the scrape configuration and the PodMonitor both set, so
the same rules and dashboard serve a host and a cluster.

Speculative decoding's queries are always there: without a draft their metrics are absent, the
panels stay empty and the rules never fire. The KV transfer's panel and alert are a P/D plan's
alone, and only where its connector is NIXL (the one whose metrics they read): an aggregated
server has no KV connector, and a rule for one would be read as something to watch.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from m31ctl.deployment import RENDERED_ROUTER_METRICS_PORT, Deployment
from m31ctl.errors import InputError
from m31ctl.netaddr import local_url
from m31ctl.render.artifact import Artifact
from m31ctl.render.autoscaling import AUTOSCALING_FILE, autoscaled, autoscaling_notes, scaled_object
from m31ctl.render.common import header
from m31ctl.render.escape import yaml_file
from m31ctl.render.k8s import PART_OF_LABEL, ROUTER_METRICS_PORT, Group, k8s_documents

TARGET = "monitoring"
SELECTOR_LABEL = "m31ctl_deployment"
# A P/D plan's members (prefill, decode, router) share SELECTOR_LABEL, so the rules and the
# dashboard sum over both engines; this label tells them apart.
ROLE_LABEL = "m31ctl_role"
SCRAPE_INTERVAL = "15s"
RATE_WINDOW = "5m"  # four scrapes at least: rate() over it survives a missed scrape
RULES_FILE = "m31ctl-alerts.yaml"
# Who scrapes in a cluster: the Prometheus Operator's pods (kube-prometheus-stack labels them so,
# in the namespace it is installed in). The NetworkPolicy admits exactly these to the metrics port.
SCRAPER_NAMESPACE = "monitoring"
SCRAPER_POD_LABELS = {"app.kubernetes.io/name": "prometheus"}
# Thresholds where the plan sets none (its verify marks, when set, take their place).
DEFAULT_QUEUE_P99_S = 5.0
DEFAULT_MIN_ACCEPTANCE = 1.5  # below it a draft barely pays for its verification


class Query(NamedTuple):
    """One PromQL query, as the dashboard draws it and as an alert's condition starts."""

    expr: str
    legend: str


class Alert(NamedTuple):
    name: str
    signal: Query  # the measured value; the rule fires when `signal condition` holds for `hold`
    condition: str
    hold: str
    severity: str
    summary: str

    @property
    def expr(self) -> str:
        return f"{self.signal.expr} {self.condition}"


class Panel(NamedTuple):
    title: str
    unit: str  # Grafana's unit id
    queries: tuple[Query, ...]


def _selector(deployment: Deployment) -> str:
    return f'{{{SELECTOR_LABEL}="{deployment.name}"}}'


def _rate(metric: str, sel: str, window: str = RATE_WINDOW) -> str:
    return f"rate({metric}{sel}[{window}])"


def _quantile(q: float, histogram: str, sel: str) -> str:
    return f"histogram_quantile({q}, sum by (le) ({_rate(histogram + '_bucket', sel)}))"


def _acceptance_length(sel: str, window: str = RATE_WINDOW) -> str:
    """Tokens a verification step yields: 1 + accepted drafts per draft (vLLM's mean acceptance
    length, what bench reports from the same counters)."""
    accepted = f"sum({_rate('vllm:spec_decode_num_accepted_tokens_total', sel, window)})"
    drafts = f"sum({_rate('vllm:spec_decode_num_drafts_total', sel, window)})"
    return f"1 + {accepted} / {drafts}"


def _kv_over_nixl(deployment: Deployment) -> bool:
    """A P/D plan whose KV moves through vLLM's NixlConnector, the one the vllm:nixl_* metrics
    come from."""
    return (
        deployment.disaggregated is not None and deployment.plan.settings.disaggregation.connector == "nixl"
    )


def panels(deployment: Deployment) -> tuple[Panel, ...]:
    sel = _selector(deployment)
    drafts = f"sum({_rate('vllm:spec_decode_num_drafts_total', sel)})"
    per_position = (
        f"sum by (position) ({_rate('vllm:spec_decode_num_accepted_tokens_per_pos_total', sel)})"
        f" / ignoring(position) group_left {drafts}"
    )
    shown = (
        Panel("Engine up", "none", (Query(f"up{sel}", "{{instance}}"),)),
        Panel(
            "Throughput (tokens/s)",
            "short",
            (
                Query(f"sum({_rate('vllm:generation_tokens_total', sel)})", "output"),
                Query(f"sum({_rate('vllm:prompt_tokens_total', sel)})", "prompt"),
            ),
        ),
        Panel(
            "Time to first token",
            "s",
            (
                Query(_quantile(0.5, "vllm:time_to_first_token_seconds", sel), "p50"),
                Query(_quantile(0.99, "vllm:time_to_first_token_seconds", sel), "p99"),
            ),
        ),
        Panel(
            "Time per output token (per request)",
            "s",
            (
                Query(_quantile(0.5, "vllm:request_time_per_output_token_seconds", sel), "p50"),
                Query(_quantile(0.99, "vllm:request_time_per_output_token_seconds", sel), "p99"),
            ),
        ),
        Panel(
            "KV cache usage", "percentunit", (Query(f"vllm:kv_cache_usage_perc{sel}", "engine {{engine}}"),)
        ),
        Panel(
            "Requests running and queued",
            "short",
            (
                Query(f"sum(vllm:num_requests_running{sel})", "running"),
                Query(f"sum(vllm:num_requests_waiting{sel})", "waiting (queue depth)"),
            ),
        ),
        Panel(
            "Queue time p99", "s", (Query(_quantile(0.99, "vllm:request_queue_time_seconds", sel), "p99"),)
        ),
        Panel(
            "Preemptions/s",
            "short",
            (Query(f"sum({_rate('vllm:num_preemptions_total', sel)})", "preemptions"),),
        ),
        Panel(
            "Speculative decoding: acceptance length (when speculating)",
            "short",
            (Query(_acceptance_length(sel), "tokens per step"),),
        ),
        Panel(
            "Speculative decoding: acceptance per draft position (when speculating)",
            "percentunit",
            (Query(per_position, "position {{position}}"),),
        ),
    )
    transfers = Panel(
        "Failed KV transfers/s (P/D with NIXL)",
        "short",
        (Query(f"sum({_rate('vllm:nixl_num_failed_transfers_total', sel)})", "failed"),),
    )
    return (*shown, transfers) if _kv_over_nixl(deployment) else shown


def alerts(deployment: Deployment) -> tuple[Alert, ...]:
    """The rules, thresholds from the plan's verify marks where it sets them."""
    sel = _selector(deployment)
    verify = deployment.plan.settings.verify
    queue_s = verify.ttft_p99_ms / 1000 if verify.ttft_p99_ms else DEFAULT_QUEUE_P99_S
    acceptance = verify.min_acceptance_length or DEFAULT_MIN_ACCEPTANCE
    name = deployment.name
    shown = (
        Alert(
            "VllmEngineDown",
            Query(f"up{sel}", "up"),
            "== 0",
            "2m",
            "critical",
            f"{name}: /metrics on {{{{ $labels.instance }}}} has not answered for 2 minutes",
        ),
        Alert(
            "VllmKvCacheNearlyFull",
            Query(f"max(vllm:kv_cache_usage_perc{sel})", "usage"),
            "> 0.95",
            "10m",
            "warning",
            f"{name}: KV cache over 95% for 10 minutes; new requests queue and running ones get preempted",
        ),
        Alert(
            "VllmPreempting",
            Query(f"sum({_rate('vllm:num_preemptions_total', sel)})", "preemptions"),
            "> 0",
            "10m",
            "warning",
            f"{name}: requests preempted for 10 minutes (KV cache too small for the load; "
            "lower serving.max_num_seqs or add memory)",
        ),
        Alert(
            "VllmQueueTimeHigh",
            Query(_quantile(0.99, "vllm:request_queue_time_seconds", sel), "p99"),
            f"> {queue_s:g}",
            "10m",
            "warning",
            f"{name}: p99 queue time above {queue_s:g} s for 10 minutes (more load than the batch admits)",
        ),
        Alert(
            "VllmSpecAcceptanceCollapsed",
            Query(_acceptance_length(sel, "15m"), "tokens per step"),
            f"< {acceptance:g}",
            "15m",
            "warning",
            f"{name}: speculative acceptance length below {acceptance:g} tokens per step for 15 minutes "
            "(the draft no longer pays; check the draft and the traffic)",
        ),
    )
    if not _kv_over_nixl(deployment):
        return shown
    transfers = Alert(
        "VllmKvTransferFailures",
        Query(f"sum(increase(vllm:nixl_num_failed_transfers_total{sel}[{RATE_WINDOW}]))", "failed"),
        "> 0",
        "0m",
        "critical",
        f"{name}: NIXL KV transfers failed between prefill and decode in the last {RATE_WINDOW}",
    )
    return (*shown[:4], transfers, *shown[4:])  # where it stood: the alerts' order kept


def rule_groups(deployment: Deployment) -> list[dict[str, Any]]:
    """Prometheus's rule groups (a rules file's `groups`, a PrometheusRule's `spec.groups`)."""
    return [
        {
            "name": deployment.name,
            "rules": [
                {
                    "alert": a.name,
                    "expr": a.expr,
                    "for": a.hold,
                    "labels": {"severity": a.severity, SELECTOR_LABEL: deployment.name},
                    "annotations": {"summary": a.summary},
                }
                for a in alerts(deployment)
            ],
        }
    ]


def scrape_target(deployment: Deployment) -> str:
    """host:port where this host reaches the server (its local URL's authority)."""
    return urlsplit(deployment.network.local_url).netloc


def _static_configs(deployment: Deployment) -> list[dict[str, Any]]:
    """What Prometheus scrapes: the server, or a P/D plan's two engines (each on its published
    port) and the router's exporter (RENDERED_ROUTER_METRICS_PORT, published on runtime.bind)."""
    group = deployment.disaggregated
    if group is None:
        return [{"targets": [scrape_target(deployment)], "labels": {SELECTOR_LABEL: deployment.name}}]
    router = group.router
    members = [(role.kv_transfer.role.value if role.kv_transfer else role.name, role) for role in group.roles]
    configs = [
        {"targets": [scrape_target(role)], "labels": {SELECTOR_LABEL: deployment.name, ROLE_LABEL: key}}
        for key, role in members
    ]
    router_target = urlsplit(local_url(router.network.bind, RENDERED_ROUTER_METRICS_PORT)).netloc
    configs.append(
        {"targets": [router_target], "labels": {SELECTOR_LABEL: deployment.name, ROLE_LABEL: "router"}}
    )
    return configs


def prometheus_config(deployment: Deployment) -> dict[str, Any]:
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
        "rule_files": [RULES_FILE],
        "scrape_configs": [
            {
                "job_name": deployment.name,
                "metrics_path": "/metrics",
                "static_configs": _static_configs(deployment),
            }
        ],
    }


def dashboard(deployment: Deployment) -> dict[str, Any]:
    """A Grafana dashboard (schema 39) reading a Prometheus data source chosen at import."""
    source = {"type": "prometheus", "uid": "${datasource}"}
    grid = []
    for index, panel in enumerate(panels(deployment)):
        grid.append(
            {
                "id": index + 1,
                "type": "timeseries",
                "title": panel.title,
                "datasource": source,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (index % 2), "y": 8 * (index // 2)},
                "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
                "targets": [
                    {
                        "refId": chr(ord("A") + i),
                        "datasource": source,
                        "expr": q.expr,
                        "legendFormat": q.legend,
                    }
                    for i, q in enumerate(panel.queries)
                ],
            }
        )
    return {
        "title": f"m31ctl {deployment.name} (vLLM)",
        "uid": f"m31ctl-{deployment.plan.hash}",
        "tags": ["m31ctl", "vllm"],
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"}
            ]
        },
        "annotations": {"list": []},
        "panels": grid,
    }


def _served_by(deployment: Deployment) -> tuple[dict[str, str], str]:
    """The pods that serve the API (and /metrics) and their port's name, read from the k8s
    target's own API Service: one source for which pods those are."""
    service = next(d for d in k8s_documents(deployment) if d["kind"] == "Service")
    return dict(service["spec"]["selector"]), str(service["spec"]["ports"][0]["targetPort"])


def _pd_served_by(deployment: Deployment) -> tuple[dict[str, str], str]:
    """A P/D plan's members: every pod of the group, the engines on their API port (the router
    names its own ports otherwise, render/pd.py). The roles' documents are made for their
    refusals."""
    group = deployment.disaggregated
    assert group is not None
    member = Group(deployment.name)
    for role in group.roles:
        k8s_documents(role, member)
    return {PART_OF_LABEL: deployment.name}, "http"


def k8s_monitoring_documents(deployment: Deployment) -> list[dict[str, Any]]:
    pd = deployment.disaggregated is not None
    selector, port_name = _pd_served_by(deployment) if pd else _served_by(deployment)
    name = deployment.name
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/managed-by": "m31ctl"}
    endpoints = [
        {
            "port": port_name,
            "path": "/metrics",
            "interval": SCRAPE_INTERVAL,
            # The label the rules and the dashboard select on, as the scrape config sets it.
            "relabelings": [{"targetLabel": SELECTOR_LABEL, "replacement": name}],
        }
    ]
    ports = [{"protocol": "TCP", "port": deployment.network.container_port}]
    if pd:
        # The router's exporter: a pod is scraped only on the ports it has.
        endpoints.append({**endpoints[0], "port": ROUTER_METRICS_PORT})
        ports.append({"protocol": "TCP", "port": RENDERED_ROUTER_METRICS_PORT})
    pod_monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "selector": {"matchLabels": selector},
            "podMetricsEndpoints": endpoints,
        },
    }
    rules = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": name, "labels": labels},
        "spec": {"groups": rule_groups(deployment)},
    }
    # NetworkPolicies add up: this one lets the scraper in on the metrics port and nothing else,
    # beside the k8s target's own policy for API clients.
    scraper = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": SCRAPER_NAMESPACE}},
        "podSelector": {"matchLabels": dict(SCRAPER_POD_LABELS)},
    }
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"{name}-metrics", "labels": labels},
        "spec": {
            "podSelector": {"matchLabels": selector},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [scraper], "ports": ports}],
        },
    }
    return [pod_monitor, rules, policy]


def _scraped_ports(deployment: Deployment) -> str:
    if deployment.disaggregated is None:
        return f"port {deployment.network.container_port}"
    return f"ports {deployment.network.container_port} and {RENDERED_ROUTER_METRICS_PORT} (the router's)"


def _labels_text(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def render_monitoring(deployment: Deployment) -> list[Artifact]:
    head = header(deployment, TARGET).splitlines()
    # First: a plan the autoscaler refuses is refused whole, whatever else renders.
    scaler = scaled_object(deployment, _selector(deployment)) if autoscaled(deployment) else None
    try:
        documents: list[dict[str, Any]] | None = k8s_monitoring_documents(deployment)
        refused = None
    except InputError as exc:  # the k8s target refuses this plan: nothing to monitor there
        documents, refused = None, " ".join(exc.message.split())  # one comment line
    config_notes = [
        *head,
        f"# Prometheus scrapes {deployment.name}'s /metrics; the rules are {RULES_FILE} beside this file.",
        f"# Every query selects {_selector(deployment)}: keep that label if you merge this job into yours.",
    ]
    if refused is not None:
        config_notes.append(f"# No k8s-monitoring.yaml: the k8s target refuses this plan ({refused}).")
    rules_notes = [*head, f"# promtool check rules {RULES_FILE}"]
    made = [
        Artifact(
            "prometheus.yml", yaml_file(config_notes, [prometheus_config(deployment)], explicit_start=False)
        ),
        Artifact(
            RULES_FILE, yaml_file(rules_notes, [{"groups": rule_groups(deployment)}], explicit_start=False)
        ),
        Artifact("grafana-dashboard.json", json.dumps(dashboard(deployment), indent=2) + "\n"),
    ]
    if documents is None:
        return made
    k8s_notes = [
        *head,
        "# For the Prometheus Operator, beside k8s.yaml: a PodMonitor and a PrometheusRule (a Prometheus",
        "# picks them by its podMonitorSelector and ruleSelector: add the labels yours asks for), and a",
        f"# NetworkPolicy admitting the pods labelled {_labels_text(SCRAPER_POD_LABELS)} of namespace",
        f"# {SCRAPER_NAMESPACE} (the scraper) to {_scraped_ports(deployment)} only (where the",
        "# network plugin enforces NetworkPolicy; edit both selectors if your Prometheus runs elsewhere).",
    ]
    made.append(Artifact("k8s-monitoring.yaml", yaml_file(k8s_notes, documents, explicit_start=True)))
    if scaler is not None:
        notes = [*head, *autoscaling_notes(deployment)]
        made.append(Artifact(AUTOSCALING_FILE, yaml_file(notes, [scaler], explicit_start=True)))
    return made
