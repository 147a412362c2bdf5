"""A prefill/decode (P/D) plan rendered: its two role engines and vllm-router in front.

Each role is a full engine Deployment (deployment.Disaggregated), so each renders as the
aggregated server does, through the same builders (targets.compose_engine_service, the k8s
target's documents), with what P/D adds: on one host (Compose) the pair as m31ctl/pair.py places
it (its network, the address each role advertises to its peer for NIXL's side channel, the
router's command line), in Kubernetes each role behind its Service with the router's command
line naming them, and the order (the router starts once both roles answer /health). Everything is data, serialized once; docs/decisions.md
("P/D: rendered targets (issue 36)") cites the sources.
"""

from __future__ import annotations

import shlex
import textwrap
from typing import Any

from m31ctl.container import ContainerSpec, render_spec
from m31ctl.deployment import CONTAINER_PORT, RENDERED_ROUTER_METRICS_PORT, Deployment, Disaggregated
from m31ctl.docker_run import publish_address, publish_spec
from m31ctl.engine.adapter import SIDE_CHANNEL_HOST_ENV, kv_transfer_env
from m31ctl.engine.router import LOOPBACK, ROUTER_BEHIND_FRONT_PORT
from m31ctl.errors import InputError
from m31ctl.pair import (
    PAIR_NETWORK,
    PAIR_SUBNET,
    ROUTER_API_KEY_ENV,
    DockerPair,
    docker_pair,
    role_key,
)
from m31ctl.redact import API_KEY_ENV
from m31ctl.render.artifact import Artifact
from m31ctl.render.common import header, health_command_on, in_comment
from m31ctl.render.escape import compose_escape, yaml_file
from m31ctl.render.k8s import (
    API_SERVICE_SUFFIX,
    PART_OF_LABEL,
    Group,
    k8s_comments,
    k8s_documents,
    k8s_secrets,
)
from m31ctl.render.k8s_copies import hf_cache_claim, roles_share_claim
from m31ctl.render.k8s_router import k8s_router
from m31ctl.render.targets import (
    COMPOSE_API_KEY_SECRET,
    api_key_entrypoint,
    compose_download,
    compose_engine_service,
    compose_secret_notes,
    compose_secrets,
    engine_secret_env,
    token_from_file,
    writable_sources,
)

# The Compose service of the router's front, whose network namespace the router shares.
FRONT_SERVICE = "front"


def refuse_pd(target: str, rendered: tuple[str, ...]) -> None:
    """A target that does not render a P/D plan; `rendered`: those that do (the registry's)."""
    raise InputError(
        f"--target {target} does not render a prefill/decode plan (disaggregation.enabled=true)",
        hint=f"use --target {' or '.join(rendered)}, or run the pair on this host with `m31ctl launch`",
    )


# ---------------------------------------------------------------------------------------------
# Compose


def download_spec(role: Deployment, spec: ContainerSpec) -> ContainerSpec:
    """The container that downloads for a role (`spec`, the role's): the same checkpoint at the
    same commit into the same cache, without what only the engines' KV transfer reads."""
    assert role.kv_transfer is not None
    transfer_only = set(kv_transfer_env(role.kv_transfer, ""))
    return spec._replace(env=tuple((k, v) for k, v in spec.env if k not in transfer_only))


def _compose_logging(spec: ContainerSpec) -> dict[str, Any]:
    return {
        "driver": "json-file",
        "options": {"max-size": spec.log_max_size, "max-file": str(spec.log_max_files)},
    }


