"""The engine container's probes: when the kubelet restarts it, and when its pod takes traffic."""

from __future__ import annotations

import math
from typing import Any

from m31ctl.render.common import health_command
from m31ctl.render.k8s_pods import Pods

PROBE_PERIOD_S = 10


def probes(pods: Pods) -> dict[str, Any]:
    """The startup probe allows the timeline's readiness wait (the group's join, loading and
    compiling, the API: the init container downloaded before it), in whole probe periods."""
    spec = pods.spec
    return {
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": PROBE_PERIOD_S,
            "failureThreshold": max(1, math.ceil(spec.startup_timeout / PROBE_PERIOD_S)),
        },
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 30,
            "timeoutSeconds": 10,
            "failureThreshold": 3,
        },
        # An exec probe: an httpGet probe would need the API key written into the manifest.
        "readinessProbe": {
            "exec": {"command": health_command(spec, "/v1/models")},
            "periodSeconds": PROBE_PERIOD_S,
            "timeoutSeconds": 10,
        },
    }
