"""The servers that stand on the Docker Engine, as `status`, `logs` and `stop` read and end them.

Only containers labelled as ours are ever listed, read or changed, and the labels say the rest:
a P/D group's endpoint (under the group's name: the router's front, issue 49) lists its parts'
containers (Label.PARTS: the router, then the roles), each part and the pair's network carry the
group's name (Label.GROUP), as the native records' `parts` and `group` do. So `status` shows the
group and then each part (a part not running: `degraded: PART down`), `logs` prints every part's,
and `stop` stops the endpoint first (no new requests reach the roles), then its parts in order,
and removes every part and the network.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from m31ctl.deployment import CONTAINER_PORT
from m31ctl.errors import ConflictError, HostPreconditionError
from m31ctl.labels import OWNER, Label
from m31ctl.netaddr import local_url
from m31ctl.runtime import engine_api
from m31ctl.runtime.planrecord import PlanRecord
from m31ctl.runtime.protocol import Reporter, ServerStatus
from m31ctl.runtime.readiness import health

RUNTIME = "docker"
# What `docker stop` waits for when the container does not say (vLLM's drain + margin).
DEFAULT_STOP_TIMEOUT_S = 60


# ---------------------------------------------------------------------------------------------
# what a container's labels say


def ours(container: Any) -> bool:
    return bool((container.labels or {}).get(Label.OWNER) == OWNER)


def parts_of(container: Any) -> tuple[str, ...]:
    """The role containers a group's router lists (empty for any other container)."""
    return tuple(p for p in (container.labels or {}).get(Label.PARTS, "").split(",") if p)


def group_of(container: Any) -> str | None:
    """The group a role container belongs to."""
    return (container.labels or {}).get(Label.GROUP) or None


def ours_named(client: Any, name: str) -> Any:
    container = engine_api.find_container(client, name)
    if container is None:
        raise HostPreconditionError(f"no m31ctl container named {name}", hint="see `m31ctl status`")
    if not ours(container):
        raise ConflictError(f"{name} was not created by m31ctl; not touching it")
    return container


def _part(client: Any, router: Any, name: str) -> Any | None:
    """The router's part `name`, if it is ours and of this group (anything else is not touched)."""
    container = engine_api.find_container(client, name)
    if container is None or not ours(container) or group_of(container) != router.name:
        return None
    return container


# ---------------------------------------------------------------------------------------------
# status


def servers(client: Any) -> list[ServerStatus]:
    """Every container of ours, a group's parts under their group."""
    ours_all = list(client.containers.list(all=True, filters={"label": f"{Label.OWNER}={OWNER}"}))
    return statuses(ours_all, status_row)


def _published(container: Any) -> str | None:
    """Where the container's API port is reached. Labels and bindings are anyone's to set, so
    an odd binding (an ephemeral or missing host port) gives no endpoint rather than a crash."""
    ports = (container.attrs.get("HostConfig") or {}).get("PortBindings") or {}
    api = f"{CONTAINER_PORT}/tcp"  # the API's port first: a P/D router publishes its metrics too
    for bindings in [ports[api]] if api in ports else list(ports.values()):
        for binding in bindings or []:
            port = str((binding or {}).get("HostPort") or "")
            if port.isdigit():
                return local_url(binding.get("HostIp") or "127.0.0.1", int(port))
    return None


def status_row(container: Any) -> ServerStatus:
    """One container as status shows it, from its labels, its port binding and its health."""
    labels = container.labels or {}
    base = _published(container)
    running = container.status == "running"
    return ServerStatus(
        name=str(container.name),
        runtime=RUNTIME,
        state=str(container.status),
        plan_hash=labels.get(Label.PLAN_HASH),
        recipe=labels.get(Label.RECIPE),
        variant=labels.get(Label.VARIANT),
        profile=labels.get(Label.PROFILE),
        endpoint=base,
        health=health(base, timeout=1.0) if base and running else None,
        image=(container.attrs.get("Config") or {}).get("Image"),
        started_at=(container.attrs.get("State") or {}).get("StartedAt"),
        restart_count=int(container.attrs.get("RestartCount", 0) or 0),
        plan=PlanRecord.parse(labels.get(Label.PLAN)),
        gpus=device_ids(container),
    )


def device_ids(container: Any) -> tuple[str, ...]:
    """The GPUs its device requests name (UUIDs or indices); () for a request by count. Anyone
    can create a container with our labels, so an odd shape names nothing rather than crash."""
    requests = (container.attrs.get("HostConfig") or {}).get("DeviceRequests") or []
    ids = [
        i for r in requests if isinstance(r, dict) for i in (r.get("DeviceIDs") or []) if isinstance(i, str)
    ]
    return tuple(ids)


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


# ---------------------------------------------------------------------------------------------
# logs


def write_logs(client: Any, name: str, follow: bool, tail: int, write: Callable[[str], None]) -> None:
    """The container's last lines (followed with --follow); a group's, each part's under a header
    naming it, roles first, the router last."""
    container = ours_named(client, name)
    for part_name in parts_of(container):
        part = _part(client, container, part_name)
        if part is None:
            write(f"==> {part_name}: no container <==\n")
            continue
        write(f"==> {part_name} (container {part.short_id}) <==\n")
        write(part.logs(tail=tail).decode("utf-8", "replace"))
    if parts_of(container):
        write(f"==> {container.name} (container {container.short_id}) <==\n")
    stream = container.logs(stream=follow, follow=follow, tail=tail)
    for chunk in stream if follow else [stream]:
        write(chunk.decode("utf-8", "replace"))


# ---------------------------------------------------------------------------------------------
# stop


def stop(client: Any, name: str, timeout: int | None, keep: bool, report: Reporter) -> None:
    """Stop the server `name`: a group's router stops its group; the last part of a group whose
    router is gone takes the pair's network with it (unless `keep`)."""
    container = ours_named(client, name)
    if parts_of(container):
        stop_group(client, container, timeout, keep, report)
        return
    stop_container(container, timeout, keep, report)
    group = group_of(container)
    if group is not None and not keep:
        remove_network(client, group)


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
