"""The engine container's probes: when the kubelet restarts it, and when its pod takes traffic.

Readiness proves tokens (issue 50): vLLM's /health answers 200 while the engine core is wedged or
dead behind a live API server (vllm-project/vllm#39863; #36960 and the /health/ready, /ready and
/health/decode PRs that followed are not merged), so the pod would stay in the Service's
endpoints. The readiness probe generates one token through /v1/completions with the API key,
as production-stack's router checks its static backends (src/vllm_router/utils.py
is_model_healthy: a real completion with the key, not /health). Liveness keeps /health: a
restart is for a dead server, and a busy engine must not be restarted for being slow.
"""

from __future__ import annotations

import math
from typing import Any

from m31ctl.redact import API_KEY_ENV
from m31ctl.render.common import health_command
from m31ctl.render.k8s_pods import Pods
from m31ctl.render.kubelet_expansion import literal

PROBE_PERIOD_S = 10

# The token probe's clocks. Cost: one completion of a one-word prompt and max_tokens 1 per period
# per pod (2,880 a day at 30 s), next to the thousands of tokens a second an engine serves; vLLM's
# access log gets a line each time. A hung engine leaves the endpoints within failureThreshold
# periods (about 2 minutes); a healthy but saturated one leaves only if its queue keeps even one
# token waiting past the deadline four times in a row, when its clients wait as long (its
# autoscaler, kubernetes.autoscaling, acts on the queue well before). The first readiness after
# the startup probe comes within a period plus the deadline, inside the progress deadline's margin.
TOKEN_PROBE_PERIOD_S = 30
TOKEN_PROBE_FAILURES = 4
# The kubelet stops waiting at timeoutSeconds; the program gives up earlier, on its own deadline,
# so the probe fails with its own line in the pod's events (kubectl describe) rather than a kill.
TOKEN_PROBE_TIMEOUT_S = 30
TOKEN_DEADLINE_S = 25

# Run by the image's python3 (vLLM's images have it; curl not always), as a fixed text: the port,
# the served model name, the deadline and the key's variable come as argv, the key itself from the
# container's environment, so neither the manifest nor the probe's argv ever holds it. SIGALRM
# bounds the whole exchange, a server that accepts and then says nothing included.
TOKEN_PROBE_PROGRAM = """\
import json, os, signal, sys, urllib.request
port, model, deadline, key_variable = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
def give_up(*_):
    sys.exit(f"m31ctl readiness: no token within {deadline} s")
signal.signal(signal.SIGALRM, give_up)
signal.alarm(deadline)
body = json.dumps({"model": model, "prompt": "ping", "max_tokens": 1}).encode()
request = urllib.request.Request(
    f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
)
key = os.environ.get(key_variable)
if key:
    request.add_header("Authorization", "Bearer " + key)
try:
    with urllib.request.urlopen(request, timeout=deadline) as answer:
        generated = (json.load(answer).get("usage") or {}).get("completion_tokens") or 0
except (OSError, ValueError) as error:
    sys.exit(f"m31ctl readiness: {error}")
if generated < 1:
    sys.exit("m31ctl readiness: the engine answered without generating a token")
"""


def token_probe_command(pods: Pods) -> list[str]:
    """The readiness probe's argv. The kubelet expands $(NAME) in an exec probe's words against
    the container's literal env values (prober.go ExpandContainerCommandOnlyStatic), so each word
    is escaped as the container's command is (render/kubelet_expansion.py)."""
    served_name = pods.deployment.plan.settings.model.served_name
    words = [
        "python3",
        "-c",
        TOKEN_PROBE_PROGRAM,
        str(pods.spec.container_port),
        served_name,
        str(TOKEN_DEADLINE_S),
        API_KEY_ENV,
    ]
    return [literal(word) for word in words]


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
        "readinessProbe": readiness_probe(pods),
    }


def proves_tokens(pods: Pods) -> bool:
    """Whether readiness generates a token. A layout spanning nodes keeps /health: on vLLM's CPU
    build the leader of data-parallel ranks over two nodes died on the first request (the probe's,
    2 s after its API answered, while the other node's rank still loaded: engine core "cancelled",
    the worker gone; tests/rehearsal two-node DP), where one node's DP2 served it. Until a GPU run
    shows otherwise, a cross-node group's readiness stays what it was: /v1/models with the key."""
    return not pods.deployment.layout.spans_nodes


def readiness_probe(pods: Pods) -> dict[str, Any]:
    if not proves_tokens(pods):  # the probe of before: /v1/models answers, with the key
        return {
            "exec": {"command": health_command(pods.spec, "/v1/models")},
            "periodSeconds": PROBE_PERIOD_S,
            "timeoutSeconds": 10,
        }
    # An exec probe: an httpGet probe cannot POST, and would need the key in the manifest.
    return {
        "exec": {"command": token_probe_command(pods)},
        "periodSeconds": TOKEN_PROBE_PERIOD_S,
        "timeoutSeconds": TOKEN_PROBE_TIMEOUT_S,
        "failureThreshold": TOKEN_PROBE_FAILURES,
    }


def readiness_note(pods: Pods) -> str:
    """The header's line: what readiness proves, and what it costs."""
    if not proves_tokens(pods):
        return (
            "Readiness: the leader answers /v1/models with the key. A layout spanning nodes does not "
            "generate a token to be ready: on vLLM's CPU build the leader of data-parallel ranks over "
            "two nodes died on a first request while the other node still loaded. The liveness probe "
            "restarts a pod on /health alone."
        )
    return (
        f"Readiness: every {TOKEN_PROBE_PERIOD_S} s each engine pod generates one token (a one-word "
        f"prompt, max_tokens 1, with {API_KEY_ENV} from its environment) and leaves the Service's "
        f"endpoints after {TOKEN_PROBE_FAILURES} periods in a row without one within "
        f"{TOKEN_DEADLINE_S} s: vLLM's /health answers while the engine cannot generate. The "
        "liveness probe restarts a pod on /health alone."
    )
