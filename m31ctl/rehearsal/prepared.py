"""Everything a rehearsal decides before any container starts: the plan's twin (twin.py) and its
one Deployment, its render read back as pods (pods.py), and, for a P/D plan, the aggregated
reference server the pair is held against. Each plan that runs is derived once, here. A layout or
render m31ctl refuses raises here (exit 2), so nothing is left to clean."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import yaml

from m31ctl.deployment import Deployment, derive
from m31ctl.errors import InputError
from m31ctl.plan import Plan
from m31ctl.rehearsal.pods import Manifest, PodRun, read_manifest, secret_mark
from m31ctl.rehearsal.provision import model_dir_for, shim_image
from m31ctl.rehearsal.session import Options
from m31ctl.rehearsal.twin import Twin, rehearsal_twin
from m31ctl.render import get_target
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
    """The twin of `plan`, derived and rendered once; with a P/D plan, its reference too."""
    if options.target not in TARGETS:
        raise InputError(
            f"rehearse runs the {', '.join(TARGETS)} target, not {options.target!r}",
            hint="--target k8s (its LeaderWorkerSet is the multi-node layout worth rehearsing)",
        )
    model_dir = model_dir_for(options.cache, plan.settings.parallelism.expert)
    twin = rehearsal_twin(
        plan, str(model_dir), shim_image(options.base_image), options.timeout_s, options.clock_scale
    )
    deployment = derive(twin.plan)
    manifest = rendered_manifest(deployment, options.target)
    if not [p for p in manifest.pods if not p.init]:
        raise InputError(f"the {options.target} render holds no pod to run")
    refuse_secret_expansion(manifest)
    if deployment.disaggregated is None:
        return Prepared(twin, deployment, manifest, model_dir)
    reference, claims = reference_pod(twin.plan, options.target)
    return Prepared(twin, deployment, manifest, model_dir, reference, claims)


def render_documents(deployment: Deployment, target: str) -> list[dict[str, Any]]:
    """The target rendered by the normal render code, read back as the documents it holds."""
    documents: list[dict[str, Any]] = []
    for artifact in get_target(target)(deployment):
        if artifact.name.endswith((".yaml", ".yml")):
            documents += [d for d in yaml.safe_load_all(artifact.content) if d]
    return documents


def rendered_manifest(deployment: Deployment, target: str) -> Manifest:
    """The pods, Services and claims Kubernetes would run from the deployment's render."""
    return read_manifest(render_documents(deployment, target), deployment.name + API_SERVICE_SUFFIX)


def reference_pod(paired: Plan, target: str) -> tuple[PodRun, tuple[str, ...]]:
    """The P/D twin's aggregated twin (the same settings, disaggregation off) rendered by the
    normal render code: its serving pod, renamed and without the Service names (those are the
    pair's), and the claims it mounts."""
    settings = paired.settings
    alone = settings.model_copy(
        update={"disaggregation": settings.disaggregation.model_copy(update={"enabled": False})}
    )
    manifest = rendered_manifest(derive(paired._replace(settings=alone)), target)
    pod = next(p for p in manifest.pods if p.pod == manifest.api_pod and not p.init)
    return pod._replace(pod=REFERENCE_POD, hostname=REFERENCE_POD, aliases=()), manifest.claims


def refuse_secret_expansion(manifest: Manifest) -> None:
    """A command or args word the kubelet would expand into a secret's value (argv is visible
    in ps and in the node's logs): refused before anything starts."""
    for pod in manifest.pods:
        words = [*(pod.command or ()), *(pod.args or ())]
        leaked = [name for name, _ in pod.secrets if any(secret_mark(name) in w for w in words)]
        if leaked:
            raise InputError(
                f"pod {pod.pod}: its command expands the secret {leaked[0]} into argv "
                "(visible in ps and the node's logs)",
                hint="read the secret from the environment inside the process, never via $(NAME)",
            )
