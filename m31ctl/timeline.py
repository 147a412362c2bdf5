"""The deployment's clock: one timeline, derived once from the plan, that vLLM and every runtime keep.

A start on real GPUs is download, then load and compile, then the API; a multi-node group also
waits for its members; a stop drains, then the runtime kills. vLLM has clocks of its own that
meet these (docs/decisions.md, "The deployment's clock"):

- `VLLM_ENGINE_READY_TIMEOUT_S` (vllm/envs.py, default 600): the API server waits this long for
  its engine cores to report ready (weights loaded, KV cache allocated, graphs captured), then
  exits with "Timed out waiting for engine core processes to start" (v1/engine/core_client.py).
  Every plan sets it to the load budget: a 1,200 s load under the 600 s default is a restart loop.
- `HANDSHAKE_TIMEOUT_MINS = 5` (v1/engine/core.py, no override): a headless data-parallel worker
  gives up when the leader's front-end has not answered within five minutes; it is met by start
  order (the worker waits for the leader's address and port before it starts vLLM).
- `--shutdown-timeout` (serving.shutdown_timeout): how long vLLM drains on SIGTERM.

Every clock in a rendered file or a launch is one of the figures below or a sum of them; the
architecture test checks that nothing else computes one. Pure: the plan's facts in, seconds out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

# vLLM's own default engine-ready limit (vllm/envs.py, VLLM_ENGINE_READY_TIMEOUT_S).
VLLM_DEFAULT_ENGINE_READY_S = 600
# vLLM's hard-coded headless worker handshake (v1/engine/core.py, HANDSHAKE_TIMEOUT_MINS = 5).
VLLM_HANDSHAKE_S = 300
ENGINE_READY_ENV = "VLLM_ENGINE_READY_TIMEOUT_S"
# After the engine cores report ready, the API server builds its app and binds the port: seconds,
# not minutes (seen: 2-6 s on the CPU build); a minute covers a busy host and one probe period.
API_MARGIN_S = 60
# How long the members of a multi-node group may take to find each other once their checkpoint
# is in place: vLLM's examples/online_serving/multi-node-serving.sh waits 300 s for Ray nodes; the
# data-parallel leader waits for its headless workers likewise.
GROUP_JOIN_S = 300
# The engine image is pulled by the runtime before any of our clocks start (tens of GB for a
# vLLM CUDA image); the Kubernetes progress deadline, which counts from the rollout, allows this.
IMAGE_PULL_S = 900
# How long the runtime waits beyond vLLM's own drain before it kills: the engine's workers exit
# after the API server, and a kill mid-exit leaves GPU memory held.
STOP_MARGIN_S = 30
# How long a terminating pod keeps serving before vLLM is told to drain. Kubernetes sends SIGTERM
# and removes the pod from its Service's endpoints at the same moment; kube-proxy on every node
# and any ingress or gateway learn of the removal seconds later, and until then they still send it
# requests, which a draining vLLM refuses (the pod termination flow in the Kubernetes docs,
# "Termination of Pods"; KServe and llm-d render a preStop sleep for this). Ten seconds covers
# the endpoint propagation of a busy cluster; the grace period counts it (Timeline.pod_grace_s).
ENDPOINT_REMOVAL_S = 10
# The HorizontalPodAutoscaler's own bounds (autoscaling/v2 validation): a scaling policy's period
# and a stabilization window at most.
HPA_MAX_POLICY_PERIOD_S = 1800
HPA_MAX_STABILIZATION_S = 3600
# What a service manager allows beyond a step it waits on: removing an old container, the checks,
# and `docker stop` returning after its own kill.
MANAGER_MARGIN_S = 60
# A P/D group's router (vllm-router) starts last, once both roles answer /health: it checks its
# workers' /health before it serves, and they answer already, so it answers in seconds; a minute
# covers a busy host and a probe period, as API_MARGIN_S does for the engine's API.
ROUTER_START_S = 60
# vllm-router drains on SIGTERM: measured with 0.1.17 here, it refused new connections at once
# and let an in-flight stream run to its end (7.3 s later) before exiting. So the runtime waits,
# before it kills the router, as long as the roles drain their own streams, and a little more for
# the last chunk to cross the router (docs/decisions.md, "Router clocks").
ROUTER_STOP_MARGIN_S = 5
# vllm-router ends a request after --request-timeout-secs (default 1,800 s: src/main.rs). A
# generation to the end of a 256K context at 20 tokens a second, a fifth of the recipes' per-user
# decode speed, takes 13,107 s: the router must wait at least that long, and never less than its
# own default.
ROUTER_DEFAULT_REQUEST_TIMEOUT_S = 1800
SLOWEST_TOKEN_S = 0.05
# Megabits in a gigabyte (decimal units, as checkpoint sizes and link speeds are quoted).
_MBIT_PER_GB = 8000


class Clock(NamedTuple):
    """One phase's bound: its seconds, where they come from, and the setting that changes them."""

    seconds: int
    source: str
    setting: str


