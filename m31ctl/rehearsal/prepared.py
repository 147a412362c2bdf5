"""Everything a rehearsal decides before any container starts: the plan's twin (twin.py), derived
once, its render read back as pods (pods.py), and what the later steps need of them,
read here once: the cluster, the kubelet and the proofs read this value, never the plan or its
Deployment. A layout or render m31ctl refuses raises here (exit 2), so nothing is left to clean."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from m31ctl.deployment import Deployment, Disaggregated, derive
from m31ctl.errors import InputError
from m31ctl.plan import Plan
from m31ctl.rehearsal.pairing import ROUTER_HEALTH_FAILURES, ROUTER_HEALTH_SUCCESSES, PairClocks
from m31ctl.rehearsal.pods import Manifest, Strategy, refuse_secret_expansion, rendered_manifest
from m31ctl.rehearsal.provision import shim_image, tiny_models
from m31ctl.rehearsal.session import Options
from m31ctl.rehearsal.twin import Twin, rehearsal_twin
from m31ctl.render.k8s import API_SERVICE_SUFFIX
from m31ctl.timeline import ENDPOINT_REMOVAL_S, SLOWEST_TOKEN_S

TARGETS = ("k8s",)


class PairRun(NamedTuple):
    """A P/D plan's pair as its proof drives it: each role's pod and the port its API Service
    targets, and the clocks each step of the proof waits by."""

    prefill: str
    prefill_port: int
    decode: str
    decode_port: int
    clocks: PairClocks
    # How long prefill's container may take to end once killed (its timeline's stop clock).
    prefill_stop_s: float


class RolloutRun(NamedTuple):
    """What a rollout rehearsal (rollout_proof.py) reads of the twin: the rendered strategy, and the
    clocks its waits and its judgement come from (the twin's timeline)."""

    strategy: Strategy
    start_s: int  # the timeline's start: recreate's stated downtime (render/k8s_copies.py ROLLOUTS)
    pre_stop_s: int  # the rendered preStop wait (timeline.ENDPOINT_REMOVAL_S)
    drain_s: int  # vLLM's drain on SIGTERM (serving.shutdown_timeout)
    grace_s: int  # terminationGracePeriodSeconds (timeline.pod_grace_s)
    token_s: float  # a token's pace (timeline.SLOWEST_TOKEN_S): the stream in flight is sized by it
    max_model_len: int


class Prepared(NamedTuple):
    twin: Twin
    manifest: Manifest
    model_dir: Path
    layout: str  # the twin's layout in words
    image: str  # the twin's engine image (the Services' forwarders run it too)
    served_name: str
    # The serving pod's readiness budget: its rendered startup probe's (the timeline's ready_s).
    ready_s: float
    completions: int  # sent at once through the serving pod: two a data-parallel rank
    pair: PairRun | None = None  # None: not a P/D plan
    rollout: RolloutRun | None = None  # None: no rollout asked (Options.rollout)

    @property
    def addressed(self) -> bool:
        """The pods need fixed addresses: one reads its own (status.podIP: a P/D role's NIXL
        side channel binds it), or a Service maps ports (its forwarder needs the target's)."""
        return any(p.fields for p in self.manifest.containers) or bool(self.manifest.forwarded)

    @property
    def restarted_in_place(self) -> frozenset[str]:
        """The pods whose container the proof kills and starts again in place: a P/D pair's
        prefill (pairing.py's faults). The kubelet gives them a sandbox holding their address."""
        return frozenset() if self.pair is None else frozenset({self.pair.prefill})


def pair_clocks(group: Disaggregated) -> PairClocks:
    """How long each step of the pair's faults may take, from the group's own clocks."""
    router = group.router
    check = router.health_check_interval_s + router.health_check_timeout_s
    return PairClocks(
        router_down_s=ROUTER_HEALTH_FAILURES * check,
        health_s=router.health_check_timeout_s,
        prefill_ready_s=group.prefill.timeline.ready_s,
        router_back_s=ROUTER_HEALTH_SUCCESSES * check,
    )


def layout_words(twin: Twin, deployment: Deployment) -> str:
    """The twin's layout in words."""
    group = deployment.disaggregated
    if group is not None:
        roles = " + ".join(
            f"{r.kv_transfer.role.value} TP{r.layout.tensor}" for r in group.roles if r.kv_transfer
        )
        return f"P/D pair: {roles}, one Deployment each, behind vllm-router"
    par = twin.plan.settings.parallelism
    kind = "LeaderWorkerSet" if par.nodes > 1 else "Deployment"
    shape = f"TP{par.tensor} PP{par.pipeline} DP{par.data}" + (" EP" if par.expert else "")
    return f"{shape} on {par.nodes} node(s) ({kind}), {twin.ranks_per_node} rank(s) a node"


def _pair(group: Disaggregated, manifest: Manifest) -> PairRun:
    """The pair's pods and ports (each role's API Service's) and its clocks."""
    services = {s.name: s for s in manifest.services}
    prefill, decode = (services[role.name + API_SERVICE_SUFFIX] for role in group.roles)
    return PairRun(
        prefill=prefill.pod,
        prefill_port=prefill.ports[0][1],
        decode=decode.pod,
        decode_port=decode.ports[0][1],
        clocks=pair_clocks(group),
        prefill_stop_s=group.prefill.timeline.stop_s,
    )


def prepare(plan: Plan, options: Options) -> Prepared:
    """The twin of `plan`, derived once, here, and rendered once by the normal render code; what
    the later steps need of it is read here, and its Deployment does not leave this function."""
    if options.target not in TARGETS:
        raise InputError(
            f"rehearse runs the {', '.join(TARGETS)} target, not {options.target!r}",
            hint="--target k8s (its LeaderWorkerSet is the multi-node layout worth rehearsing)",
        )
    twin = rehearsal_twin(
        plan,
        tiny_models(options.cache),
        shim_image(options.base_image),
        options.timeout_s,
        options.clock_scale,
        SLOWEST_TOKEN_S if options.rollout else None,
    )
    deployment = derive(twin.plan)
    manifest = rendered_manifest(deployment, options.target)
    # The pod clients reach (read_manifest: the API Service's, a P/D plan's router; else the
    # first leader or server).
    if manifest.serving is None:
        raise InputError(f"the {options.target} render holds no pod to serve")
    refuse_secret_expansion(manifest)
    group = deployment.disaggregated
    settings = twin.plan.settings
    return Prepared(
        twin=twin,
        manifest=manifest,
        model_dir=twin.model_dir,
        layout=layout_words(twin, deployment),
        image=settings.engine.image,
        served_name=settings.model.served_name,
        ready_s=deployment.timeline.ready_s,
        completions=max(2, 2 * settings.parallelism.data),
        pair=None if group is None else _pair(group, manifest),
        rollout=_rollout(deployment, manifest) if options.rollout else None,
    )


def _rollout(deployment: Deployment, manifest: Manifest) -> RolloutRun:
    """The rollout's strategy and clocks; refused (exit 2) where the serving pod is not one
    Deployment's: a LeaderWorkerSet's group or a P/D pair rolls by rules this does not emulate."""
    serving = manifest.serving
    if deployment.disaggregated is not None or serving is None or serving.role != "server":
        raise InputError(
            "--rollout rehearses a Deployment's rollout: an aggregated plan on one node",
            hint="drop --rollout, or rehearse the plan with parallelism.nodes=1 and disaggregation off",
        )
    timeline = deployment.timeline
    return RolloutRun(
        strategy=manifest.strategy,
        start_s=timeline.start_s,
        pre_stop_s=ENDPOINT_REMOVAL_S,
        drain_s=timeline.drain_s,
        grace_s=timeline.pod_grace_s,
        token_s=SLOWEST_TOKEN_S,
        max_model_len=deployment.plan.settings.serving.max_model_len,
    )
