"""A container of the engine image on the Docker Engine API, made from its ContainerSpec.

Launch's server (create_container) and the throwaway containers that doctor runs in the engine
image (trial_run for the plan's ulimits, run_in_engine for the deep checks, run_script for
run_engine_script) get the host's GPUs, devices, shared memory and ulimits from one translation
(_host_settings), so a check runs with exactly what launch will use. The SDK's types stay in
engine_api.py: everything here is plain dicts that its create_host_config turns into them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from m31ctl.container import ContainerSpec, container_spec
from m31ctl.deployment import Deployment
from m31ctl.docker_run import Attachment
from m31ctl.runtime import engine_api
from m31ctl.runtime.launching import LAUNCH_ENV
from m31ctl.runtime.protocol import ScriptRun, ScriptUnavailable


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


def create_container(
    client: Any,
    spec: ContainerSpec,
    environ: Mapping[str, str],
    labels: Mapping[str, str] | None = None,
    *,
    attachment: Attachment | None = None,
    entrypoint: Sequence[str] = (),
    published: Sequence[tuple[int, int | None]] = (),
    network_of: str | None = None,
) -> Any:
    """Create (not start) the container through the Engine API, labelled with `labels` (default:
    the spec's). Secret values come from our environment into the API request, never into any
    process's argv. `attachment`: on that network (at its fixed address, under its alias)
    instead of Docker's default bridge; `entrypoint`: instead of the image's; `published`: more
    ports, (container port, host port or None for one Docker picks), on the spec's bind;
    `network_of`: in that container's network namespace instead (no port of its own: the
    namespace's owner publishes them)."""
    env = dict(spec.env)
    env.update({name: environ[name] for name in spec.secret_env if environ.get(name)})
    # Set by launch for a checkpoint it pulled first: the engine must not ask the hub again.
    env.update({name: environ[name] for name in LAUNCH_ENV if environ.get(name)})
    ports: dict[int, tuple[str, int | None]] = {spec.container_port: (spec.bind, spec.host_port)}
    ports.update({inside: (spec.bind, outside) for inside, outside in published})
    if network_of is not None:
        ports = {}
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
    if network_of is not None:
        host["network_mode"] = f"container:{network_of}"
    elif attachment is not None:
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