class Timeline(NamedTuple):
    """Every bound of a start and a stop, in order. Zero-second clocks are phases this
    deployment does not have (a local checkpoint downloads nothing; one node joins no group)."""

    download: Clock  # the checkpoint, before the engine starts (never inside it)
    load: Clock  # weights, compile, graph capture: what vLLM's engine-ready limit must cover
    engine_ready: Clock  # VLLM_ENGINE_READY_TIMEOUT_S as the plan sets it
    api: Clock  # engine ready -> the API answers
    join: Clock  # a multi-node group assembling (0 on one node)
    drain: Clock  # vLLM's own drain on SIGTERM
    stop: Clock  # what the runtime waits before it kills
    # runtime.startup_timeout: the readiness wait as the user set it, instead of the sum.
    startup_override: Clock | None

    @property
    def download_s(self) -> int:
        return self.download.seconds

    @property
    def load_s(self) -> int:
        return self.load.seconds

    @property
    def engine_ready_s(self) -> int:
        return self.engine_ready.seconds

    @property
    def ready_s(self) -> int:
        """From the engine's start to the API answering: the startup probe, the healthcheck's
        start period, the script's --wait, systemd's readiness wait, launch's wait."""
        if self.startup_override is not None:
            return self.startup_override.seconds
        return self.join.seconds + self.load_s + self.api.seconds

    @property
    def start_s(self) -> int:
        """From the first step (the download) to the API answering."""
        return self.download_s + self.ready_s

    @property
    def engine_ready_with_download_s(self) -> int:
        """The engine-ready limit for an engine that downloads its own checkpoint (launch
        --no-pull): vLLM fetches the weights inside the engine core's start."""
        return self.engine_ready_s + self.download_s

    @property
    def drain_s(self) -> int:
        return self.drain.seconds

    @property
    def stop_s(self) -> int:
        return self.stop.seconds

    # What each runtime's own clock is set to: derived here so no target computes one.
    @property
    def pod_grace_s(self) -> int:
        """A pod's terminationGracePeriodSeconds: counted from the start of its preStop hook
        (the wait for the endpoints to drop it), then vLLM's drain and the workers' exit."""
        return ENDPOINT_REMOVAL_S + self.stop_s

    @property
    def systemd_start_s(self) -> int:
        """TimeoutStartSec: ExecStartPre's download, then ExecStartPost's readiness wait."""
        return self.start_s + MANAGER_MARGIN_S

    @property
    def systemd_stop_s(self) -> int:
        """TimeoutStopSec: ExecStop's `docker stop --time stop_s` returns after its kill."""
        return self.stop_s + MANAGER_MARGIN_S

    @property
    def progress_deadline_s(self) -> int:
        """A Kubernetes Deployment's progressDeadlineSeconds (default 600): counted from the
        rollout to an available pod, so it covers the image pull, the init container's
        download and the startup probe."""
        return IMAGE_PULL_S + self.start_s + MANAGER_MARGIN_S

    @property
    def copy_start_s(self) -> int:
        """A copy added beside a running one: the image pull on a node that lacks it, then the
        load; the checkpoint is in the shared claim already, so nothing is downloaded."""
        return IMAGE_PULL_S + self.ready_s

    @property
    def scale_up_period_s(self) -> int:
        """An autoscaler adds at most one copy per this many seconds: a new copy serves only after
        its start, and until it does the load that called for it has not moved, so a shorter
        period would add copy after copy for one burst. Capped at the HPA's limit for a policy
        period (1800 s, autoscaling/v2 HPAScalingPolicy)."""
        return min(self.copy_start_s, HPA_MAX_POLICY_PERIOD_S)

    @property
    def scale_down_window_s(self) -> int:
        """How long the load must stay low before a copy is removed: as long as bringing one back
        takes, capped at the HPA's limit for a stabilization window (3600 s)."""
        return min(self.copy_start_s, HPA_MAX_STABILIZATION_S)

    @property
    def checkpoint_wait_s(self) -> int:
        """A multi-node worker waiting for the leader's download of the shared checkpoint."""
        return self.download_s + IMAGE_PULL_S

    @property
    def leader_wait_s(self) -> int:
        """A worker waiting for the leader's address and port before it starts vLLM, so that
        vLLM's five-minute handshake starts only once the leader's front-end listens."""
        return self.join.seconds + IMAGE_PULL_S

    def rows(self) -> list[tuple[str, Clock]]:
        """The timeline as a table (plan --explain, docs/operations.md), in the order a start runs."""
        return [
            ("download", self.download),
            ("load and compile", self.load),
            (ENGINE_READY_ENV, self.engine_ready),
            ("API up", self.api),
            ("group join", self.join),
            ("drain (SIGTERM)", self.drain),
            ("stop (then kill)", self.stop),
            *([("readiness wait", self.startup_override)] if self.startup_override else []),
        ]