def _compose_front(pair: DockerPair) -> dict[str, Any]:
    """The router's front (engine/router_front.py): the service whose network namespace the
    router joins, so it holds the pair's network and publishes the router's API (its own port)
    and metrics (the router's exporter) on runtime.bind; healthy once /health, which it forwards
    to the router without a key, answers. With an API key it reads the key as the roles do."""
    spec = pair.front
    assert spec is not None
    entrypoint, secrets = _keyed_entrypoint(spec, API_KEY_ENV, ("python3",))
    return {
        "image": spec.image,
        "container_name": spec.name,
        "entrypoint": entrypoint,
        **secrets,
        "command": list(spec.args),
        "labels": spec.label_dict,
        "ports": [
            publish_spec(spec),
            publish_address(spec.bind, RENDERED_ROUTER_METRICS_PORT, RENDERED_ROUTER_METRICS_PORT),
        ],
        "environment": [],
        "networks": [PAIR_NETWORK],
        "logging": _compose_logging(spec),
        "restart": spec.restart,
        "stop_grace_period": f"{spec.stop_timeout}s",
        "healthcheck": {
            "test": ["CMD", *health_command_on(spec.container_port, "/health")],
            "interval": "30s",
            "timeout": "10s",
            "retries": 3,
            "start_period": f"{spec.startup_timeout}s",
        },
    }


def _keyed_entrypoint(
    spec: ContainerSpec, env: str, executable: tuple[str, ...]
) -> tuple[list[str], dict[str, Any]]:
    """A service's entrypoint and its Compose secrets: with a key, `executable` started with the
    key read from the secret file into `env` (api_key_entrypoint), never in the file itself."""
    if not spec.secret_env:
        return list(executable), {}
    return api_key_entrypoint(env, executable), {"secrets": [COMPOSE_API_KEY_SECRET]}


def _compose_router(pair: DockerPair) -> dict[str, Any]:
    """vllm-router's service: its container as the pair derives it for every Docker target and
    launch (DockerPair.router_spec), in its front's network namespace (listening on its
    loopback) once both roles are healthy."""
    spec = pair.router_spec
    # its entrypoint, as launch's: the invocation's first word; the roles' key, which it
    # forwards to them, read from the roles' file
    entrypoint, secrets = _keyed_entrypoint(spec, ROUTER_API_KEY_ENV, tuple(pair.router.argv[:1]))
    return {
        "image": spec.image,
        "container_name": spec.name,
        "entrypoint": entrypoint,
        **secrets,
        "command": list(spec.args),
        "labels": spec.label_dict,
        "environment": [],
        "network_mode": f"service:{FRONT_SERVICE}",
        # Compose 1.29+ and v2: the router starts once both roles' healthchecks pass.
        "depends_on": {
            FRONT_SERVICE: {"condition": "service_started"},
            **{role.key: {"condition": "service_healthy"} for role in pair.roles},
        },
        "logging": _compose_logging(spec),
        "restart": spec.restart,
        "stop_grace_period": f"{spec.stop_timeout}s",
    }


def group_download_spec(pair: DockerPair) -> ContainerSpec:
    """The one download for both roles (Compose's download service, the script's): the same
    checkpoint at the same commit into the same cache, under the group's name and labels (its
    router's container's)."""
    prefill = pair.roles[0]
    spec = download_spec(prefill.engine, prefill.spec)
    return spec._replace(name=pair.deployment.name, labels=pair.router_spec.labels)


def compose_pd_document(deployment: Deployment) -> dict[str, Any]:
    pair = docker_pair(deployment, "compose", fronted=True)
    services: dict[str, Any] = {}
    download = compose_download(pair.roles[0].engine, group_download_spec(pair))
    if download is not None:
        services["download"] = token_from_file(download)
    for role in pair.roles:
        spec = role.spec._replace(secret_env=engine_secret_env(role.spec))  # no HF_TOKEN: the download's
        service = compose_engine_service(role.engine, spec)
        service["networks"] = {PAIR_NETWORK: {"ipv4_address": role.address}}
        if download is not None:
            service["depends_on"] = {"download": {"condition": "service_completed_successfully"}}
        services[role.key] = service
    services[FRONT_SERVICE] = _compose_front(pair)
    services["router"] = _compose_router(pair)
    networks = {PAIR_NETWORK: {"ipam": {"config": [{"subnet": PAIR_SUBNET}]}}}
    raw: dict[str, Any] = {"services": services, "networks": networks}
    secrets = compose_secrets(token=download is not None, api_key=deployment.secrets.api_key is not None)
    if secrets:
        raw["secrets"] = secrets
    document: dict[str, Any] = compose_escape(raw)
    return document


