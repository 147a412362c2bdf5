"""The container to run, derived from the plan once and shared by every renderer and launcher."""

from __future__ import annotations

import grp
from collections.abc import Iterable
from typing import Any, NamedTuple

from m31ctl import __version__
from m31ctl.deployment import HF_CACHE_IN_CONTAINER, Deployment
from m31ctl.engine.adapter import build_invocation
from m31ctl.labels import OWNER, Label
from m31ctl.plan import Plan

LOG_MAX_SIZE = "100m"
LOG_MAX_FILES = 5


class Mount(NamedTuple):
    source: str
    target: str
    read_only: bool = False


class ContainerSpec(NamedTuple):
    name: str
    image: str
    args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    secret_env: tuple[str, ...]  # names passed through by reference
    labels: tuple[tuple[str, str], ...]
    vendor: str
    device_request: bool  # GPUs through a device request (NVIDIA) rather than device nodes
    gpu_count: int
    # UUIDs of the GPUs to hand over when the plan was made from this host's probe (which honours
    # *_VISIBLE_DEVICES); empty for a simulated host, where Docker picks by count.
    gpu_device_ids: tuple[str, ...]
    devices: tuple[str, ...]  # AMD device nodes, /dev/infiniband for RDMA
    group_add: tuple[str, ...]
    security_opt: tuple[str, ...]
    cap_add: tuple[str, ...]
    ipc_host: bool
    shm_size: str | None
    ulimits: tuple[tuple[str, int, int], ...]
    mounts: tuple[Mount, ...]
    bind: str
    host_port: int
    container_port: int
    restart: str
    stop_timeout: int
    startup_timeout: int
    log_max_size: str = LOG_MAX_SIZE
    log_max_files: int = LOG_MAX_FILES

    @property
    def label_dict(self) -> dict[str, str]:
        return dict(self.labels)

    def to_data(self) -> dict[str, Any]:
        """The JSON form (`launch --dry-run --json`): mounts as objects, not arrays."""
        return {**self._asdict(), "mounts": [mount._asdict() for mount in self.mounts]}


def labels_for(plan: Plan) -> tuple[tuple[str, str], ...]:
    return tuple(
        sorted(
            {
                Label.OWNER: OWNER,
                Label.PLAN_HASH: plan.hash,
                Label.RECIPE: plan.recipe.recipe,
                Label.VARIANT: plan.variant,
                Label.PROFILE: plan.profile,
                Label.SERVED_MODEL: plan.settings.model.served_name,
                Label.VERSION: __version__,
            }.items()
        )
    )


def _host_render_gid() -> tuple[str, ...]:
    """The numeric GID of this host's `render` group: the image may not know the name."""
    try:
        return (str(grp.getgrnam("render").gr_gid),)
    except KeyError:
        return ()


def groups_on_this_host(deployment: Deployment) -> tuple[str, ...]:
    """The groups a container started on this host joins: the vendor's, and, for GPUs given as
    device nodes (AMD), this host's render GID."""
    vendor = deployment.vendor
    return vendor.group_add + (_host_render_gid() if vendor.device_nodes else ())