class TimelineInputs(NamedTuple):
    """The plan's facts the timeline reads (kept narrow so the derivation is easy to test)."""

    checkpoint_gb: float
    local_checkpoint: bool
    download_mbps: float
    load_and_compile_s: int
    startup_timeout: int | None
    shutdown_timeout: int
    nodes: int
    over_ray: bool


def timeline_of(facts: TimelineInputs) -> Timeline:
    if facts.local_checkpoint:
        download = Clock(0, "a local checkpoint: nothing to download", "model.path")
    else:
        seconds = math.ceil(facts.checkpoint_gb * _MBIT_PER_GB / facts.download_mbps)
        download = Clock(
            seconds,
            f"{facts.checkpoint_gb:g} GB at {facts.download_mbps:g} Mbit/s",
            "runtime.download_mbps",
        )
    load = Clock(
        facts.load_and_compile_s,
        "the plan's load budget (weights, compile, graphs)",
        "runtime.load_and_compile_s",
    )
    engine_ready = Clock(
        max(facts.load_and_compile_s, 1),
        f"the load budget; vLLM's default {VLLM_DEFAULT_ENGINE_READY_S} s would end a longer load",
        "runtime.load_and_compile_s",
    )
    api = Clock(API_MARGIN_S, "the API server binds after the engine reports ready", "(fixed)")
    override = (
        None
        if facts.startup_timeout is None
        else Clock(facts.startup_timeout, "the readiness wait, as set", "runtime.startup_timeout")
    )
    if facts.nodes > 1:
        what = "Ray nodes joining the head" if facts.over_ray else "headless data-parallel workers joining"
        join = Clock(GROUP_JOIN_S, f"{what} (vLLM's multi-node example waits 300 s)", "parallelism.nodes")
    else:
        join = Clock(0, "one node", "parallelism.nodes")
    drain = Clock(
        facts.shutdown_timeout, "vLLM drains in-flight requests on SIGTERM", "serving.shutdown_timeout"
    )
    stop = Clock(
        facts.shutdown_timeout + STOP_MARGIN_S,
        f"the drain plus {STOP_MARGIN_S} s for the engine's workers to exit",
        "serving.shutdown_timeout",
    )
    return Timeline(download, load, engine_ready, api, join, drain, stop, override)


