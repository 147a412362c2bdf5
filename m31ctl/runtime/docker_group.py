"""A prefill/decode (P/D) group on the docker runtime (issue 36), run as one deployment.

The containers are the ones the rendered targets run, as m31ctl/pair.py places the pair on one
host (docker_pair): each role is its engine's container on the pair's own network (`NAME-pd`,
PAIR_SUBNET) at the fixed address it advertises for NIXL's side channel (ZMQ binds that address,
so it must be one the container holds), reached by its peers under its role's alias; vllm-router
runs the pair's command line on that network and publishes the plan's API port.

Launch follows native_group.py's shape: each role is converged exactly as an aggregated
container is (runtime/flow.py with docker.py's primitives; its own labels, plan record and
readiness wait), prefill then decode, and only once both answer is the router converged, under
the group's name, waiting on the group's RouterTimeline. Labels stand in for the native records'
`group` and `parts` (labels.py GROUP on each role and the network, PARTS on the router), so
`status` shows the group and each part (a part not running: `degraded: PART down`), `logs`
prints every part's, `stop` stops the router (no new requests reach the roles), then the roles,
and removes every part and the network; a part that dies while the group starts stops the group.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

from m31ctl.container import ContainerSpec, container_spec, groups_on_this_host, labels_for
from m31ctl.deployment import CONTAINER_PORT, RENDERED_ROUTER_METRICS_PORT, Deployment
from m31ctl.docker_run import Attachment, docker_run_argv
from m31ctl.errors import ConflictError, HostPreconditionError, M31Error
from m31ctl.labels import OWNER, Label
from m31ctl.pair import (
    PAIR_SUBNET,
    ROUTER_API_KEY_ENV,
    DockerPair,
    docker_pair,
    router_run_argv,
)
from m31ctl.runtime import engine_api
from m31ctl.runtime.flow import Backend, converge
from m31ctl.runtime.planrecord import record_of
from m31ctl.runtime.protocol import DryRun, LaunchOptions, LaunchResult, Reporter, ServerStatus

RUNTIME = "docker"
# What `docker stop` waits for when the container does not say (vLLM's drain + margin).
DEFAULT_STOP_TIMEOUT_S = 60


class ContainerRun(NamedTuple):
    """One container as launch creates it: an aggregated server, a P/D role or a group's router."""

    deployment: Deployment  # what converge decides on: the engine, or the group for its router
    spec: ContainerSpec
    labels: Mapping[str, str]
    attachment: Attachment | None = None  # on the pair's network (None: Docker's default bridge)
    entrypoint: tuple[str, ...] = ()  # () keeps the image's own
    # Ports beyond the API's: (container port, host port; None: one Docker picks free).
    published: tuple[tuple[int, int | None], ...] = ()
    # The container's secret variables from launch's environment, (in the container, in ours);
    # None: the spec's secret_env by the same names (an engine's).
    secrets_from: tuple[tuple[str, str], ...] | None = None

    def environ(self, environ: Mapping[str, str]) -> dict[str, str]:
        """What of launch's environment the container may read (create_container takes the
        spec's secret_env and launch's own variables from it)."""
        if self.secrets_from is None:
            return dict(environ)
        return {inside: environ[ours] for inside, ours in self.secrets_from if environ.get(ours)}


def single(deployment: Deployment, cwd: str) -> ContainerRun:
    """An aggregated server's container, with the plan it was launched with."""
    spec = container_spec(deployment)
    return ContainerRun(
        deployment, spec, {**spec.label_dict, Label.PLAN: record_of(deployment, cwd).to_json()}
    )


def role_parts(pair: DockerPair, cwd: str) -> list[ContainerRun]:
    """Each role's container as the rendered targets run it (its engine's container advertising
    its fixed address), attached to the pair's network at that address under its role's alias,
    labelled with its group."""
    parts = []
    for role in pair.roles:
        # The pair's containers are for any host; started here, the GPUs' groups are this host's GIDs.
        spec = role.spec._replace(group_add=groups_on_this_host(role.engine))
        record = record_of(role.engine, cwd).to_json()
        labels = {**spec.label_dict, Label.PLAN: record, Label.GROUP: pair.deployment.name}
        parts.append(ContainerRun(role.engine, spec, labels, role.attachment))
    return parts


