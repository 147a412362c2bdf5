"""A prefill/decode (P/D) pair run on one host: where its parts are and how they reach each other.

The Deployment derives the group (deployment.Disaggregated: two role engines and the router);
this module places it on one host, once, for everything that runs it there: the Compose, script
and systemd targets (render/) and launch (runtime/). Render and runtime read the same facts, so
the file a user renders and the pair launch starts cannot place the roles differently.

On Docker (Compose, the script, the units, the docker runtime) the pair has a network of its
own with a fixed subnet: each role sits at a fixed address, which it advertises to its peer for
NIXL's side channel (ZMQ binds an address, not a name, so it must be one the container holds),
and is reached under its role's name; vllm-router reaches the roles by those names and listens
on every address of its container. Natively (the native runtime) the roles answer on this
host's loopback ports, the router on a loopback port of its own and its front (issue 49) on the
plan's bind and port.

A pair that does not fit one host is refused here, in one message (PairWiderThanHost, exit 6):
Kubernetes (render/pd.py) places each role on nodes of its own.
"""

from __future__ import annotations

import ipaddress
from typing import NamedTuple

from m31ctl.container import ContainerSpec, groups_on_this_host, labels_for, render_spec
from m31ctl.deployment import CONTAINER_PORT, RENDERED_ROUTER_METRICS_PORT, Deployment, Disaggregated
from m31ctl.docker_run import (
    Attachment,
    Mode,
    lifecycle_args,
    log_args,
    network_args,
    publish_address,
    publish_spec,
)
from m31ctl.engine.adapter import build_invocation
from m31ctl.engine.router import (
    LOOPBACK,
    ROUTER_BEHIND_FRONT_PORT,
    RouterInvocation,
    Upstreams,
    front_invocation,
    router_invocation,
)
from m31ctl.errors import HostPreconditionError
from m31ctl.plan.disaggregation import pair_wider_than_host
from m31ctl.redact import API_KEY_ENV

# The pair's Docker network: Compose's network key (the project's `<project>_pd`), else the host's
# `NAME-pd`. Its subnet lies outside Docker's default address pools (172.17.0.0/12 and
# 192.168.0.0/16 in /20s) and Podman's (10.88.0.0/16, 10.89.0.0/16), so it does not take a range
# Docker hands other networks; `docker compose up` and `docker network create` name an overlap.
PAIR_NETWORK = "pd"
PAIR_SUBNET = "10.231.36.0/24"
_ROLE_HOST_OFFSET = 10  # prefill .10, decode .11
# The router's name on the pair's network (the roles' are their keys, as Compose's services).
ROUTER_ALIAS = "router"
# The router in a container (Compose, Kubernetes, the script, the units): on every address of it.
ROUTER_LISTEN = "0.0.0.0"
# vllm-router forwards this variable's value to the roles as `Authorization: Bearer`
# (vllm-project/router, the P/D router's worker requests); it is the roles' VLLM_API_KEY.
ROUTER_API_KEY_ENV = "OPENAI_API_KEY"


class PairWiderThanHost(HostPreconditionError):
    """A P/D pair that one host cannot hold (a role spans nodes, or the two roles need more GPUs
    than the host has), asked of a target or a runtime that runs the pair on one host."""


def on_one_host(deployment: Deployment, target: str) -> Disaggregated:
    """The group, refused where it does not fit one host (Disaggregated.fits_one_host): `target`,
    a render target or launch, runs the pair on one."""
    group = deployment.disaggregated
    assert group is not None, "a P/D group's deployment"
    if group.fits_one_host:
        return group
    wide = [role for role in group.roles if role.layout.spans_nodes]
    if wide:
        raise PairWiderThanHost(
            f"the {role_key(wide[0])} role spans {wide[0].layout.nodes} nodes: a {target} runs on one host",
            hint="render it with --target k8s (a LeaderWorkerSet per role spans nodes)",
        )
    hw = deployment.hardware
    raise PairWiderThanHost(
        f"{pair_wider_than_host(group.prefill.layout.gpus, group.decode.layout.gpus, hw.product, hw.count)}: "
        f"a {target} runs on one host",
        hint="render it with --target k8s (each role on its own nodes), or use smaller "
        "disaggregation.prefill/.decode layouts",
    )