class RouterTimeline(NamedTuple):
    """A P/D group's router: it starts once both roles answer, so its clocks follow from the roles'
    timelines (each role is an engine Deployment with its own) and are derived here, once."""

    roles: Clock  # the router's wait for both roles' /health: the slower role's rollout
    start: Clock  # the roles answering -> the router answering /health
    stop: Clock  # what the runtime waits before it kills the router
    request: Clock  # vllm-router's --request-timeout-secs: the longest generation a role serves

    @property
    def roles_wait_s(self) -> int:
        """The router pod's init container waiting for both roles: vllm-router gives up on
        workers after its own startup timeout, far shorter than a download and load."""
        return self.roles.seconds

    @property
    def start_s(self) -> int:
        """The router's healthcheck start period, once the roles answer."""
        return self.start.seconds

    @property
    def stop_s(self) -> int:
        return self.stop.seconds

    @property
    def request_timeout_s(self) -> int:
        return self.request.seconds

    @property
    def progress_deadline_s(self) -> int:
        """The router's Kubernetes Deployment: its init container waits for the roles' rollout,
        then the router starts."""
        return self.roles_wait_s + self.start_s

    @property
    def systemd_start_s(self) -> int:
        """The router unit's TimeoutStartSec: systemd starts it once both role units are started
        (their own readiness waits passed), so it covers only its readiness wait and the steps."""
        return self.start_s + MANAGER_MARGIN_S

    @property
    def systemd_stop_s(self) -> int:
        """The router unit's TimeoutStopSec: `docker stop --time stop_s` returns after its kill."""
        return self.stop_s + MANAGER_MARGIN_S


def router_timeline(roles: Sequence[Timeline], max_model_len: int) -> RouterTimeline:
    """The router's clocks from its roles' timelines (prefill and decode) and the longest sequence
    they serve."""
    slowest = max(role.progress_deadline_s for role in roles)
    waits = Clock(
        slowest,
        "the slower role's rollout (image pull, download, start), as its progressDeadlineSeconds",
        "runtime.download_mbps, runtime.load_and_compile_s, disaggregation.prefill/.decode layouts",
    )
    start = Clock(ROUTER_START_S, "vllm-router answers once its workers do", "(fixed)")
    stop = Clock(
        max(role.drain_s for role in roles) + ROUTER_STOP_MARGIN_S,
        "vllm-router drains its streams on SIGTERM: as long as the roles drain, plus the last chunk",
        "serving.shutdown_timeout",
    )
    longest = int(max_model_len * SLOWEST_TOKEN_S)
    request = Clock(
        max(ROUTER_DEFAULT_REQUEST_TIMEOUT_S, longest),
        f"a generation to max_model_len ({max_model_len}) at {1 / SLOWEST_TOKEN_S:g} tokens/s, at least "
        f"vllm-router's own {ROUTER_DEFAULT_REQUEST_TIMEOUT_S} s",
        "serving.max_model_len",
    )
    return RouterTimeline(waits, start, stop, request)


class ClockConflict(NamedTuple):
    """A budget that cannot be met, naming both settings."""

    message: str
    settings: tuple[str, str]


def conflicts(timeline: Timeline, engine_env: dict[str, str]) -> list[ClockConflict]:
    """What the plan's own clocks contradict: an engine-ready limit the user set below the load
    budget, a readiness wait shorter than the engine-ready limit."""
    found: list[ClockConflict] = []
    user_ready = engine_env.get(ENGINE_READY_ENV)
    if user_ready is not None and user_ready.isdigit() and int(user_ready) < timeline.load_s:
        found.append(
            ClockConflict(
                f"runtime.env.{ENGINE_READY_ENV}={user_ready} is shorter than runtime.load_and_compile_s="
                f"{timeline.load_s}: vLLM gives up on a load the plan allows, and the runtime restarts it",
                (f"runtime.env.{ENGINE_READY_ENV}", "runtime.load_and_compile_s"),
            )
        )
    if timeline.startup_override is not None and timeline.ready_s < timeline.engine_ready_s:
        found.append(
            ClockConflict(
                f"runtime.startup_timeout={timeline.ready_s} is shorter than runtime.load_and_compile_s="
                f"{timeline.load_s}: the runtime gives up before vLLM's own limit",
                ("runtime.startup_timeout", "runtime.load_and_compile_s"),
            )
        )
    return found
