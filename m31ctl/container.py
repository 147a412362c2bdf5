"""The container to run, derived from the plan once and shared by every renderer and launcher."""

from __future__ import annotations

import math
import os
from typing import Any, NamedTuple

from m31ctl import __version__
from m31ctl.engine.adapter import build_invocation
from m31ctl.hardware import vendor_facts
from m31ctl.plan import Plan

CONTAINER_PORT = 8000
HF_CACHE_IN_CONTAINER = "/root/.cache/huggingface"
# Secrets the container may read from its environment. Values never pass through m31ctl's
# argv, logs or rendered files: only these names do.
HF_TOKEN = "HF_TOKEN"
API_KEY = "VLLM_API_KEY"
LOG_MAX_SIZE = "100m"
LOG_MAX_FILES = 5
# docker stop waits this much beyond vLLM's own drain window before it kills.
STOP_MARGIN_S = 30


class Label:
    """The label keys m31ctl puts on what it starts (containers, Kubernetes annotations, native
    state files): one table, read back by status, stop and converge."""

    OWNER = "io.m31ctl.owner"
    PLAN_HASH = "io.m31ctl.plan-hash"
    RECIPE = "io.m31ctl.recipe"
    VARIANT = "io.m31ctl.variant"
    PROFILE = "io.m31ctl.profile"
    SERVED_MODEL = "io.m31ctl.served-model"
    VERSION = "io.m31ctl.version"


# The owner label's value: only what carries it is ever changed or removed.
OWNER = "m31ctl"


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
    devices: tuple[str, ...]  # AMD device nodes
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


def is_local_model(path: str) -> bool:
    """A checkpoint directory rather than a Hugging Face repo id."""
    return os.path.isabs(path) or path.startswith("~/")


def _probed_gpu_ids(plan: Plan) -> tuple[str, ...]:
    hw = plan.hardware
    if hw.vendor != "nvidia" or hw.source.startswith("simulated"):
        return ()
    chosen = hw.gpus[: plan.gpus_needed]
    ids = tuple(g.uuid for g in chosen if g.uuid)
    return ids if len(ids) == plan.gpus_needed else ()


def _probed_devices(plan: Plan, nodes: tuple[str, ...]) -> tuple[str, ...]:
    """AMD: exactly the chosen GPUs' render nodes (with /dev/kfd) when the probe found them, so
    the container gets the plan's GPUs as the NVIDIA path gets its UUIDs (ROCm's docs,
    "restricting GPU access"); all of /dev/dri for a simulated host or an unknown node."""
    hw = plan.hardware
    chosen = hw.gpus[: plan.gpus_needed]
    render = tuple(g.render_node for g in chosen if g.render_node)
    if hw.vendor != "amd" or not chosen or len(render) != plan.gpus_needed:
        return nodes
    return tuple(n for n in nodes if n != "/dev/dri") + render


def _host_render_gid() -> tuple[str, ...]:
    """The numeric GID of this host's `render` group: the image may not know the name."""
    import grp

    try:
        return (str(grp.getgrnam("render").gr_gid),)
    except KeyError:
        return ()


def startup_budget_s(plan: Plan) -> int:
    """Seconds from start to ready: the download at the plan's bandwidth plus load and compile
    (a 250.1 GB checkpoint at 1 Gbit/s is 2,001 s; below about 560 Mbit/s it alone passes an hour)."""
    runtime = plan.settings.runtime
    if runtime.startup_timeout is not None:
        return runtime.startup_timeout
    download = plan.model.checkpoint_gb * 8000 / runtime.download_mbps
    return math.ceil(download) + runtime.load_and_compile_s


def container_spec(plan: Plan, expand_home: bool = True) -> ContainerSpec:
    """The container a plan runs in, for launch (expand_home: paths of this host) and for the
    render targets (paths stay as written, for the target host to resolve)."""
    s = plan.settings
    runtime = s.runtime
    inv = build_invocation(plan)
    vendor = vendor_facts(plan.hardware.vendor)
    hf_cache = os.path.expanduser(runtime.hf_cache) if expand_home else runtime.hf_cache
    mounts = [Mount(hf_cache, HF_CACHE_IN_CONTAINER)]
    if is_local_model(s.model.path):
        # A local checkpoint, at the same path inside: the argv names it. Rendered files mount it
        # too (the path must exist on the target host).
        source = os.path.expanduser(s.model.path) if expand_home else s.model.path
        mounts.append(Mount(source, os.path.expanduser(s.model.path), read_only=True))
    secrets = [HF_TOKEN] + ([API_KEY] if runtime.api_key else [])
    return ContainerSpec(
        name=runtime.container_name,
        image=inv.image,
        args=inv.args,
        env=inv.env,
        secret_env=tuple(secrets),
        labels=labels_for(plan),
        vendor=plan.hardware.vendor,
        device_request=vendor.device_request,
        gpu_count=plan.gpus_needed,
        gpu_device_ids=_probed_gpu_ids(plan),
        devices=_probed_devices(plan, vendor.device_nodes),
        # Launch (expand_home) runs here: this host's render GID; rendered files keep the names.
        # GPUs by device node (AMD), started on this host (launch): add this host's render GID.
        group_add=vendor.group_add + (_host_render_gid() if vendor.device_nodes and expand_home else ()),
        security_opt=("seccomp=unconfined",) if runtime.seccomp_unconfined else (),
        cap_add=vendor.cap_add,
        ipc_host=runtime.ipc_host,
        shm_size=None if runtime.ipc_host else runtime.shm_size,
        ulimits=tuple((name, value, value) for name, value in sorted(runtime.ulimits.items())),
        mounts=tuple(mounts),
        bind=runtime.bind,
        host_port=runtime.port,
        container_port=CONTAINER_PORT,
        restart="unless-stopped",
        stop_timeout=s.serving.shutdown_timeout + STOP_MARGIN_S,
        startup_timeout=startup_budget_s(plan),
    )