def role_key(role: Deployment) -> str:
    """The role's name within the group: its Compose service, its alias on the pair's network."""
    assert role.kv_transfer is not None  # a role of a Disaggregated group
    return role.kv_transfer.role.value


# ---------------------------------------------------------------------------------------------
# natively


def loopback_router_invocation(
    group: Disaggregated,
    metrics_port: int = RENDERED_ROUTER_METRICS_PORT,
    *,
    behind_front: int = ROUTER_BEHIND_FRONT_PORT,
) -> RouterInvocation:
    """The router of the pair run natively: the roles on their loopback ports; the router on
    loopback at port `behind_front` behind its front (launch: a free one, as groups share the
    host's loopback; loopback_front_invocation takes the plan's bind and port), its exporter on
    the plan's bind."""
    upstreams = Upstreams(group.prefill.network.local_url, group.decode.network.local_url)
    network = group.router.network
    return router_invocation(
        group.router,
        upstreams,
        host=LOOPBACK,
        port=behind_front,
        metrics_port=metrics_port,
        request_timeout_s=group.router_timeline.request_timeout_s,
        metrics_host=network.bind,
    )


def loopback_front_invocation(
    deployment: Deployment, router_port: int = ROUTER_BEHIND_FRONT_PORT
) -> RouterInvocation:
    """The router's front of the pair run natively (engine/router_front.py): on the plan's bind
    and port, forwarding to the router on loopback at `router_port`, with the roles' key read
    from the variable they read it from where the plan has one (the process inherits it)."""
    group = deployment.disaggregated
    assert group is not None, "a P/D group's deployment"
    network = group.router.network
    return front_invocation(
        group.router.image,
        host=network.bind,
        port=network.port,
        request_timeout_s=group.router_timeline.request_timeout_s,
        key_env=deployment.secrets.api_key,
        upstream_port=router_port,
    )


# ---------------------------------------------------------------------------------------------
# on Docker


class PairRole(NamedTuple):
    """A role engine on the pair's network: its container, rendered for any host and advertising
    its fixed address, and how it is attached there (that address; its key as its alias)."""

    engine: Deployment
    spec: ContainerSpec
    attachment: Attachment

    @property
    def key(self) -> str:
        """Its Compose service, its alias on the network (role_key)."""
        return self.attachment.alias

    @property
    def address(self) -> str:
        """The fixed address it advertises to its peer for NIXL's side channel (role_address)."""
        return str(self.attachment.address)


class DockerPair(NamedTuple):
    """The pair on its Docker network: the roles, prefill then decode, and the router."""

    deployment: Deployment  # the group's
    group: Disaggregated
    network: str  # on the host (`NAME-pd`)
    roles: tuple[PairRole, PairRole]
    router: RouterInvocation
    # vllm-router's container, under its rendered name (NAME-router): the Docker targets' and
    # launch's, so every one runs it with the same image, command line, labels (the group's
    # plan's, which the pair's network carries too), clocks and log rotation.
    router_spec: ContainerSpec
    # The router's front (engine/router_front.py, issue 49) where it is asked for (fronted: every
    # Docker target and launch): the container that holds the network namespace, the pair's
    # network and the published ports; the router then listens on its loopback. None: the
    # router publishes its own port.
    front: ContainerSpec | None = None

    @property
    def router_attachment(self) -> Attachment:
        return Attachment(self.network, None, ROUTER_ALIAS)