def render_compose_pd(deployment: Deployment) -> list[Artifact]:
    document = compose_pd_document(deployment)  # refusals first
    group = deployment.disaggregated
    assert group is not None
    dirs = sorted({d for role in group.roles for d in writable_sources(render_spec(role))})
    router = group.router
    clocks = ", ".join(
        f"{role_key(role)} {role.timeline.ready_s} s to answer /health, {role.timeline.stop_s} s to stop"
        for role in group.roles
    )
    notes = [
        f"Prefill/decode: services prefill and decode (vLLM, NIXL KV transfer) and router (vllm-router, "
        f"in the network namespace of service {FRONT_SERVICE}, its front) on "
        f"{in_comment(router.network.local_url, '<runtime.bind>:<runtime.port>')}; the router starts once both "
        f"roles are healthy, and its metrics are on port {RENDERED_ROUTER_METRICS_PORT}.",
        f"Network: the roles advertise their fixed addresses on network {PAIR_NETWORK} ({PAIR_SUBNET}) "
        "for NIXL's side channel (ZMQ binds an address, not a service name); `docker compose up` "
        "refuses the file if another network of this host holds that subnet.",
        f"Clocks (m31ctl/timeline.py): {clocks} (healthcheck start_period and stop_grace_period).",
        front_note(deployment.secrets.api_key is not None),
    ]
    comments = [
        *header(deployment, "compose").splitlines(),
        *(f"# {line}" for note in compose_secret_notes(document) if note for line in _wrapped(note)),
        "# Create the cache directory first (a long-syntax bind mount does not): mkdir -p "
        + " ".join(in_comment(shlex.quote(d), "<runtime.hf_cache>") for d in dirs),
        *(f"# {line}" for note in notes for line in _wrapped(note)),
    ]
    return [Artifact("compose.yaml", yaml_file(comments, [document], explicit_start=False))]


def front_note(keyed: bool) -> str:
    """What the router's front guards (render/k8s_router.py, engine/router_front.py)."""
    key = (
        f"requires Authorization: Bearer with the roles' key ({API_KEY_ENV}; the router forwards it to "
        f"them as {ROUTER_API_KEY_ENV})"
        if keyed
        else "admits without a key (the plan sets no runtime.api_key)"
    )
    return (
        f"The router's front: vllm-router checks no key and serves worker management (/add_worker, "
        f"/workers), so it listens on loopback ({LOOPBACK}:{ROUTER_BEHIND_FRONT_PORT}) only, and the front "
        f"(m31ctl's engine/router_front.py, python3 of the router's image) takes its port: /health without "
        f"a key, the OpenAI API under /v1/, which it {key}, and 404 for every other path."
    )


def _wrapped(note: str) -> list[str]:
    return textwrap.wrap(note, width=98, break_on_hyphens=False)


# ---------------------------------------------------------------------------------------------
# Kubernetes


def k8s_pd_documents(deployment: Deployment) -> list[dict[str, Any]]:
    """Each role as the k8s target renders an engine (a Deployment, or a LeaderWorkerSet when the
    role spans nodes; its claim, Service and NetworkPolicy), then the router's."""
    group = deployment.disaggregated
    assert group is not None
    member = k8s_group(deployment)
    documents: list[dict[str, Any]] = []
    if member.claim_name is not None:
        documents.append(hf_cache_claim(group.prefill, member.claim_name, member.labels, shared=True))
    for role in group.roles:
        documents += [_near_the_peer(doc, group) for doc in k8s_documents(role, member)]
    return documents + k8s_router(deployment, group)


def k8s_group(deployment: Deployment) -> Group:
    """The group its roles' documents belong to: one Secret, one label, and, where the roles
    share the cache claim, the prefill role downloading into it for both."""
    group = deployment.disaggregated
    assert group is not None
    return Group(deployment.name, group.prefill.name if roles_share_claim(deployment) else None)


