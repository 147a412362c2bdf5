"""`m31ctl launch`, `status`, `logs`, `stop`: the serving container's lifecycle on the Docker Engine.

Only containers labelled as ours are ever changed. Launch is convergent: the same plan on a
healthy container changes nothing; a changed plan recreates it (after confirmation); an
interrupted launch leaves a labelled container that the next launch adopts or replaces.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from m31ctl.container import ContainerSpec, container_spec, local_url
from m31ctl.diagnosis import diagnose
from m31ctl.dockerapi import OWNER, OWNER_LABEL, connect
from m31ctl.errors import ConflictError, HostPreconditionError, M31Error
from m31ctl.plan import Plan, require_fit
from m31ctl.readiness import ProcessState, Reporter, models, wait_ready
from m31ctl.readiness import health as readiness_health

HASH_LABEL = "io.m31ctl.plan-hash"


@dataclass
class LaunchResult:
    action: str  # created | recreated | unchanged | adopted | dry-run | started
    container: str
    endpoint: str
    plan_hash: str
    ready: bool
    timings: dict[str, float] = field(default_factory=dict)
    phases: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "action": self.action,
            "container": self.container,
            "endpoint": self.endpoint,
            "plan_hash": self.plan_hash,
            "ready": self.ready,
            "phases": self.phases,
            "timings_s": {k: round(v, 3) for k, v in self.timings.items()},
        }


def endpoint(spec: ContainerSpec) -> str:
    return local_url(spec.bind, spec.host_port)


def create_container(client: Any, spec: ContainerSpec, environ: dict[str, str]) -> Any:
    """Create (not start) the container through the Engine API. Secret values come from our
    environment into the API request, never into any process's argv."""
    from docker.types import DeviceRequest, LogConfig, Ulimit

    env = dict(spec.env)
    env.update({name: environ[name] for name in spec.secret_env if environ.get(name)})
    host: dict[str, Any] = {
        "port_bindings": {spec.container_port: (spec.bind, spec.host_port)},
        "binds": {m.source: {"bind": m.target, "mode": "ro" if m.read_only else "rw"} for m in spec.mounts},
        "ulimits": [Ulimit(name=n, soft=s, hard=h) for n, s, h in spec.ulimits],
        "log_config": LogConfig(
            type="json-file", config={"max-size": spec.log_max_size, "max-file": str(spec.log_max_files)}
        ),
        "restart_policy": {"Name": spec.restart},
    }
    if spec.ipc_host:
        host["ipc_mode"] = "host"
    elif spec.shm_size:
        host["shm_size"] = spec.shm_size
    if spec.vendor == "nvidia":
        request = (
            DeviceRequest(device_ids=list(spec.gpu_device_ids), capabilities=[["gpu"]])
            if spec.gpu_device_ids
            else DeviceRequest(count=spec.gpu_count, capabilities=[["gpu"]])
        )
        host["device_requests"] = [request]
    if spec.devices:
        host["devices"] = [f"{d}:{d}:rwm" for d in spec.devices]
        host["group_add"] = list(spec.group_add)
        host["cap_add"] = list(spec.cap_add)
    if spec.security_opt:
        host["security_opt"] = list(spec.security_opt)
    created = client.api.create_container(
        image=spec.image,
        command=list(spec.args),
        name=spec.name,
        labels=spec.label_dict,
        environment=env,
        ports=[spec.container_port],
        host_config=client.api.create_host_config(**host),
        stop_signal="SIGTERM",
        stop_timeout=spec.stop_timeout,
    )
    return client.containers.get(created["Id"])


def _find(client: Any, name: str) -> Any | None:
    from docker.errors import NotFound

    try:
        return client.containers.get(name)
    except NotFound:
        return None


def _ours(container: Any) -> bool:
    return bool(container.labels.get(OWNER_LABEL) == OWNER)


def api_key_for(plan: Plan, environ: dict[str, str]) -> str | None:
    """The key the server will demand (read from the environment, never stored), or None."""
    if not plan.settings.runtime.api_key:
        return None
    key = environ.get("VLLM_API_KEY")
    if not key:
        raise HostPreconditionError(
            "runtime.api_key is set but VLLM_API_KEY is not in the environment",
            hint="export VLLM_API_KEY before launching",
        )
    return key


def ensure_port_free(bind: str, port: int) -> None:
    if not port_free(bind, port):
        raise ConflictError(f"port {bind}:{port} is in use", hint="pass --port, or stop what listens there")


def port_free(bind: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind, port))
        except OSError:
            return False
    return True


