"""`docker run` argv for a ContainerSpec (script and systemd targets share it)."""

from __future__ import annotations

from typing import Literal

from m31ctl.container import ContainerSpec

Mode = Literal["detached", "foreground"]


def docker_run_argv(spec: ContainerSpec, mode: Mode, env_file: str | None = None) -> list[str]:
    """Everything after `docker`."""
    argv = ["run"]
    if mode == "detached":
        argv += ["--detach", "--restart", spec.restart]
    else:
        argv += ["--rm"]  # systemd restarts the unit; a leftover container would block the name
    argv += ["--name", spec.name]
    for key, value in spec.labels:
        argv += ["--label", f"{key}={value}"]
    if spec.device_request:
        # The CLI reads a device list as CSV, hence the inner quotes.
        gpus = f'"device={",".join(spec.gpu_device_ids)}"' if spec.gpu_device_ids else str(spec.gpu_count)
        argv += ["--gpus", gpus]
    for device in spec.devices:
        argv += ["--device", device]
    for group in spec.group_add:
        argv += ["--group-add", group]
    for cap in spec.cap_add:
        argv += ["--cap-add", cap]
    for opt in spec.security_opt:
        argv += ["--security-opt", opt]
    if spec.ipc_host:
        argv += ["--ipc", "host"]
    elif spec.shm_size:
        argv += ["--shm-size", spec.shm_size]
    for name, soft, hard in spec.ulimits:
        argv += ["--ulimit", f"{name}={soft}:{hard}"]
    argv += [
        "--log-driver",
        "json-file",
        "--log-opt",
        f"max-size={spec.log_max_size}",
        "--log-opt",
        f"max-file={spec.log_max_files}",
    ]
    argv += ["--stop-timeout", str(spec.stop_timeout)]
    argv += ["--publish", f"{spec.bind}:{spec.host_port}:{spec.container_port}"]
    for mount in spec.mounts:
        argv += ["--volume", f"{mount.source}:{mount.target}{':ro' if mount.read_only else ''}"]
    for key, value in spec.env:
        argv += ["--env", f"{key}={value}"]
    if env_file is not None:
        argv += ["--env-file", env_file]
    else:
        for name in spec.secret_env:
            argv += ["--env", name]  # by name: docker copies the value from its own environment
    argv.append(spec.image)
    argv += list(spec.args)
    return argv
