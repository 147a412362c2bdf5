"""The hosts' RDMA fabric: `fabric.rdma` (plan/settings.py RdmaSettings) is the one setting, and
what acting on it needs is spelled here once: UCX's transports for a P/D pair's KV over RDMA
(plan/disaggregation.py ucx_transports), NCCL's HCA list, the device nodes and capability a
container needs to open and pin RDMA memory. deployment.py asks engine_rdma once for each engine's part
(Deployment.rdma); the targets and doctor read that. What is refused here is a fabric the plan
cannot use, before anything renders or starts.

Sources:
- UCX's transports and devices: openucx/ucx docs/source/faq.md ("Which transports does UCX use?":
  `rc` is RC with UD for bootstrap, accelerated transports preferred; "Which network devices does
  UCX use?": `mlx5_2:1`, an RDMA device and its port); vLLM's NixlConnector usage guide (NCCL's
  variables do not apply to NIXL: UCX_TLS, UCX_NET_DEVICES do).
- RDMA in pods: NVIDIA Dynamo's disaggregated communication guide (IPC_LOCK "required for RDMA
  memory pinning", an `rdma/ib` device plugin resource, UCX_TLS `rc_x,rc,dc_x,dc,cuda_copy,
  cuda_ipc`, no TCP; TCP-only KV transfer "effectively unusable").
- NCCL_IB_HCA: NCCL's environment variables (docs.nvidia.com/deeplearning/nccl, user-guide
  env.html): a comma list of HCAs with `:port`, each a prefix unless the list starts with `=`.
"""

from __future__ import annotations

from typing import NamedTuple

from m31ctl.errors import InputError
from m31ctl.hardware import Hardware, Platform, vendor_facts
from m31ctl.plan.layers import Layer
from m31ctl.plan.settings import PlanSettings, RdmaSettings

# UCX_TLS for NIXL over RDMA: RC (UD for its bootstrap, mlx5's accelerated verbs where there)
# beside the GPU copy transports, and no tcp: a fabric that does not come up fails the transfer
# (decode's kv_load_failure_policy) rather than moving the KV over TCP unseen.
RDMA_UCX_TRANSPORTS = {
    Platform.CUDA: "rc,cuda_copy,cuda_ipc",
    Platform.ROCM: "rc,rocm_copy,rocm_ipc",
}
# What a container opens RDMA through (the verbs and rdma_cm character devices) and the
# capability that lets it pin the memory it registers with the HCA beyond RLIMIT_MEMLOCK.
RDMA_DEVICE_NODES = ("/dev/infiniband",)
RDMA_CAPABILITIES = ("IPC_LOCK",)
# Unlimited locked memory beside IPC_LOCK, for a container runtime that drops the capability.
RDMA_ULIMITS = (("memlock", -1),)
NCCL_HCA_ENV = "NCCL_IB_HCA"
SETTING = "fabric.rdma"


def nccl_ib_hca(devices: tuple[str, ...]) -> str:
    """NCCL_IB_HCA for exactly these ports: `=` makes each name exact (mlx5_1 would otherwise
    also match mlx5_10), `:port` as UCX spells it."""
    return "=" + ",".join(devices)


def ucx_net_devices(rdma: RdmaSettings | None) -> str | None:
    """UCX_NET_DEVICES from the HCA ports named; None leaves UCX its choice."""
    return ",".join(rdma.devices) if rdma is not None and rdma.devices else None


class Rdma(NamedTuple):
    """An engine's part of the fabric, for an engine whose traffic crosses its container: a
    layout over nodes (NCCL's collectives) or a P/D role (the KV over UCX, whose transports and
    devices its KvTransfer names: plan/disaggregation.py). Every target reads this: the pods'
    device resource, the containers' device nodes, capability and memlock, NCCL's HCAs."""

    resource: str  # the device plugin's extended resource each pod asks for
    per_pod: int  # how many of it
    devices: tuple[str, ...]  # HCA ports (mlx5_0:1); (): every HCA the engine sees
    device_nodes: tuple[str, ...]  # what a container opens RDMA through
    capabilities: tuple[str, ...]  # what it pins registered memory with
    ulimits: tuple[tuple[str, int], ...]
    env: tuple[tuple[str, str], ...]  # NCCL_IB_HCA where the layout spans nodes and ports are named


def engine_rdma(settings: PlanSettings, spans_nodes: bool, kv_over_ucx: bool) -> Rdma | None:
    """An engine's RDMA: where fabric.rdma is set and its layout spans nodes or its KV moves over
    UCX; None otherwise (a server on one node crosses nothing)."""
    rdma = settings.fabric.rdma
    if rdma is None or not (spans_nodes or kv_over_ucx):
        return None
    devices = rdma.devices or ()
    env = ((NCCL_HCA_ENV, nccl_ib_hca(devices)),) if devices and spans_nodes else ()
    return Rdma(rdma.resource, rdma.count, devices, RDMA_DEVICE_NODES, RDMA_CAPABILITIES, RDMA_ULIMITS, env)


def check_fabric(settings: PlanSettings, merged: Layer, hw: Hardware) -> None:
    """Refuse (InputError, exit 2) an RDMA fabric the plan cannot use."""
    rdma = settings.fabric.rdma
    if rdma is None:
        return
    where = _where(merged)
    platform = vendor_facts(hw.vendor).platform
    if platform not in RDMA_UCX_TRANSPORTS:
        raise InputError(
            f"{SETTING}: the {platform.value} platform moves no GPU memory and runs no NCCL: its ranks "
            "and a P/D pair's KV go over TCP and shared memory",
            where=where,
            hint=f"unset {SETTING}: the cpu recipe rehearses a layout, not its fabric",
        )
    if settings.kubernetes.pod_security == "baseline":
        raise InputError(
            f"{SETTING} gives the pods capability IPC_LOCK (RDMA pins the memory it registers), which "
            'Pod Security "baseline" (kubernetes.pod_security) rejects',
            where=where,
            hint="set kubernetes.pod_security=privileged, for a namespace that admits privileged pods",
        )
    if rdma.devices and settings.disaggregation.ucx_net_devices is not None:
        raise InputError(
            f"{SETTING}.devices and disaggregation.ucx_net_devices both name UCX's devices",
            where=where,
            hint=f"keep {SETTING}.devices (it sets UCX_NET_DEVICES and NCCL_IB_HCA together)",
        )


def _where(merged: Layer) -> str | None:
    """The layer that set fabric.rdma (any key under it)."""
    for key, setting in sorted(merged.items()):
        if key == SETTING or key.startswith(f"{SETTING}."):
            return str(setting.source)
    return None
