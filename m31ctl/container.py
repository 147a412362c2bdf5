"""The container to run, derived from the plan once and shared by every renderer and launcher."""

from __future__ import annotations

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


def _probed_gpu_ids(plan: Plan) -> tuple[str, ...]:
    hw = plan.hardware
    if hw.vendor != "nvidia" or hw.source.startswith("simulated"):
        return ()
    chosen = hw.gpus[: plan.gpus_needed]
    ids = tuple(g.uuid for g in chosen if g.uuid)
    return ids if len(ids) == plan.gpus_needed else ()


def container_spec(plan: Plan, expand_home: bool = True) -> ContainerSpec:
    """The container a plan runs in, for launch (expand_home: paths of this host) and for the
    render targets (paths stay as written, for the target host to resolve)."""
    s = plan.settings
    runtime = s.runtime
    inv = build_invocation(plan)
    vendor = vendor_facts(plan.hardware.vendor)
    hf_cache = os.path.expanduser(runtime.hf_cache) if expand_home else runtime.hf_cache
    mounts = [Mount(hf_cache, HF_CACHE_IN_CONTAINER)]
    if os.path.isabs(s.model.path) and expand_home:
        mounts.append(Mount(s.model.path, s.model.path, read_only=True))  # a local checkpoint
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
        devices=vendor.device_nodes,
        group_add=vendor.group_add,
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
        startup_timeout=runtime.startup_timeout,
    )