def docker_pair(
    deployment: Deployment, target: str, *, on_this_host: bool = False, fronted: bool = False
) -> DockerPair:
    """The pair on its own Docker network, refused where it does not fit one host (`target`:
    what runs it there; `on_this_host`: launch, whose roles join this host's GPU groups by GID
    rather than the rendered files' group names; `fronted`: the router behind its front)."""
    group = on_one_host(deployment, target)
    network = network_name(deployment)
    prefill, decode = (
        _pair_role(role, index, network, on_this_host) for index, role in enumerate(group.roles)
    )
    router = rendered_router_invocation(group, pair_upstreams(group), fronted=fronted)
    router_spec = _router_spec(deployment, group, prefill.spec, router)
    pair = DockerPair(deployment, group, network, (prefill, decode), router, router_spec)
    if not fronted:
        return pair
    front = rendered_front_invocation(deployment, group)
    front_spec = router_spec._replace(
        # launch's is the group's one endpoint, under its name (the router is a part of it)
        name=deployment.name if on_this_host else f"{router_spec.name}-front",
        image=front.image,
        args=front.argv[1:],
        secret_env=(API_KEY_ENV,) if deployment.secrets.api_key else (),
    )
    return pair._replace(front=front_spec)


def network_name(deployment: Deployment) -> str:
    """The pair's Docker network on the host: one per deployment (Compose's is <project>_pd)."""
    return f"{deployment.name}-{PAIR_NETWORK}"


def role_address(index: int) -> str:
    """The fixed address of the group's `index`th role (prefill 0, decode 1) on the pair's network:
    Compose's ipv4_address, `docker run --ip`, the Engine API's IPAM config."""
    return str(ipaddress.ip_network(PAIR_SUBNET)[_ROLE_HOST_OFFSET + index])


def pair_upstreams(group: Disaggregated) -> Upstreams:
    """The roles on the pair's network: by their key (a Compose service, a network alias) and
    container port."""
    return Upstreams(*(f"http://{role_key(role)}:{role.network.container_port}" for role in group.roles))


def pair_router_invocation(group: Disaggregated) -> RouterInvocation:
    """The router on the pair's network, on every address of its container (no front)."""
    return rendered_router_invocation(group, pair_upstreams(group), fronted=False)


def rendered_router_invocation(
    group: Disaggregated, upstreams: Upstreams, *, fronted: bool
) -> RouterInvocation:
    """The router as a rendered file runs it (a container or a pod of its own), its exporter on
    every address at the rendered metrics port; its API behind its front on loopback
    (`fronted`), else on every address at the container port. `upstreams`: how that target
    reaches the roles."""
    return router_invocation(
        group.router,
        upstreams,
        host=LOOPBACK if fronted else ROUTER_LISTEN,
        port=ROUTER_BEHIND_FRONT_PORT if fronted else CONTAINER_PORT,
        metrics_port=RENDERED_ROUTER_METRICS_PORT,
        request_timeout_s=group.router_timeline.request_timeout_s,
        metrics_host=ROUTER_LISTEN,
    )


def rendered_front_invocation(deployment: Deployment, group: Disaggregated) -> RouterInvocation:
    """The router's front as a container runs it (engine/router_front.py): on every address at
    the container port, with the roles' key where the plan has one, from the router's image."""
    return front_invocation(
        group.router.image,
        host=ROUTER_LISTEN,
        port=CONTAINER_PORT,
        request_timeout_s=group.router_timeline.request_timeout_s,
        key_env=API_KEY_ENV if deployment.secrets.api_key else None,
    )


def _pair_role(role: Deployment, index: int, network: str, on_this_host: bool) -> PairRole:
    """The `index`th role at its fixed address on `network`, its container rendered for any host
    advertising that address, with its own GPUs of the shared host (device_ids by index where the
    plan has no UUIDs)."""
    address = role_address(index)
    spec = render_spec(role)
    if on_this_host:
        spec = spec._replace(group_add=groups_on_this_host(role))
    invocation = build_invocation(role, side_channel_host=address)
    env = {**dict(spec.env), **dict(invocation.env)}
    spec = spec._replace(args=invocation.args, env=tuple(sorted(env.items())))
    if spec.device_request and not spec.gpu_device_ids and role.gpus.indices:
        spec = spec._replace(gpu_device_ids=tuple(str(i) for i in role.gpus.indices))
    return PairRole(role, spec, Attachment(network, address, role_key(role)))