class ContainerHandle:
    """A container as readiness sees it."""

    kind = "container"

    def __init__(self, container: Any) -> None:
        self.container = container
        self.name = str(container.name)
        self._restarts = int(container.attrs.get("RestartCount", 0))

    def state(self) -> ProcessState:
        self.container.reload()
        state = self.container.attrs["State"]
        status = state.get("Status")
        restarted = (
            int(self.container.attrs.get("RestartCount", 0)) > self._restarts or status == "restarting"
        )
        dead = status in ("exited", "dead") or bool(state.get("OOMKilled")) or restarted
        return ProcessState(
            running=status == "running",
            dead=dead,
            exit_code=state.get("ExitCode"),
            oom_killed=bool(state.get("OOMKilled")),
            restarted=restarted,
        )

    def log_tail(self, lines: int) -> str:
        try:
            return str(self.container.logs(tail=lines).decode("utf-8", "replace"))
        except Exception:
            return ""


def launch(
    plan: Plan,
    *,
    timeout: float | None,
    detach: bool,
    yes: bool,
    confirm: Callable[[str], bool],
    report: Reporter,
    environ: dict[str, str] | None = None,
) -> LaunchResult:
    environ = dict(os.environ if environ is None else environ)
    require_fit(plan)
    spec = container_spec(plan)
    api_key = api_key_for(plan, environ)
    for mount in spec.mounts:
        if mount.read_only and not os.path.exists(mount.source):
            raise HostPreconditionError(
                f"the model path {mount.source} does not exist",
                hint="create it (scripts/make-tiny-model for the CPU rehearsal) or --set model.path",
            )
    from m31ctl.doctor import preflight

    for result in preflight(plan):
        if result.status == "warn":
            report(f"warning: {result.title}: {result.message}")
    client = connect()
    timeout = float(timeout if timeout is not None else spec.startup_timeout)
    existing = _find(client, spec.name)
    action = "created"
    if existing is not None:
        if not _ours(existing):
            raise ConflictError(
                f"a container named {spec.name} exists and was not created by m31ctl",
                hint="m31ctl never touches it: pass --name to use another name",
            )
        same = existing.labels.get(HASH_LABEL) == plan.hash
        if same and existing.status in ("running", "created", "restarting"):
            if existing.status == "running" and plan.settings.model.served_name in (
                models(endpoint(spec), api_key) or []
            ):
                return LaunchResult("unchanged", spec.name, endpoint(spec), plan.hash, True)
            report(f"{spec.name} runs this plan already; waiting for it")
            if existing.status == "created":
                existing.start()
            timings, phases = (
                ({}, [])
                if detach
                else wait_ready(
                    ContainerHandle(existing),
                    endpoint(spec),
                    plan.settings.model.served_name,
                    timeout,
                    report,
                    api_key,
                )
            )
            return LaunchResult("adopted", spec.name, endpoint(spec), plan.hash, not detach, timings, phases)
        if not same:
            old = existing.labels.get(HASH_LABEL, "?")
            question = f"{spec.name} runs plan {old}; replace it with plan {plan.hash}?"
            if not (yes or confirm(question)):
                raise ConflictError(
                    f"{spec.name} runs another plan ({old}); not replaced",
                    hint="pass --yes to recreate it with this plan",
                )
        report(f"removing {spec.name} ({existing.status}, plan {existing.labels.get(HASH_LABEL)})")
        existing.remove(force=True)
        action = "recreated"
    ensure_port_free(spec.bind, spec.host_port)
    _ensure_image(client, spec.image, report)
    started = time.monotonic()
    container = _create_and_start(client, spec, environ)
    report(f"started {spec.name} ({container.short_id}) from {spec.image}")
    if detach:
        return LaunchResult(action, spec.name, endpoint(spec), plan.hash, False)
    timings, phases = wait_ready(
        ContainerHandle(container), endpoint(spec), plan.settings.model.served_name, timeout, report, api_key
    )
    timings["total_since_create"] = time.monotonic() - started
    return LaunchResult(action, spec.name, endpoint(spec), plan.hash, True, timings, phases)


def _create_and_start(client: Any, spec: ContainerSpec, environ: dict[str, str]) -> Any:
    from docker.errors import APIError

    try:
        container = create_container(client, spec, environ)
        container.start()
        return container
    except APIError as exc:
        text = str(exc.explanation or exc)
        d = diagnose(text, None, False)
        leftover = _find(client, spec.name)
        if leftover is not None and leftover.status == "created":
            leftover.remove(force=True)  # a container that never started is no state to keep
        raise HostPreconditionError(
            f"Docker could not start {spec.name}: {d.cause} ({text[:200]})", hint=d.remedy
        ) from None