def router_part(pair: DockerPair, cwd: str) -> ContainerRun:
    """vllm-router under the group's name (its one endpoint, as the native group's router record
    is), on the pair's network with the rendered targets' command line; its API on the plan's
    bind and port, its metrics on disaggregation.router.metrics_port (0: a port Docker picks),
    with the restart policy and log rotation of the roles' containers. The roles' API key
    reaches it as vllm-router reads it (ROUTER_API_KEY_ENV), through the Engine API."""
    deployment, group, invocation = pair.deployment, pair.group, pair.router
    role = pair.roles[0].spec
    router = group.router
    clocks = group.router_timeline
    key = deployment.secrets.api_key
    spec = ContainerSpec(
        name=deployment.name,
        image=invocation.image,
        args=invocation.argv[1:],
        env=(),
        secret_env=(ROUTER_API_KEY_ENV,) if key else (),
        labels=labels_for(deployment.plan),
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
    labels = {
        **spec.label_dict,
        Label.PLAN: record_of(deployment, cwd).to_json(),
        Label.PARTS: ",".join(r.name for r in group.roles),
    }
    return ContainerRun(
        deployment,
        spec,
        labels,
        pair.router_attachment,
        entrypoint=invocation.argv[:1],
        published=((RENDERED_ROUTER_METRICS_PORT, router.metrics_port or None),),
        secrets_from=((ROUTER_API_KEY_ENV, key),) if key else (),
    )


# ---------------------------------------------------------------------------------------------
# the pair's network


def _network_labels(deployment: Deployment) -> dict[str, str]:
    return {**dict(labels_for(deployment.plan)), Label.GROUP: deployment.name}


def _pair_network(client: Any, name: str) -> Any | None:
    # The engine's name filter matches parts of names: the one whose name is exactly this.
    return next((n for n in client.networks.list(names=[name]) if n.name == name), None)


def ensure_network(client: Any, pair: DockerPair) -> None:
    """The pair's network with PAIR_SUBNET (the roles' fixed addresses are in it): ours when
    it exists, else made now. Another network holding the subnet (another P/D group's, a
    rendered Compose file's) is named by the engine's refusal."""
    name, deployment = pair.network, pair.deployment
    for attempt in range(2):
        network = _pair_network(client, name)
        if network is not None:
            _check_network(network, name, deployment.name)
            return
        refused = engine_api.create_network(client, name, _network_labels(deployment), PAIR_SUBNET)
        if refused is None:
            return
        if attempt == 0 and _pair_network(client, name) is not None:
            continue  # a concurrent launch of this group made it first
        raise HostPreconditionError(
            f"Docker could not make the P/D pair's network {name} ({PAIR_SUBNET}, where the roles "
            f"advertise fixed addresses for NIXL): {refused[:200]}",
            hint="another network of this host may hold that subnet (docker network ls): stop the "
            "P/D group or Compose project using it first",
        )


def _check_network(network: Any, name: str, group: str) -> None:
    attrs = network.attrs or {}
    labels = attrs.get("Labels") or {}
    if labels.get(Label.OWNER) != OWNER:
        raise ConflictError(
            f"network {name} was not created by m31ctl; not touching it",
            hint="remove it (docker network rm), or launch under another --name",
        )
    subnets = [str(c.get("Subnet")) for c in (attrs.get("IPAM") or {}).get("Config") or []]
    if PAIR_SUBNET not in subnets:
        raise HostPreconditionError(
            f"network {name} has subnet(s) {', '.join(subnets) or 'none'}, not {PAIR_SUBNET}",
            hint=f"m31ctl stop --name {group} removes the group and its network",
        )


def remove_network(client: Any, group: str) -> None:
    """The group's network, once no container of its group is left on it."""
    wanted = {"label": f"{Label.GROUP}={group}"}
    if client.containers.list(all=True, filters=wanted):
        return
    for network in client.networks.list(filters=wanted):
        if (network.attrs.get("Labels") or {}).get(Label.OWNER) == OWNER:
            try:
                network.remove()
            except Exception as exc:
                if not engine_api.is_not_found(exc):  # removed meanwhile: gone all the same
                    raise


# ---------------------------------------------------------------------------------------------
# launch


class PartLaunch(Backend[Any], Protocol):
    """docker.py's launch primitives for one part; `created`: this launch created its container."""

    created: bool


def launch_group(
    deployment: Deployment,
    options: LaunchOptions,
    client: Any,
    backend_for: Callable[[ContainerRun, LaunchOptions], PartLaunch],
) -> LaunchResult:
    """Prefill, then decode, each waited for (even detached: the router needs both answering),
    then the router, waited for on the group's router clock unless --timeout says otherwise. A
    part that fails once this launch created something stops every part of the group before the
    error goes on, naming the group and what was stopped."""
    pair = docker_pair(deployment, "launch")
    cwd = os.getcwd()
    ensure_network(client, pair)
    roles = role_parts(pair, cwd)
    role_options = dataclasses.replace(options, detach=False)
    router_options = options
    if options.timeout is None:
        router_options = dataclasses.replace(options, timeout=float(pair.group.router_timeline.start_s))
    launches: list[PartLaunch] = []
    try:
        for part in roles:
            launches.append(backend_for(part, role_options))
            converge(RUNTIME, launches[-1], part.deployment, role_options)
        launches.append(backend_for(router_part(pair, cwd), router_options))
        return converge(RUNTIME, launches[-1], deployment, router_options)
    except M31Error as exc:
        if not any(launch.created for launch in launches):
            raise  # refused before this launch created anything: what ran before is untouched
        stopped = halt(client, pair, options.report)
        exc.message = f"P/D group {deployment.name}: {exc.message}; stopped the group" + (
            f" ({', '.join(stopped)}: each keeps its log for `m31ctl logs --name PART`; "
            "`m31ctl launch` replaces them, `m31ctl stop` removes them)"
            if stopped
            else ""
        )
        raise


def halt(client: Any, pair: DockerPair, report: Reporter) -> list[str]:
    """Stop every part of the group that exists, router first, for good (no restart policy), each
    kept with its log; the names stopped."""
    deployment, group = pair.deployment, pair.group
    stopped = []
    for name in (deployment.name, *(role.name for role in group.roles)):
        container = engine_api.find_container(client, name)
        if container is None or not _ours(container):
            continue
        # Only this group's: a server of ours under the group's name that is no router (an
        # aggregated one the router would have replaced) is not this launch's to stop.
        if not (parts_of(container) if name == deployment.name else group_of(container) == deployment.name):
            continue
        try:
            engine_api.stop_for_good(container)
            stopped.append(name)
        except Exception as exc:
            report(f"also not stopped: {name} ({engine_api.explanation(exc)[:160]})")
    return stopped


# ---------------------------------------------------------------------------------------------
# status, logs, stop


def _ours(container: Any) -> bool:
    return bool((container.labels or {}).get(Label.OWNER) == OWNER)


def parts_of(container: Any) -> tuple[str, ...]:
    """The role containers a group's router lists (empty for any other container)."""
    return tuple(p for p in (container.labels or {}).get(Label.PARTS, "").split(",") if p)


def group_of(container: Any) -> str | None:
    """The group a role container belongs to."""
    return (container.labels or {}).get(Label.GROUP) or None


def _part(client: Any, router: Any, name: str) -> Any | None:
    """The router's part `name`, if it is ours and of this group (anything else is not touched)."""
    container = engine_api.find_container(client, name)
    if container is None or not _ours(container) or group_of(container) != router.name:
        return None
    return container


def statuses(containers: Sequence[Any], row: Callable[[Any], ServerStatus]) -> list[ServerStatus]:
    """Each container as status shows it (`row`): a group's row (its state says which part is
    down), then a row per part; a part whose router is gone stands alone (so it can be stopped)."""
    by_name = {str(c.name): c for c in containers}
    listed = {part for c in containers for part in parts_of(c)}
    rows: list[ServerStatus] = []
    for container in containers:
        if str(container.name) in listed:
            continue
        shown = row(container)
        parts = [(part, by_name.get(part)) for part in parts_of(container)]
        down = [part for part, found in parts if found is None or found.status != "running"]
        if parts and shown.running and down:
            shown = dataclasses.replace(shown, state=f"degraded: {', '.join(down)} down", health=None)
        rows.append(shown)
        for part, found in parts:
            if found is None:
                missing = ServerStatus(part, RUNTIME, "missing", None, None, None, None, None)
                rows.append(dataclasses.replace(missing, group=shown.name))
            else:
                rows.append(dataclasses.replace(row(found), group=shown.name))
    return rows


def write_logs(client: Any, router: Any, follow: bool, tail: int, write: Callable[[str], None]) -> None:
    """Each part's last lines under a header naming it, roles first, the router last (followed
    with --follow)."""
    for name in parts_of(router):
        part = _part(client, router, name)
        if part is None:
            write(f"==> {name}: no container <==\n")
            continue
        write(f"==> {name} (container {part.short_id}) <==\n")
        write(part.logs(tail=tail).decode("utf-8", "replace"))
    write(f"==> {router.name} (container {router.short_id}) <==\n")
    stream = router.logs(stream=follow, follow=follow, tail=tail)
    for chunk in stream if follow else [stream]:
        write(chunk.decode("utf-8", "replace"))


def stop_container(container: Any, timeout: int | None, keep: bool, report: Reporter) -> None:
    """`docker stop` with `timeout` (else the container's own stop timeout), then remove it
    unless `keep`. One removed meanwhile is stopped all the same."""
    config = container.attrs.get("Config") or {}
    grace = timeout if timeout is not None else int(config.get("StopTimeout") or DEFAULT_STOP_TIMEOUT_S)
    report(f"stopping {container.name} (SIGTERM, then SIGKILL after {grace} s)")
    try:
        container.stop(timeout=grace)
        if not keep:
            container.remove()
    except Exception as exc:
        if not engine_api.is_not_found(exc):
            raise


def stop_group(client: Any, router: Any, timeout: int | None, keep: bool, report: Reporter) -> None:
    """The router first (no new requests reach the roles), then each role, each given `timeout`
    (else its own stop timeout); unless `keep`, each is removed and then the pair's network.
    A part that cannot be stopped is raised after the others were tried."""
    refused: list[Exception] = []
    parts = [router, *(_part(client, router, name) for name in parts_of(router))]
    for part in parts:
        if part is None:
            continue
        try:
            stop_container(part, timeout, keep, report)
        except Exception as exc:
            refused.append(exc)
    if not keep and not refused:
        remove_network(client, str(router.name))
    if refused:
        raise refused[0]


def dry_run_group(deployment: Deployment) -> DryRun:
    """The three `docker run` command lines and the pair's network. The router runs under the
    group's name (the rendered script names its container NAME-router)."""
    pair = docker_pair(deployment, "launch")
    router = router_run_argv(pair, "detached")
    router_argv = [*router.options, *router.command]
    router_argv[router_argv.index("--name") + 1] = deployment.name
    roles = role_parts(pair, os.getcwd())
    detail: dict[str, Any] = {
        "network": {"name": pair.network, "subnet": PAIR_SUBNET},
        **{
            role.key: ["docker", *docker_run_argv(part.spec, "detached", None, part.attachment)]
            for role, part in zip(pair.roles, roles, strict=True)
        },
        "router": ["docker", *router_argv],
    }
    return DryRun("container", ("docker", *router_argv), detail, argv_key="docker_run")
