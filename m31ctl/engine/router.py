"""The vllm-router adapter: the only code that spells vllm-router's flags.

vllm-router (PyPI vllm-router 0.1.17, vllm-project/router) pairs each request's prefill and
decode the way vLLM's own P/D proxy does: prefill gets the request with max_tokens 1 and
`kv_transfer_params: {"do_remote_decode": true}`, decode gets the client's request with what
prefill returned, and the client gets decode's answer (src/routers/http/vllm_pd_router.rs). The
target supplies the upstream URLs (loopback ports natively, container names on a Docker
network, Service names in Kubernetes) and the metrics port (launch picks a free one).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import NamedTuple

from m31ctl.deployment import Router

# The router's console script (its wheel installs it; the CPU rehearsal image has it on PATH).
ROUTER_EXECUTABLE = "vllm-router"
# How long the router waits for every worker's /health at start (vllm-project/router
# src/main.rs --worker-startup-timeout-secs, default 600 s). m31ctl starts the router once the
# roles are ready, so this only bounds a role that dies in between.
WORKER_STARTUP_TIMEOUT_S = 600
# Attempts a request gets (vllm-router's --retry-max-retries counts them; its default 5). A P/D
# request is retried whole: the prompt's prefill runs again for each attempt, and a decode that
# answers 5xx is most often overloaded, so four more prefills of a long prompt only add load. One
# retry still covers a connection reset by a restarting worker.
ROUTER_ATTEMPTS = 2


class Upstreams(NamedTuple):
    prefill_url: str
    decode_url: str


class RouterInvocation(NamedTuple):
    image: str
    argv: tuple[str, ...]  # the whole command, the executable first


def router_invocation(
    router: Router,
    upstreams: Upstreams,
    *,
    host: str,
    port: int,
    metrics_port: int,
    request_timeout_s: int,
    metrics_host: str | None = None,
) -> RouterInvocation:
    """The router's command line. `host`/`port`: where it listens (loopback behind its front, the
    container's port, or the host's bind and port natively); `metrics_port` (on `metrics_host`,
    else `host`): its Prometheus exporter, always on, which exits the router when the port is
    taken."""
    argv = (
        ROUTER_EXECUTABLE,
        "--host", host,
        "--port", str(port),
        "--vllm-pd-disaggregation",
        "--prefill", upstreams.prefill_url,
        "--decode", upstreams.decode_url,
        "--kv-connector", router.connector,
        "--policy", router.policy,
        "--worker-startup-timeout-secs", str(WORKER_STARTUP_TIMEOUT_S),
        "--worker-startup-check-interval", "1",
        "--health-check-interval-secs", str(router.health_check_interval_s),
        "--health-check-timeout-secs", str(router.health_check_timeout_s),
        "--request-timeout-secs", str(request_timeout_s),
        "--retry-max-retries", str(ROUTER_ATTEMPTS),
        "--prometheus-host", metrics_host or host,
        "--prometheus-port", str(metrics_port),
    )  # fmt: skip
    return RouterInvocation(router.image, argv)


# ---------------------------------------------------------------------------------------------
# the front (engine/router_front.py): the router's public port, with the key

# Where the router listens behind its front, on its network namespace's loopback: vllm-router's
# own default --port (its --help), apart from the front's (the container port) and the metrics'.
ROUTER_BEHIND_FRONT_PORT = 30000
LOOPBACK = "127.0.0.1"
# The router's own list of workers, asked where only its namespace reaches it (the front answers
# 404 for it): `python3 -c` of this inside the router's container or namespace, as an operator's
# `kubectl exec` / `docker exec` would (vllm-router is a Python console script: python3 is there).
ROUTER_WORKERS_PROGRAM = (
    "import urllib.request as u; "
    f"print(u.urlopen('http://{LOOPBACK}:{ROUTER_BEHIND_FRONT_PORT}/list_workers', timeout=30).read().decode())"
)


@cache
def front_program() -> str:
    """The front's fixed text, run as `python3 -c`: this package's router_front.py, as shipped."""
    return Path(__file__).with_name("router_front.py").read_text(encoding="utf-8")


def front_invocation(
    image: str,
    *,
    host: str,
    port: int,
    request_timeout_s: int,
    key_env: str | None,
    upstream_port: int = ROUTER_BEHIND_FRONT_PORT,
) -> RouterInvocation:
    """The front's command line: on `host`/`port` (where clients reach the router), forwarding
    to the router on loopback at `upstream_port` (a free one natively, where groups share the
    host's loopback); `key_env`: the variable its key is read from (None: a plan without an API
    key, whose API it admits unauthenticated; worker management never)."""
    argv = (
        "python3", "-c", front_program(),
        "--host", host,
        "--port", str(port),
        "--upstream-host", LOOPBACK,
        "--upstream-port", str(upstream_port),
        "--timeout-s", str(request_timeout_s),
        *(("--key-env", key_env) if key_env else ()),
    )  # fmt: skip
    return RouterInvocation(image, argv)