def group_labels(deployment: Deployment) -> tuple[tuple[str, str], ...]:
    """The group's labels, its plan's (container.labels_for): on Docker its router's container
    carries them (DockerPair.router_spec; the group's download and network read them there), in
    Kubernetes the router's objects carry them as annotations."""
    return labels_for(deployment.plan)


def _router_spec(
    deployment: Deployment,
    group: Disaggregated,
    role: ContainerSpec,
    invocation: RouterInvocation,
) -> ContainerSpec:
    """vllm-router's container: the invocation's image and arguments (its entrypoint is the
    invocation's first word), the group's labels, the roles' restart policy and log rotation,
    the router's clocks, its API on the plan's bind and port; no GPU, device or mount. With an
    API key it reads the key as vllm-router does (ROUTER_API_KEY_ENV)."""
    router = group.router
    clocks = group.router_timeline
    return ContainerSpec(
        name=router.name,
        image=invocation.image,
        args=invocation.argv[1:],
        env=(),
        secret_env=(ROUTER_API_KEY_ENV,) if deployment.secrets.api_key else (),
        labels=group_labels(deployment),
        vendor=role.vendor,
        device_request=False,
        gpu_count=0,
        gpu_device_ids=(),
        devices=(),
        group_add=(),
        security_opt=(),
        cap_add=(),
        ipc_host=False,
        shm_size=None,
        ulimits=(),
        mounts=(),
        bind=router.network.bind,
        host_port=router.network.port,
        container_port=CONTAINER_PORT,
        restart=role.restart,
        stop_timeout=clocks.stop_s,
        startup_timeout=clocks.start_s,
        log_max_size=role.log_max_size,
        log_max_files=role.log_max_files,
    )


class RunArgv(NamedTuple):
    """A `docker run` argv split where the target adds its secret arguments: before the image."""

    options: list[str]
    command: list[str]  # the image and what follows it


def router_run_argv(pair: DockerPair, mode: Mode) -> RunArgv:
    """vllm-router's `docker run` on the pair's network, as Compose's router service: the roles by
    their aliases, its API and metrics ports published on runtime.bind, the restart policy and
    log rotation of the roles' containers."""
    spec = pair.router_spec
    argv = ["run", *lifecycle_args(mode, spec.restart), "--name", spec.name]
    for key, value in spec.labels:
        argv += ["--label", f"{key}={value}"]
    argv += log_args(spec.log_max_size, spec.log_max_files)
    argv += ["--stop-timeout", str(spec.stop_timeout)]
    if pair.front is not None:  # in its front's namespace, which publishes the ports
        argv += ["--network", f"container:{pair.front.name}"]
    else:
        argv += network_args(pair.router_attachment)
        argv += _published_args(spec)
    argv += ["--entrypoint", pair.router.argv[0]]
    return RunArgv(argv, [spec.image, *spec.args])


def _published_args(spec: ContainerSpec) -> list[str]:
    metrics = publish_address(spec.bind, RENDERED_ROUTER_METRICS_PORT, RENDERED_ROUTER_METRICS_PORT)
    return ["--publish", publish_spec(spec), "--publish", metrics]


def front_run_argv(pair: DockerPair, mode: Mode) -> RunArgv:
    """The router's front's `docker run` (a fronted pair): the namespace's owner, on the pair's
    network under the router's alias, publishing the API and the router's metrics on runtime.bind."""
    spec = pair.front
    assert spec is not None
    argv = ["run", *lifecycle_args(mode, spec.restart), "--name", spec.name]
    for key, value in spec.labels:
        argv += ["--label", f"{key}={value}"]
    argv += log_args(spec.log_max_size, spec.log_max_files)
    argv += ["--stop-timeout", str(spec.stop_timeout)]
    argv += network_args(pair.router_attachment)
    argv += _published_args(spec)
    argv += ["--entrypoint", "python3"]
    return RunArgv(argv, [spec.image, *spec.args])