def _claim_note(deployment: Deployment, member: Group) -> str:
    group = deployment.disaggregated
    assert group is not None
    if member.claim_name is not None:
        return (
            f"Cache: both roles mount one claim, {member.claim_name} (ReadWriteMany, class "
            f"{deployment.plan.settings.kubernetes.hf_cache_storage_class}: kubernetes.hf_cache_storage_class "
            f"must provision ReadWriteMany volumes), and the checkpoint is downloaded once: {group.prefill.name}'s "
            f"init container downloads it, {group.decode.name}'s waits for the download's marker. "
        )
    return (
        "Cache: each role downloads the checkpoint into a claim of its own (twice the egress and the "
        "storage): kubernetes.hf_cache_storage_class is unset, so the claims take the cluster's default "
        "class, which may be ReadWriteOnce only, and the roles may run on different nodes. Name a class "
        "that provisions ReadWriteMany volumes to download it once into one claim both roles mount. "
    )


def _near_the_peer(document: dict[str, Any], group: Disaggregated) -> dict[str, Any]:
    """A role's Deployment asks to share a node with its peer where both fit one (the KV then
    crosses no network: NVLink or the node's loopback instead of the data-centre fabric);
    preferred, not required, so a full node never leaves a role Pending. Roles that span nodes
    (LeaderWorkerSets) are placed by LWS; the header says when the pair cannot share a node."""
    if document.get("kind") != "Deployment" or not group.fits_one_host:
        return document
    roles = [role.name for role in group.roles]
    term = {
        "weight": 100,
        "podAffinityTerm": {
            "labelSelector": {
                "matchExpressions": [{"key": "app.kubernetes.io/name", "operator": "In", "values": roles}]
            },
            "topologyKey": "kubernetes.io/hostname",
        },
    }
    pod = document["spec"]["template"]["spec"]
    pod["affinity"] = {"podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [term]}}
    return document


def render_k8s_pd(deployment: Deployment) -> list[Artifact]:
    documents = k8s_pd_documents(deployment)  # refusals first
    group = deployment.disaggregated
    assert group is not None
    member = k8s_group(deployment)
    note = (
        f"Prefill/decode: {group.prefill.name} and {group.decode.name} (vLLM, NIXL KV transfer), each "
        f"with its own Service, and {group.router.name} (vllm-router) behind Service "
        f"{deployment.name}{API_SERVICE_SUFFIX} on port {group.router.network.port}, where clients reach "
        "the plan as they would an aggregated server. The router's pod waits for both roles' /health "
        f"first. Each role advertises its pod IP ({SIDE_CHANNEL_HOST_ENV}, from status.podIP) to its peer. "
        f"Network: the roles admit the pods labelled {PART_OF_LABEL}={deployment.name} (the peer and the "
        "router) on every port, as NIXL's side channel and UCX's TCP transport need; the router admits "
        f"kubernetes.api_clients to port {CONTAINER_PORT} and to its metrics on port {RENDERED_ROUTER_METRICS_PORT}, as an "
        "engine's /metrics on its API port (the monitoring target admits its scraper to both). "
        + front_note(API_KEY_ENV in k8s_secrets(group.prefill)[1]).replace(
            "The router's front:", "The router's pod:"
        )
        + " The pod's readiness is the front's /health (the router's, forwarded), the router's liveness its "
        "exporter's /metrics (the kubelet cannot reach its loopback). "
        + (_claim_note(deployment, member) if not group.prefill.model.local else "")
        + (
            "Placement: the roles prefer one node (podAffinity on kubernetes.io/hostname), where the KV "
            "crosses no network."
            if group.fits_one_host
            else "Placement: the pair needs more GPUs than one node has, so the KV crosses the network "
            "between nodes, "
            + (
                "over RDMA (fabric.rdma)."
                if group.prefill.rdma is not None
                else "over UCX's TCP transport: fabric.rdma is unset (the plan warns)."
            )
        )
    )
    comments = [
        *header(deployment, "k8s").splitlines(),
        *(f"# {line}" for line in textwrap.wrap(note, width=98, break_on_hyphens=False)),
    ]
    for role in group.roles:
        comments.append(f"# {role_key(role)} ({role.name}):")
        comments += k8s_comments(role, member)
    return [Artifact("k8s.yaml", yaml_file(comments, documents, explicit_start=True))]