def container_spec(deployment: Deployment, on_this_host: bool = True) -> ContainerSpec:
    """The container a deployment runs in, for launch (on_this_host: groups of this host) and for
    the render targets (started elsewhere: group names only)."""
    d = deployment
    s = d.plan.settings
    runtime = s.runtime
    inv = build_invocation(d)
    vendor = d.vendor
    mounts = [Mount(d.hf_cache, HF_CACHE_IN_CONTAINER)]
    if d.model.host_path is not None:
        # A local checkpoint, at the same absolute path inside: the argv names it.
        mounts.append(Mount(d.model.host_path, d.model.host_path, read_only=True))
    # AMD: exactly the chosen GPUs' render nodes (with /dev/kfd) when the probe found them, so
    # the container gets the plan's GPUs as the NVIDIA path gets its UUIDs (ROCm's docs,
    # "restricting GPU access"); all of /dev/dri otherwise.
    devices = vendor.device_nodes
    if devices and d.gpus.render_nodes:
        devices = tuple(n for n in devices if n != "/dev/dri") + d.gpus.render_nodes
    # The engine's RDMA (Deployment.rdma): the verbs devices, IPC_LOCK, unlimited memlock unless
    # the plan sets its own, and NCCL's HCAs under the plan's own environment.
    rdma = d.rdma
    ulimits = dict(runtime.ulimits)
    env = inv.env
    if rdma is not None:
        devices += tuple(n for n in rdma.device_nodes if n not in devices)
        ulimits = {**dict(rdma.ulimits), **ulimits}
        env = tuple(sorted({**dict(rdma.env), **dict(inv.env)}.items()))
    cap_add = vendor.cap_add + tuple(
        c for c in (rdma.capabilities if rdma else ()) if c not in vendor.cap_add
    )
    return ContainerSpec(
        name=d.name,
        image=inv.image,
        args=inv.args,
        env=env,
        secret_env=d.secrets.names,
        labels=labels_for(d.plan),
        vendor=d.plan.hardware.vendor,
        device_request=vendor.device_request,
        gpu_count=d.layout.gpus_per_node,
        gpu_device_ids=d.gpus.uuids,
        devices=devices,
        group_add=groups_on_this_host(d) if on_this_host else vendor.group_add,
        security_opt=("seccomp=unconfined",) if runtime.seccomp_unconfined else (),
        cap_add=cap_add,
        ipc_host=runtime.ipc_host,
        shm_size=None if runtime.ipc_host else runtime.shm_size,
        ulimits=tuple((name, value, value) for name, value in sorted(ulimits.items())),
        mounts=tuple(mounts),
        bind=d.network.bind,
        host_port=d.network.port,
        container_port=d.network.container_port,
        restart="unless-stopped",
        stop_timeout=d.timeline.stop_s,
        startup_timeout=d.timeline.ready_s,
    )


# vLLM copies HIP_VISIBLE_DEVICES into CUDA_VISIBLE_DEVICES (vllm/platforms/rocm.py
# _sync_hip_cuda_env_vars), and Ray sets HIP_VISIBLE_DEVICES per actor and refuses a
# CUDA_VISIBLE_DEVICES that differs from it (ray/_private/accelerators/amd_gpu.py): the CUDA
# spelling of a device-node vendor's visibility is left to them.
_DERIVED_VISIBILITY = "CUDA_VISIBLE_DEVICES"


def render_spec(deployment: Deployment, *, in_pod: bool = False) -> ContainerSpec:
    """The container for a host other than this one (group names only, no host GIDs).

    GPUs given as device nodes (AMD) are every GPU of the host unless the plan names its render
    nodes (a probed host): the container then gets visibility variables for the plan's count, so
    vLLM uses GPUs 0..N-1 of what it sees rather than all of them. A pod sees only what the device
    plugin allocated; it gets the same variables, so every target reads alike."""
    spec = container_spec(deployment, on_this_host=False)
    vendor = deployment.vendor
    if not vendor.device_nodes or (deployment.gpus.render_nodes and not in_pod):
        return spec
    planned = dict(spec.env)
    # A P/D role on a host it shares with its peer takes the host's GPUs it was given
    # (Deployment.gpus.indices); a pod sees only its own allocation, numbered from 0.
    indices = deployment.gpus.indices if not in_pod else ()
    count = deployment.layout.gpus_per_node
    # A visibility variable the plan's runtime.env sets is the user's choice: none is added.
    if any(name in planned for name in vendor.visibility_vars):
        return spec
    # The outermost variable picks the host's GPUs; each inner one numbers what the outer one
    # left, from 0. ROCm applies ROCR_VISIBLE_DEVICES first and renumbers what it exposes, so a
    # decode role given HIP_VISIBLE_DEVICES=4,5,6,7 beside ROCR=4,5,6,7 sees no GPU (ROCm's
    # GPU isolation guide: "ROCR_VISIBLE_DEVICES ... processed first ... reduces the number of
    # GPUs HIP can select from"; issue 49).
    outer, *inner = (name for name in vendor.visibility_vars if name != _DERIVED_VISIBILITY)
    added = {outer: _indices(indices or range(count)), **{name: _indices(range(count)) for name in inner}}
    return spec._replace(env=tuple(sorted({**planned, **added}.items())))


def _indices(gpus: Iterable[int]) -> str:
    return ",".join(str(i) for i in gpus)