def _ensure_image(client: Any, image: str, report: Reporter) -> None:
    from docker.errors import APIError, ImageNotFound

    try:
        client.images.get(image)
        return
    except ImageNotFound:
        pass
    report(f"pulling {image}")
    repository, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "latest")
    try:
        _pull_with_progress(client, repository, tag or "latest")
    except APIError as exc:
        raise _pull_error(image, str(exc.explanation or exc)) from None


def _pull_with_progress(client: Any, repository: str, tag: str) -> None:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    tasks: dict[str, Any] = {}
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        transient=True,
        console=_stderr_console(),
    ) as progress:
        for event in client.api.pull(repository, tag=tag, stream=True, decode=True):
            if "error" in event:
                from docker.errors import APIError

                raise APIError(event["error"])
            layer = event.get("id")
            detail = event.get("progressDetail") or {}
            if layer and detail.get("total"):
                if layer not in tasks:
                    tasks[layer] = progress.add_task(f"layer {layer}", total=detail["total"])
                progress.update(tasks[layer], completed=detail.get("current", 0))


def _stderr_console() -> Any:
    from m31ctl.output import console

    return console(stderr=True)


def _pull_error(image: str, text: str) -> M31Error:
    lowered = text.lower()
    if "not found" in lowered or "manifest unknown" in lowered or "does not exist" in lowered:
        return HostPreconditionError(
            f"image {image} not found in its registry",
            hint="check engine.image; day-zero images are vllm/vllm-openai:minimax-m31-flash "
            "and vllm/vllm-openai-rocm:minimax-m31-flash",
        )
    if "denied" in lowered or "unauthorized" in lowered:
        return HostPreconditionError(f"pulling {image} was denied", hint="docker login to the registry first")
    if "toomanyrequests" in lowered or "rate limit" in lowered:
        return HostPreconditionError(
            f"the registry rate-limited the pull of {image}", hint="docker login, or wait and retry"
        )
    return HostPreconditionError(
        f"cannot pull {image}: no route to its registry ({text[:160]})",
        hint="check the network or proxy, or `docker load` the image",
    )


def our_containers(client: Any) -> list[Any]:
    return list(client.containers.list(all=True, filters={"label": f"{OWNER_LABEL}={OWNER}"}))


def status(client: Any) -> list[dict[str, Any]]:
    rows = []
    for c in our_containers(client):
        ports = c.attrs.get("HostConfig", {}).get("PortBindings") or {}
        binding: dict[str, Any] = next(iter(ports.values()), [{}])[0] if ports else {}
        base = local_url(binding.get("HostIp") or "127.0.0.1", int(binding["HostPort"])) if binding else None
        health = readiness_health(base, timeout=1.0) if base and c.status == "running" else None
        rows.append(
            {
                "name": c.name,
                "state": c.status,
                "plan_hash": c.labels.get(HASH_LABEL),
                "recipe": c.labels.get("io.m31ctl.recipe"),
                "variant": c.labels.get("io.m31ctl.variant"),
                "profile": c.labels.get("io.m31ctl.profile"),
                "image": c.attrs.get("Config", {}).get("Image"),
                "endpoint": base,
                "health": health,
                "started_at": c.attrs.get("State", {}).get("StartedAt"),
                "restart_count": c.attrs.get("RestartCount", 0),
            }
        )
    return rows


def select(client: Any, name: str | None) -> list[Any]:
    containers = our_containers(client)
    if name is None:
        return containers
    chosen = [c for c in containers if c.name == name]
    if not chosen:
        other = _find(client, name)
        if other is not None:
            raise ConflictError(f"{name} was not created by m31ctl; not touching it")
        raise HostPreconditionError(f"no m31ctl container named {name}", hint="see `m31ctl status`")
    return chosen


def logs(client: Any, name: str | None, follow: bool, tail: int) -> None:
    for container in select(client, name):
        stream = container.logs(stream=follow, follow=follow, tail=tail)
        for chunk in stream if follow else [stream]:
            sys.stdout.write(chunk.decode("utf-8", "replace"))
            sys.stdout.flush()


def stop(client: Any, name: str | None, timeout: int | None, keep: bool, report: Reporter) -> list[str]:
    stopped = []
    for c in select(client, name):
        grace = timeout if timeout is not None else int(c.attrs.get("Config", {}).get("StopTimeout") or 60)
        report(f"stopping {c.name} (SIGTERM, then SIGKILL after {grace} s)")
        c.stop(timeout=grace)
        if not keep:
            c.remove()
        stopped.append(c.name)
    return stopped
