"""Everything a rehearsal decides before any container starts: the plan's twin (twin.py), each plan
it runs derived once (the twin, and for a P/D plan the aggregated reference server the pair is
held against), and their renders read back as pods (pods.py). A layout or render m31ctl refuses
raises here (exit 2), so nothing is left to clean."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from m31ctl.deployment import Deployment, derive
from m31ctl.errors import InputError
from m31ctl.plan import Plan
from m31ctl.rehearsal.pods import Manifest, PodRun, refuse_secret_expansion, rendered_manifest
from m31ctl.rehearsal.provision import shim_image, tiny_models
from m31ctl.rehearsal.session import Options
from m31ctl.rehearsal.twin import Twin, rehearsal_twin
from m31ctl.render.k8s import API_SERVICE_SUFFIX

TARGETS = ("k8s",)
# The aggregated reference server's pod (and container) name in a P/D rehearsal.
REFERENCE_POD = "reference"


class Prepared(NamedTuple):
    twin: Twin
    deployment: Deployment  # the twin's
    manifest: Manifest
    model_dir: Path
    # A P/D plan's aggregated reference server (the twin without disaggregation, rendered by
    # the same code): the pod, and the claims its render declares. None: not a P/D plan.
    reference: PodRun | None = None
    reference_claims: tuple[str, ...] = ()

    @property
    def addressed(self) -> bool:
        """The pods need fixed addresses: one reads its own (status.podIP: a P/D role's NIXL
        side channel binds it), or a Service maps ports (its forwarder needs the target's)."""
        return any(p.fields for p in self.manifest.pods) or bool(self.manifest.forwarded)

    def role_pod(self, role: Deployment) -> str:
        """A P/D role's pod: the one its API Service selects."""
        service = next(s for s in self.manifest.services if s.name == role.name + API_SERVICE_SUFFIX)
        return service.pod

    @property
    def restarted_in_place(self) -> frozenset[str]:
        """The pods whose container the proof kills and starts again in place: a P/D pair's
        prefill (pairing.py's faults). The kubelet gives them a sandbox holding their address."""
        group = self.deployment.disaggregated
        return frozenset() if group is None else frozenset({self.role_pod(group.prefill)})

    @property
    def layout(self) -> str:
        """The twin's layout in words."""
        group = self.deployment.disaggregated
        if group is not None:
            roles = " + ".join(
                f"{r.kv_transfer.role.value} TP{r.layout.tensor}" for r in group.roles if r.kv_transfer
            )
            return (
                f"P/D pair: {roles}, one Deployment each, behind vllm-router (with an aggregated reference)"
            )
        par = self.twin.plan.settings.parallelism
        kind = "LeaderWorkerSet" if par.nodes > 1 else "Deployment"
        shape = f"TP{par.tensor} PP{par.pipeline} DP{par.data}" + (" EP" if par.expert else "")
        return f"{shape} on {par.nodes} node(s) ({kind}), {self.twin.ranks_per_node} rank(s) a node"


def prepare(plan: Plan, options: Options) -> Prepared:
    """The twin of `plan` and, for a P/D plan, its aggregated reference: each derived once, here,
    and rendered once by the normal render code."""
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
    )
    deployment = derive(twin.plan)
    alone = None if twin.reference is None else derive(twin.reference)
    manifest = rendered_manifest(deployment, options.target)
    if not [p for p in manifest.pods if not p.init]:
        raise InputError(f"the {options.target} render holds no pod to run")
    refuse_secret_expansion(manifest)
    if alone is None:
        return Prepared(twin, deployment, manifest, twin.model_dir)
    # The reference's serving pod, renamed and without the Service names (those are the pair's).
    reference = rendered_manifest(alone, options.target)
    pod = next(p for p in reference.pods if p.pod == reference.api_pod and not p.init)
    pod = pod._replace(pod=REFERENCE_POD, hostname=REFERENCE_POD, aliases=())
    return Prepared(twin, deployment, manifest, twin.model_dir, pod, reference.claims)
