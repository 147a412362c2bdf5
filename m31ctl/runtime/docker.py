"""The `docker` runtime: the serving container's lifecycle on the Docker Engine.

Only containers labelled as ours are ever changed. Launch converges (runtime/converge.py): the
same plan on a healthy container changes nothing; a changed plan recreates it after
confirmation; an interrupted launch leaves a labelled container that the next launch adopts.
Every Engine call runs inside engine_api.engine_boundary, so SDK errors surface as documented
exit codes. A P/D plan runs as a group of three containers (runtime/docker_group.py) through the
same primitives.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from m31ctl import interrupt
from m31ctl.container import ContainerSpec, container_spec
from m31ctl.deployment import CONTAINER_PORT, Deployment
from m31ctl.docker_run import Attachment, docker_run_argv
from m31ctl.errors import ConflictError, HostPreconditionError, M31Error, ServerDied
from m31ctl.labels import OWNER, Label
from m31ctl.netaddr import local_url
from m31ctl.runtime import docker_group, engine_api
from m31ctl.runtime.converge import Decision, ExistingServer
from m31ctl.runtime.docker_group import ContainerRun
from m31ctl.runtime.exits import explain_exit
from m31ctl.runtime.flow import Found, converge
from m31ctl.runtime.gates import CheckId
from m31ctl.runtime.launching import LAUNCH_ENV
from m31ctl.runtime.load_run import BenchRunner, container_bench
from m31ctl.runtime.phases import Phase
from m31ctl.runtime.planrecord import PlanRecord
from m31ctl.runtime.protocol import (
    DryRun,
    LaunchOptions,
    LaunchResult,
    PullEvent,
    PullProgress,
    Reporter,
    ScriptRun,
    ScriptUnavailable,
    ServerStatus,
)
from m31ctl.runtime.readiness import ProcessState, health, models


def endpoint(spec: ContainerSpec) -> str:
    return local_url(spec.bind, spec.host_port)


# How long the trial container (/bin/true) may take to start and exit.
TRIAL_TIMEOUT_S = 60


def trial_run(client: Any, spec: ContainerSpec) -> str | None:
    """Start and remove a throwaway container of the engine image with the plan's ulimits and
    shared-memory settings (entrypoint /bin/true, no network, no GPUs): the engine's error, or
    None when it accepts them. An engine that cannot set an rlimit fails here, not at launch.
    The container is removed whatever happens once it is created (engine_api.throwaway)."""
    try:
        host = client.api.create_host_config(**_limits(spec), network_mode="none")
        with engine_api.throwaway(
            client, "trial", image=spec.image, entrypoint=["/bin/true"], command=[], host_config=host
        ) as container:
            container.start()
            code = int(container.wait(timeout=TRIAL_TIMEOUT_S).get("StatusCode", -1))
            if code != 0:
                said = container.logs(stdout=False, stderr=True).decode("utf-8", "replace").strip()
                return f"the trial container exited with code {code}" + (f": {said}" if said else "")
    except Exception as exc:
        return engine_api.explanation(exc)
    return None


def _limits(spec: ContainerSpec) -> dict[str, Any]:
    """The plan's ulimits and shared memory (a private /dev/shm of its size, or the host's IPC)."""
    # Plain dicts: create_host_config makes the SDK's Ulimit, DeviceRequest and LogConfig of them,
    # so the SDK stays in engine_api.py (tests/test_architecture.py).
    limits: dict[str, Any] = {"ulimits": [{"name": n, "soft": s, "hard": h} for n, s, h in spec.ulimits]}
    if spec.ipc_host:
        limits["ipc_mode"] = "host"
    elif spec.shm_size:
        limits["shm_size"] = spec.shm_size
    return limits


def _host_settings(spec: ContainerSpec) -> dict[str, Any]:
    """What the engine container gets from the host: GPUs, devices, groups, shared memory,
    ulimits, security options. Launch and doctor's deep checks share it, so the check runs with
    exactly what launch will use."""
    host = _limits(spec)
    if spec.device_request:
        request = (
            {"device_ids": list(spec.gpu_device_ids), "capabilities": [["gpu"]]}
            if spec.gpu_device_ids
            else {"count": spec.gpu_count, "capabilities": [["gpu"]]}
        )
        host["device_requests"] = [request]
    if spec.devices:
        host["devices"] = [f"{d}:{d}:rwm" for d in spec.devices]
        host["group_add"] = list(spec.group_add)
        host["cap_add"] = list(spec.cap_add)
    if spec.security_opt:
        host["security_opt"] = list(spec.security_opt)
    return host


def run_in_engine(
    client: Any, spec: ContainerSpec, argv: list[str], mounts: dict[str, str], timeout: float
) -> tuple[int | None, str, str]:
    """Run `argv` in the engine image with launch's host settings (no port, no network beyond
    loopback) and read-only `mounts` (host -> container). (exit code or None on timeout, stdout,
    stderr); the container is removed whatever happens once it is created (engine_api.throwaway)."""
    binds = {source: {"bind": target, "mode": "ro"} for source, target in mounts.items()}
    binds.update({m.source: {"bind": m.target, "mode": "ro" if m.read_only else "rw"} for m in spec.mounts})
    host = client.api.create_host_config(**_host_settings(spec), binds=binds, network_mode="none")
    with engine_api.throwaway(
        client,
        "probe",
        image=spec.image,
        entrypoint=argv[:1],
        command=argv[1:],
        environment=dict(spec.env),
        host_config=host,
    ) as container:
        container.start()
        try:
            code: int | None = int(container.wait(timeout=timeout).get("StatusCode", -1))
        except Exception:  # the wait timed out: a hung collective
            code = None
            with contextlib.suppress(Exception):  # it may have exited just now: nothing to kill
                container.kill()
        out = container.logs(stdout=True, stderr=False).decode("utf-8", "replace")
        err = container.logs(stdout=False, stderr=True).decode("utf-8", "replace")
        return code, out, err


def create_container(
    client: Any,
    spec: ContainerSpec,
    environ: Mapping[str, str],
    labels: Mapping[str, str] | None = None,
    *,
    attachment: Attachment | None = None,
    entrypoint: Sequence[str] = (),
    published: Sequence[tuple[int, int | None]] = (),
) -> Any:
    """Create (not start) the container through the Engine API, labelled with `labels` (default:
    the spec's). Secret values come from our environment into the API request, never into any
    process's argv. `attachment`: on that network (at its fixed address, under its alias)
    instead of Docker's default bridge; `entrypoint`: instead of the image's; `published`: more
    ports, (container port, host port or None for one Docker picks), on the spec's bind."""
    env = dict(spec.env)
    env.update({name: environ[name] for name in spec.secret_env if environ.get(name)})
    # Set by launch for a checkpoint it pulled first: the engine must not ask the hub again.
    env.update({name: environ[name] for name in LAUNCH_ENV if environ.get(name)})
    ports: dict[int, tuple[str, int | None]] = {spec.container_port: (spec.bind, spec.host_port)}
    ports.update({inside: (spec.bind, outside) for inside, outside in published})
    host: dict[str, Any] = {
        **_host_settings(spec),
        "port_bindings": ports,
        "binds": {m.source: {"bind": m.target, "mode": "ro" if m.read_only else "rw"} for m in spec.mounts},
        "log_config": {
            "type": "json-file",
            "config": {"max-size": spec.log_max_size, "max-file": str(spec.log_max_files)},
        },
        "restart_policy": {"Name": spec.restart},
    }
    create: dict[str, Any] = {}
    if attachment is not None:
        host["network_mode"] = attachment.network
        endpoint = client.api.create_endpoint_config(
            aliases=[attachment.alias], ipv4_address=attachment.address
        )
        create["networking_config"] = client.api.create_networking_config({attachment.network: endpoint})
    if entrypoint:
        create["entrypoint"] = list(entrypoint)
    created = client.api.create_container(
        image=spec.image,
        command=list(spec.args),
        name=spec.name,
        labels=dict(labels) if labels is not None else spec.label_dict,
        environment=env,
        ports=list(ports),
        host_config=client.api.create_host_config(**host),
        stop_signal="SIGTERM",
        stop_timeout=spec.stop_timeout,
        **create,
    )
    return client.containers.get(created["Id"])


def _ours(container: Any) -> bool:
    return bool((container.labels or {}).get(Label.OWNER) == OWNER)


class ContainerHandle:
    """A container as readiness sees it. A container removed under us is a dead server."""

    kind = "container"

    def __init__(self, container: Any) -> None:
        self.container = container
        self.name = str(container.name)
        self._restarts = int(container.attrs.get("RestartCount", 0) or 0)

    def state(self) -> ProcessState:
        try:
            self.container.reload()
        except Exception as exc:
            if engine_api.is_not_found(exc):
                return ProcessState(running=False, dead=True, vanished=True)
            raise
        state = self.container.attrs.get("State") or {}
        status = state.get("Status")
        restarted = (
            int(self.container.attrs.get("RestartCount", 0) or 0) > self._restarts or status == "restarting"
        )
        dead = status in ("exited", "dead", "removing") or bool(state.get("OOMKilled")) or restarted
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


def _existing(
    container: Any | None, spec: ContainerSpec, api_key: str | None, served: str
) -> ExistingServer | None:
    if container is None:
        return None
    labels = container.labels or {}
    running = container.status == "running"
    return ExistingServer(
        owned=_ours(container),
        plan_hash=labels.get(Label.PLAN_HASH),
        state=str(container.status),
        serving=running and served in (models(endpoint(spec), api_key) or []),
    )


class _ContainerLaunch:
    """The docker runtime's launch primitives for one container, `part` (runtime/flow.py runs
    the flow): an aggregated server, or a part of a P/D group (runtime/docker_group.py)."""

    def __init__(self, part: ContainerRun, options: LaunchOptions, client: Any) -> None:
        self.part = part
        self.spec = part.spec
        self.options = options
        self.client = client
        self.served = part.deployment.plan.settings.model.served_name
        self.created = False  # whether this launch created its container

    def claim(self) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()  # the engine's create-by-name is atomic: the loser joins

    def find(self, api_key: str | None) -> Found[Any] | None:
        container = engine_api.find_container(self.client, self.spec.name)
        existing = _existing(container, self.spec, api_key, self.served)
        return None if existing is None else Found(existing, container)

    def resume(self, container: Any) -> None:
        if container.status == "created":
            container.start()  # a second start of a started container is a no-op (304)

    def remove(self, container: Any) -> None:
        engine_api.remove_if_present(container)

    def prepare(self) -> None:
        if engine_api.local_image(self.client, self.spec.image) is None:
            self.options.on_phase(Phase.PULLING, 0.0)
        _ensure_image(self.client, self.spec.image, self.options.report, self.options.pull_progress)

    def create(self) -> Any:
        container = _create_and_start(self.client, self.part, self.options.environ)
        self.created = True
        return container

    def handle(self, container: Any) -> ContainerHandle:
        return ContainerHandle(container)

    def endpoint(self, container: Any) -> str:
        return endpoint(self.spec)

    def died(self, container: Any, error: ServerDied) -> ServerDied:
        # Leave a server that died while loading stopped, with its logs: under a restart policy
        # it would load (and die) again and again, each time re-reading the checkpoint.
        engine_api.stop_for_good(container)
        retry = (
            f"it is stopped, with its logs (m31ctl logs --name {self.spec.name}); m31ctl launch replaces it"
        )
        return ServerDied(
            error.message, hint=f"{error.hint}; {retry}" if error.hint else retry, details=error.details
        )

    def describe(self, container: Any) -> str:
        return self.spec.name

    def started(self, container: Any) -> str:
        return f"started {self.spec.name} ({container.short_id}) from {self.spec.image}"


class DockerRuntime:
    name = "docker"
    gates = (
        CheckId.DOCKER,
        CheckId.GPU_RUNTIME,
        CheckId.GPUS,
        CheckId.GPU_MEMORY,
        CheckId.MIG,
        CheckId.DISK,
        CheckId.SHM,
        CheckId.CAPACITY,
        CheckId.API_KEY,
    )

    # A P/D plan runs as one group: prefill, decode and vllm-router (runtime/docker_group.py).
    runs_groups = True

    def dry_run(self, deployment: Deployment) -> DryRun:
        if deployment.disaggregated is not None:
            return docker_group.dry_run_group(deployment)
        spec = container_spec(deployment)
        return DryRun(
            "container",
            ("docker", *docker_run_argv(spec, "detached")),
            {"container": spec.to_data()},
            argv_key="docker_run",
        )

    def launch(self, deployment: Deployment, options: LaunchOptions) -> LaunchResult:
        with engine_api.engine_boundary("launching"):
            client = engine_api.connect()
            if deployment.disaggregated is not None:
                return docker_group.launch_group(
                    deployment, options, client, lambda part, o: _ContainerLaunch(part, o, client)
                )
            backend = _ContainerLaunch(docker_group.single(deployment, os.getcwd()), options, client)
            return converge(self.name, backend, deployment, options)

    def servers(self) -> list[ServerStatus]:
        with engine_api.engine_boundary("listing containers"):
            client = engine_api.connect()
            return docker_group.statuses(_our_containers(client), _status)

    def foreign(self, name: str) -> bool:
        with engine_api.engine_boundary("looking up a container"):
            container = engine_api.find_container(engine_api.connect(), name)
            return container is not None and not _ours(container)

    def logs(self, name: str, follow: bool, tail: int, write: Callable[[str], None]) -> None:
        with engine_api.engine_boundary("reading logs"):
            client = engine_api.connect()
            container = _ours_named(client, name)
            if docker_group.parts_of(container):
                docker_group.write_logs(client, container, follow, tail, write)
                return
            stream = container.logs(stream=follow, follow=follow, tail=tail)
            for chunk in stream if follow else [stream]:
                write(chunk.decode("utf-8", "replace"))

    def stop(self, name: str, timeout: int | None, keep: bool, report: Reporter) -> None:
        with engine_api.engine_boundary("stopping a container"):
            client = engine_api.connect()
            container = _ours_named(client, name)
            if docker_group.parts_of(container):
                docker_group.stop_group(client, container, timeout, keep, report)
                return
            docker_group.stop_container(container, timeout, keep, report)
            group = docker_group.group_of(container)
            if group is not None and not keep:
                docker_group.remove_network(client, group)  # the last of a group whose router is gone

    def bench_runner(self, deployment: Deployment, shared: Sequence[str] = ()) -> BenchRunner:
        spec = container_spec(deployment)
        mounts = [(m.source, m.target) for m in spec.mounts] + [(path, path) for path in shared]
        return container_bench(spec.image, mounts)

    def run_engine_script(
        self,
        deployment: Deployment,
        script: Path,
        args: Sequence[str],
        timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> ScriptRun:
        return run_script(deployment, script, args, timeout, env)

    def engine_identity(self, deployment: Deployment) -> str | None:
        """The engine image's ID: a tag moved to another build is another engine."""
        image = container_spec(deployment).image
        try:
            with engine_api.engine_boundary(f"reading the ID of {image}"):
                found = engine_api.local_image(engine_api.connect(), image)
        except M31Error:
            return None  # the preflight's own Docker checks say why
        return f"{image} {found.id}" if found is not None else None


def _our_containers(client: Any) -> list[Any]:
    return list(client.containers.list(all=True, filters={"label": f"{Label.OWNER}={OWNER}"}))


def _ours_named(client: Any, name: str) -> Any:
    container = engine_api.find_container(client, name)
    if container is None:
        raise HostPreconditionError(f"no m31ctl container named {name}", hint="see `m31ctl status`")
    if not _ours(container):
        raise ConflictError(f"{name} was not created by m31ctl; not touching it")
    return container


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


def _status(container: Any) -> ServerStatus:
    labels = container.labels or {}
    base = _published(container)
    running = container.status == "running"
    return ServerStatus(
        name=str(container.name),
        runtime="docker",
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
    )


def _create_and_start(client: Any, part: ContainerRun, environ: Mapping[str, str]) -> Any:
    """Create then start. A name taken meanwhile is a ConflictError (the caller may join the
    winner); a container of ours that fails to start is removed by its id, never by name, so a
    concurrent launch's container is never touched."""
    spec = part.spec
    try:
        container = create_container(
            client,
            spec,
            part.environ(environ),
            part.labels,
            attachment=part.attachment,
            entrypoint=part.entrypoint,
            published=part.published,
        )
    except Exception as exc:
        if engine_api.is_conflict(exc):
            raise ConflictError(
                f"a container named {spec.name} was created meanwhile", hint="pass --name to use another name"
            ) from None
        raise _start_error(exc, spec) from None
    try:
        container.start()
    except Exception as exc:
        engine_api.remove_if_present(container)  # ours, by id: it never started, no state to keep
        raise _start_error(exc, spec) from None
    return container


def _start_error(exc: Exception, spec: ContainerSpec) -> Exception:
    text = engine_api.api_error_text(exc)
    if text is None:
        return exc
    d = explain_exit(text, None, False)
    return HostPreconditionError(
        f"Docker could not start {spec.name}: {d.summary} ({text[:200]})", hint=d.remedy
    )


def _ensure_image(client: Any, image: str, report: Reporter, progress: PullProgress) -> None:
    if engine_api.local_image(client, image) is not None:
        return
    report(f"pulling {image}")
    repository, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "latest")
    try:
        for event in client.api.pull(repository, tag=tag or "latest", stream=True, decode=True):
            interrupt.check()  # Ctrl-C stops the pull between its progress events
            if "error" in event:
                raise _pull_error(image, str(event["error"]))
            detail = event.get("progressDetail") or {}
            if event.get("id") and detail.get("total"):
                progress(PullEvent(str(event["id"]), int(detail.get("current", 0)), int(detail["total"])))
    except M31Error:
        raise
    except Exception as exc:
        text = engine_api.api_error_text(exc)
        if text is None:
            raise
        raise _pull_error(image, text) from None
    finally:
        progress(None)


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


# Where a script's folder is mounted (read-only) in the engine image.
SCRIPTS_IN_CONTAINER = "/m31ctl"
# The least time one Engine API call around a script (create, start, logs, remove) may take.
DOCKER_CALL_TIMEOUT_S = 120.0


def run_script(
    deployment: Deployment,
    script: Path,
    args: Sequence[str],
    timeout: float,
    env: Mapping[str, str] | None = None,
) -> ScriptRun:
    """`python3 SCRIPT` in the engine image with launch's container settings (run_in_engine) and
    the server's environment plus `env`; the script's folder is mounted read-only."""
    spec = container_spec(deployment)
    spec = spec._replace(env=tuple(sorted({**dict(spec.env), **dict(env or {})}.items())))
    argv = ["python3", f"{SCRIPTS_IN_CONTAINER}/{script.name}", *args]
    with engine_api.engine_boundary(f"running {script.name} in the engine image"):
        # Each Engine API call may take as long as the script itself may: a busy daemon on a
        # fresh machine takes seconds to create, start or remove a container of a multi-GB
        # image, and a short client timeout read that as an unreachable engine (the deep
        # checks skipped). An engine that is not there still fails at once (no socket, refused).
        client = engine_api.connect(timeout=max(timeout, DOCKER_CALL_TIMEOUT_S))
        if engine_api.local_image(client, spec.image) is None:
            raise ScriptUnavailable(
                f"{spec.image} is not here to run {script.name} in",
                hint="pull it (launch does), or use --runtime native",
            )
        started = time.monotonic()
        try:
            code, out, err = run_in_engine(
                client, spec, argv, {str(script.parent): SCRIPTS_IN_CONTAINER}, timeout
            )
        except Exception as exc:
            text = engine_api.explanation(exc)
            if "executable file not found" in text or "no such file or directory" in text.lower():
                # Every vLLM image has python3; an image without it is not an engine.
                raise ScriptUnavailable(
                    f"{spec.image} has no python3 to run {script.name} with",
                    hint="engine.image must be a vLLM image",
                ) from None
            raise
    return ScriptRun(code, out, err, time.monotonic() - started, "in the engine image")


__all__ = ["Decision", "DockerRuntime", "create_container", "run_script"]
