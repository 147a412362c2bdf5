"""A prefill/decode (P/D) group on the docker runtime (issue 36), launched as one deployment.

The containers are the ones the rendered targets run, as m31ctl/pair.py places the pair on one
host (DockerPair, derived once by the caller and read here): each role is its engine's container
on the pair's own network (`NAME-pd`, PAIR_SUBNET) at the fixed address it advertises for NIXL's
side channel (ZMQ binds that address, so it must be one the container holds), reached by its
peers under its role's alias; the router's front (engine/router_front.py, issue 49) holds the
network namespace on that network and publishes the plan's API port, and vllm-router runs the
pair's command line in that namespace, on its loopback (it checks no key: the front does).

Launch follows native_group.py's shape: each role is converged exactly as an aggregated
container is (runtime/flow.py with docker_launch.py's primitives; its own labels, plan record
and readiness wait), prefill then decode, and only once both answer are the front (under the
group's name, not waited for: it answers once the router does) and the router (NAME-router)
converged, the router waited for through the front on the group's RouterTimeline. Labels stand
in for the native records' `group` and `parts` (labels.py GROUP on each part and the network,
PARTS on the front), which status, logs and stop read back (runtime/docker_servers.py); a part
that dies while the group starts stops the group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from m31ctl.deployment import RENDERED_ROUTER_METRICS_PORT
from m31ctl.docker_run import docker_run_argv
from m31ctl.errors import ConflictError, HostPreconditionError, M31Error
from m31ctl.labels import OWNER, Label
from m31ctl.pair import PAIR_SUBNET, ROUTER_API_KEY_ENV, DockerPair, front_run_argv, router_run_argv
from m31ctl.redact import API_KEY_ENV
from m31ctl.runtime import engine_api
from m31ctl.runtime.docker_launch import ContainerRun
from m31ctl.runtime.docker_servers import RUNTIME, group_of, ours, parts_of
from m31ctl.runtime.flow import Backend, converge
from m31ctl.runtime.protocol import DryRun, LaunchOptions, LaunchResult, Reporter


def role_parts(pair: DockerPair) -> list[ContainerRun]:
    """Each role's container as the pair places it (its engine's container advertising its fixed
    address, attached to the pair's network at that address under its role's alias), labelled
    with its group."""
    member = {Label.GROUP: pair.deployment.name}
    return [
        ContainerRun(role.engine, role.spec, {**role.spec.label_dict, **member}, role.attachment)
        for role in pair.roles
    ]


def front_part(pair: DockerPair) -> ContainerRun:
    """The router's front (engine/router_front.py) under the group's name, its one endpoint (as
    the native group's router record is), listing its parts: the network namespace's owner, on
    the pair's network under the router's alias, publishing the API and the router's metrics on
    disaggregation.router.metrics_port (0: a port Docker picks). The roles' API key reaches it
    as the roles read it (API_KEY_ENV), through the Engine API."""
    deployment, group = pair.deployment, pair.group
    assert pair.front is not None, "a fronted pair (docker_pair(fronted=True))"
    key = deployment.secrets.api_key
    parts = (pair.router_spec.name, *(role.name for role in group.roles))  # stop's order after the front
    return ContainerRun(
        deployment,
        pair.front,
        {**pair.front.label_dict, Label.PARTS: ",".join(parts)},
        pair.router_attachment,
        entrypoint=("python3",),
        published=((RENDERED_ROUTER_METRICS_PORT, group.router.metrics_port or None),),
        secrets_from=((API_KEY_ENV, key),) if key else (),
    )


def router_part(pair: DockerPair) -> ContainerRun:
    """vllm-router as the pair runs it, in its front's network namespace (listening on its
    loopback), a part of the group under its rendered name. The roles' API key reaches it as
    vllm-router reads it (ROUTER_API_KEY_ENV), through the Engine API."""
    deployment = pair.deployment
    assert pair.front is not None, "a fronted pair (docker_pair(fronted=True))"
    key = deployment.secrets.api_key
    return ContainerRun(
        deployment,
        pair.router_spec,
        {**pair.router_spec.label_dict, Label.GROUP: deployment.name},
        entrypoint=pair.router.argv[:1],
        secrets_from=((ROUTER_API_KEY_ENV, key),) if key else (),
        network_of=pair.front.name,
    )


# ---------------------------------------------------------------------------------------------
# the pair's network


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
        labels = {**pair.router_spec.label_dict, Label.GROUP: deployment.name}  # the group's plan
        refused = engine_api.create_network(client, name, labels, PAIR_SUBNET)
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


# ---------------------------------------------------------------------------------------------
# launch


class PartLaunch(Backend[Any], Protocol):
    """docker_launch.py's launch primitives for one part; `created`: this launch created its container."""

    created: bool


def launch_group(
    pair: DockerPair,
    options: LaunchOptions,
    client: Any,
    backend_for: Callable[[ContainerRun, LaunchOptions], PartLaunch],
) -> LaunchResult:
    """Prefill, then decode, each waited for (even detached: the router needs both answering),
    then the router, waited for on the group's router clock unless --timeout says otherwise. A
    part that fails once this launch created something stops every part of the group before the
    error goes on, naming the group and what was stopped."""
    deployment = pair.deployment
    roles, front, router = role_parts(pair), front_part(pair), router_part(pair)
    ensure_network(client, pair)
    role_options = dataclasses.replace(options, detach=False)
    # The front is started, not waited for: it answers /health once the router, started next in
    # its namespace, does; the router's wait (through the front's port) is the group's.
    front_options = dataclasses.replace(options, detach=True)
    router_options = options
    if options.timeout is None:
        router_options = dataclasses.replace(options, timeout=float(pair.group.router_timeline.start_s))
    launches: list[PartLaunch] = []
    try:
        for part, part_options in (
            *((role, role_options) for role in roles),
            (front, front_options),
            (router, router_options),
        ):
            launches.append(backend_for(part, part_options))
            result = converge(RUNTIME, launches[-1], part.deployment, part_options)
        return result  # the router's, through its front: the group's one endpoint
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
    for name in (deployment.name, pair.router_spec.name, *(role.name for role in group.roles)):
        container = engine_api.find_container(client, name)
        if container is None or not ours(container):
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


def dry_run_group(pair: DockerPair) -> DryRun:
    """The four `docker run` command lines and the pair's network. The router's front runs under
    the group's name, the router as NAME-router in the front's network namespace."""
    router = router_run_argv(pair, "detached")
    router_argv = [*router.options, *router.command]
    front = front_run_argv(pair, "detached")
    front_argv = [*front.options, *front.command]
    detail: dict[str, Any] = {
        "network": {"name": pair.network, "subnet": PAIR_SUBNET},
        **{
            role.key: ["docker", *docker_run_argv(role.spec, "detached", None, role.attachment)]
            for role in pair.roles
        },
        "front": ["docker", *front_argv],
        "router": ["docker", *router_argv],
    }
    return DryRun("container", ("docker", *front_argv), detail, argv_key="docker_run")
