"""`docker run` argv for a ContainerSpec: the script and systemd targets run it, and launch's dry
run shows it for the containers it creates through the Engine API."""

from __future__ import annotations

import csv
import io
import ipaddress
from typing import Literal, NamedTuple

from m31ctl.container import ContainerSpec, Mount

Mode = Literal["detached", "foreground"]


class Attachment(NamedTuple):
    """A container on a user-defined Docker network (a P/D pair's): its fixed address, if any
    (ZMQ binds the address a role advertises for NIXL's side channel), and the name its peers
    resolve it by (Docker's embedded DNS answers a network alias, as Compose's service name)."""

    network: str
    address: str | None
    alias: str


def network_args(attachment: Attachment) -> list[str]:
    argv = ["--network", attachment.network]
    if attachment.address is not None:
        argv += ["--ip", attachment.address]
    return [*argv, "--network-alias", attachment.alias]


def lifecycle_args(mode: Mode, restart: str) -> list[str]:
    """Detached: Docker restarts it (the script); foreground: its service manager does (systemd),
    and a leftover container would block the name."""
    return ["--detach", "--restart", restart] if mode == "detached" else ["--rm"]


def log_args(max_size: str, max_files: int) -> list[str]:
    return [
        "--log-driver",
        "json-file",
        "--log-opt",
        f"max-size={max_size}",
        "--log-opt",
        f"max-file={max_files}",
    ]


def publish_spec(spec: ContainerSpec) -> str:
    """`--publish` and Compose's short port syntax: IP:HOST:CONTAINER, an IPv6 address in
    brackets (both strip them; without them the address's colons run into the ports)."""
    return publish_address(spec.bind, spec.host_port, spec.container_port)


def publish_address(bind: str, host_port: int, container_port: int) -> str:
    """publish_spec for any port of a container (the P/D router's API and metrics ports)."""
    host = f"[{bind}]" if ipaddress.ip_address(bind).version == 6 else bind
    return f"{host}:{host_port}:{container_port}"


def mount_spec(mount: Mount) -> str:
    """`--mount` for a bind mount. `-v SRC:DST[:ro]` splits on every colon, so a path holding one
    breaks it; --mount is one CSV record of key=value fields (the Docker CLI reads it with Go's
    encoding/csv), so a field with a comma, a quote or a line break is quoted, quotes doubled."""
    fields = ["type=bind", f"source={mount.source}", f"target={mount.target}"]
    if mount.read_only:
        fields.append("readonly")
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerow(fields)
    return out.getvalue()[: -len("\n")]


def docker_run_argv(
    spec: ContainerSpec, mode: Mode, env_file: str | None = None, attachment: Attachment | None = None
) -> list[str]:
    """Everything after `docker`; `attachment`: on a user-defined network instead of the default bridge."""
    argv = ["run", *lifecycle_args(mode, spec.restart), "--name", spec.name]
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
    argv += log_args(spec.log_max_size, spec.log_max_files)
    argv += ["--stop-timeout", str(spec.stop_timeout)]
    if attachment is not None:
        argv += network_args(attachment)
    argv += ["--publish", publish_spec(spec)]
    for mount in spec.mounts:
        argv += ["--mount", mount_spec(mount)]
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
