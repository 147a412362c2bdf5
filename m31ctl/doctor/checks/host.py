"""Checks of the host the server runs on: the Docker Engine and its GPU support, the GPUs and
their free memory, MIG, the driver and its CUDA floor, ROCm, shared memory, ulimits, the port.

The Docker Engine, the daemon's GPU runtime and the trial container matter only to a runtime that
runs the engine in a container; for `doctor --deep --runtime native` they skip, saying why (the
lent H200 has no Docker Engine, and its native doctor failed on that alone:
tests/fixtures/gpu/h200-vllm026/exits.txt)."""

from __future__ import annotations

import os
import resource
import shutil
from pathlib import Path

from m31ctl.capacity.fit import plan_fit
from m31ctl.capacity.host_tier import NCCL_SHM_FLOOR, host_memory_need
from m31ctl.checks import CheckStatus
from m31ctl.container import container_spec
from m31ctl.doctor.base import CheckContext, Outcome, SkipCheck
from m31ctl.hardware import Platform, hardware_spec, vendor_facts
from m31ctl.netaddr import port_free
from m31ctl.runtime import get_runtime
from m31ctl.runtime.docker_create import trial_run
from m31ctl.runtime.engine_api import local_image
from m31ctl.runtime.gates import CheckId
from m31ctl.units import parse_size

GB = 1e9
GIB = 1024**3


def without_docker(ctx: CheckContext) -> str | None:
    """Why the runtime doctor checks for needs no Docker Engine, or None when it may: a runtime
    whose launches are not gated on the docker check (m31ctl/runtime/gates.py) runs the engine
    as a process of this host. Doctor's --runtime names it (docker by default)."""
    name = ctx.runtime or ctx.deep
    if name is None or CheckId.DOCKER in get_runtime(name).gates:
        return None
    return f"the {name} runtime runs the engine as a process of this host, without Docker"


def docker_daemon(ctx: CheckContext) -> Outcome:
    unneeded = without_docker(ctx)
    if unneeded:
        return Outcome(CheckStatus.SKIP, unneeded)
    client = ctx.docker_client()
    version = client.version()
    return Outcome(
        CheckStatus.OK, f"Docker Engine {version.get('Version')} (API {version.get('ApiVersion')})"
    )


def gpu_runtime(ctx: CheckContext) -> Outcome:
    facts = ctx.deployment.vendor if ctx.deployment else vendor_facts(ctx.probe.hardware.vendor)
    if not facts.gpus:
        if ctx.deployment is None:
            return Outcome(CheckStatus.SKIP, "no GPU vendor to check a container runtime for")
        ctx.engine()  # the plan still needs an engine
        return Outcome(CheckStatus.OK, "the plan runs on no GPU: no GPU runtime needed")
    unneeded = without_docker(ctx)
    if unneeded:  # the process opens the GPUs itself: no container runtime hands them over
        return Outcome(CheckStatus.SKIP, f"{unneeded}: no container runtime hands it the GPUs")
    nodes = facts.device_nodes
    if nodes:
        missing = [d for d in nodes if not os.access(d, os.R_OK | os.W_OK)]
        if missing:
            return Outcome(
                CheckStatus.FAIL,
                f"no access to {', '.join(missing)}",
                "load the amdgpu driver and add the user to the video and render groups",
            )
        return Outcome(CheckStatus.OK, f"{' and '.join(nodes)} are accessible")
    wanted = facts.gpu_runtime
    if wanted is None:  # a GPU vendor with neither device nodes nor a runtime: a VENDORS row to fix
        return Outcome(CheckStatus.FAIL, "no way to hand this vendor's GPUs to a container is known", "")
    info = ctx.engine().info()
    runtimes = sorted((info.get("Runtimes") or {}).keys())
    cdi = [str(p) for p in info.get("CDISpecDirs") or []]
    cdi_spec = any(
        Path(d).is_dir() and any(wanted.cdi_vendor in f.name for f in Path(d).iterdir()) for d in cdi
    )
    if wanted.name in runtimes or cdi_spec:
        how = (
            f"{wanted.name} runtime"
            if wanted.name in runtimes
            else f"CDI spec for {wanted.cdi_vendor}.com/gpu"
        )
        return Outcome(CheckStatus.OK, f"GPU container support: {how}")
    return Outcome(
        CheckStatus.FAIL,
        f"the daemon has no {wanted.maker} runtime (runtimes: {', '.join(runtimes) or 'none'}) "
        f"and no {wanted.maker} CDI spec",
        wanted.install,
    )


def _no_gpu_remedy(ctx: CheckContext) -> str:
    """What to do on a host without GPUs: with --hardware given, doctor still checks the host it
    runs on, so the way on is that host, not the flag the user already passed."""
    named = ctx.named_host or (ctx.deployment.hardware if ctx.deployment is not None else None)
    if named is None or not named.simulated:
        return "check the driver (nvidia-smi / amd-smi), or pass --hardware to plan for another host"
    tool = {"nvidia": "nvidia-smi", "amd": "amd-smi"}.get(named.vendor, "nvidia-smi / amd-smi")
    spec = hardware_spec(named) or named.source
    return (
        f"doctor checks this host, not the {spec} it was given: run it there (where {tool} lists "
        "the GPUs); plan, capacity and render need no GPU"
    )


def gpus(ctx: CheckContext) -> Outcome:
    hw = ctx.probe.hardware
    if ctx.deployment is not None and not ctx.deployment.vendor.gpus:
        return Outcome(CheckStatus.OK, "the plan runs on no GPU")
    if hw.count == 0:
        reasons = "; ".join(f"{a.method}: {a.detail}" for a in ctx.probe.attempts if not a.ok)
        return Outcome(
            CheckStatus.FAIL,
            f"no GPU found ({reasons})" if reasons else "no GPU found",
            _no_gpu_remedy(ctx),
        )
    found = f"{hw.count}x {hw.product} ({hw.family or 'no recipe'}, arch {hw.arch}) via {hw.source}"
    if ctx.plan is None:
        return Outcome(CheckStatus.FAIL, f"{found}: {ctx.plan_error}", "see `m31ctl probe`")
    deployment = ctx.require_deployment()
    needed = deployment.layout.gpus_per_node
    planned = deployment.hardware
    if planned.simulated and (planned.family, planned.arch) != (hw.family, hw.arch):
        return Outcome(
            CheckStatus.FAIL,
            f"{found}, but the plan is for {planned.count}x {planned.product} ({planned.source})",
            "drop --hardware to check this host's own plan",
        )
    recipe = deployment.plan.recipe.recipe
    per_node = f" on each of {deployment.layout.nodes} nodes" if deployment.layout.spans_nodes else ""
    if hw.count < needed:
        return Outcome(
            CheckStatus.FAIL,
            f"{found}; the {recipe} plan needs {needed}{per_node}",
            "use a host with enough GPUs, another profile, or spread the layout with parallelism.nodes",
        )
    return Outcome(CheckStatus.OK, f"{found}; the {recipe} plan uses {needed}{per_node}")


def gpu_memory(ctx: CheckContext) -> Outcome:
    deployment = ctx.require_deployment()
    plan = deployment.plan

    fit = plan_fit(deployment)
    need = fit.weights_per_gpu_bytes
    # The GPUs it is given: by index where a runtime hands it chosen ones (a P/D role, a
    # blue-green successor beside the live server), else the host's first.
    chosen = deployment.gpus.indices
    every = ctx.probe.hardware.gpus
    gpus = [g for g in every if g.index in chosen] if chosen else every[: deployment.layout.gpus_per_node]
    free = [g.memory_free_bytes for g in gpus if g.memory_free_bytes is not None]
    if not free:
        return Outcome(CheckStatus.SKIP, "free GPU memory unknown (no GPU, or the probe could not read it)")
    lowest = min(free)
    util = plan.settings.serving.gpu_memory_utilization
    total = ctx.probe.hardware.memory_per_gpu_bytes
    if lowest < need:
        return Outcome(
            CheckStatus.FAIL,
            f"{lowest / GB:.1f} GB free on the fullest GPU; the plan's weights need {need / GB:.1f} GB per GPU",
            "free the GPUs (nvidia-smi shows who holds them) or use more GPUs",
        )
    if lowest < total * util:
        # vLLM 0.32 raises at start when free memory is below utilization x total
        # (v1/worker/utils.py): this host cannot start the plan as it is.
        return Outcome(
            CheckStatus.FAIL,
            f"{lowest / GB:.1f} GB free on the fullest GPU, below gpu_memory_utilization={util:g} "
            f"of {total / GB:.1f} GB: vLLM refuses to start",
            "free the GPUs (another process holds memory: nvidia-smi shows it) or lower "
            "serving.gpu_memory_utilization",
        )
    return Outcome(
        CheckStatus.OK, f"{lowest / GB:.1f} GB free per GPU; weights need {need / GB:.1f} GB per GPU"
    )


def mig(ctx: CheckContext) -> Outcome:
    hw = ctx.probe.hardware
    if vendor_facts(hw.vendor).platform is not Platform.CUDA:
        return Outcome(CheckStatus.SKIP, "MIG applies to NVIDIA GPUs")
    if hw.mig_enabled:
        return Outcome(
            CheckStatus.FAIL, "MIG mode is enabled", "disable it: nvidia-smi -mig 0 (then reset the GPUs)"
        )
    if hw.mig_enabled is None:
        return Outcome(CheckStatus.OK, "MIG not supported on these GPUs")
    return Outcome(CheckStatus.OK, "MIG disabled")


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def image_cuda_version(ctx: CheckContext) -> str | None:
    """The CUDA version the engine image was built on (NVIDIA's CUDA images set CUDA_VERSION), or
    None when the image is not here or does not say."""
    if ctx.plan is None:
        return None
    try:
        image = local_image(ctx.engine(), ctx.plan.settings.engine.image)
    except SkipCheck:
        return None
    if image is None:
        return None
    env = (image.attrs.get("Config") or {}).get("Env") or []
    found = next((e.split("=", 1)[1] for e in env if e.startswith("CUDA_VERSION=")), None)
    return ".".join(found.split(".")[:2]) if found else None


def driver(ctx: CheckContext) -> Outcome:
    hw = ctx.probe.hardware
    if vendor_facts(hw.vendor).platform is not Platform.CUDA:
        return Outcome(CheckStatus.SKIP, "no NVIDIA driver on this host")
    recommended = ctx.plan.recipe.recommended.cuda_driver if ctx.plan else None
    found = f"driver {hw.driver_version}, CUDA {hw.cuda_driver_version or 'unknown'}"
    floor = image_cuda_version(ctx)
    if floor and hw.cuda_driver_version and version_tuple(hw.cuda_driver_version) < version_tuple(floor):
        # The floor: a driver runs CUDA up to the version it reports; the image's CUDA runtime
        # needs at least that (CUDA's compatibility rule; forward-compat packages aside).
        return Outcome(
            CheckStatus.FAIL,
            f"{found}; the engine image is built on CUDA {floor}, newer than this driver supports",
            f"upgrade the driver to one that supports CUDA {floor} or later",
        )
    if (
        recommended
        and hw.cuda_driver_version
        and version_tuple(hw.cuda_driver_version) < version_tuple(recommended)
    ):
        return Outcome(
            CheckStatus.WARN,
            f"{found}; the {ctx.plan.recipe.recipe if ctx.plan else ''} recipe recommends CUDA {recommended}",
            f"upgrade the driver to one that supports CUDA {recommended} (QMUL4 NVFP4->FP8 decode)",
        )
    return Outcome(CheckStatus.OK, found + (f"; the image needs CUDA {floor}" if floor else ""))


def rocm(ctx: CheckContext) -> Outcome:
    hw = ctx.probe.hardware
    if vendor_facts(hw.vendor).platform is not Platform.ROCM:
        return Outcome(CheckStatus.SKIP, "no AMD GPU on this host")
    version = hw.rocm_version
    if version is None:
        path = Path("/opt/rocm/.info/version")
        version = path.read_text().strip() if path.exists() else None
    if version is None:
        return Outcome(
            CheckStatus.WARN,
            "ROCm version unknown",
            "the container brings its own ROCm user space; the host needs amdgpu",
        )
    return Outcome(CheckStatus.OK, f"ROCm {version}")


def shm(ctx: CheckContext) -> Outcome:
    deployment = ctx.require_deployment()
    plan = deployment.plan
    runtime = plan.settings.runtime
    native = without_docker(ctx)
    if runtime.ipc_host or native:  # runtime.shm_size sizes a container's /dev/shm only
        size = shutil.disk_usage("/dev/shm").total if Path("/dev/shm").exists() else 0
        if size < GIB:
            return Outcome(
                CheckStatus.WARN,
                f"host /dev/shm is {size / GIB:.1f} GiB",
                "NCCL needs more; enlarge /dev/shm",
            )
        where = "the host's /dev/shm (no container)" if native else "host IPC namespace, /dev/shm"
        return Outcome(CheckStatus.OK, f"{where} {size / GIB:.0f} GiB")
    want = parse_size(runtime.shm_size)
    if want < SHM_FLOOR and deployment.layout.gpus_per_node > 1:
        # NCCL puts its intra-node buffers in /dev/shm; Docker's 64 MB default makes it fail.
        return Outcome(
            CheckStatus.FAIL,
            f"runtime.shm_size={runtime.shm_size} is too small for {deployment.layout.gpus_per_node} GPUs' NCCL buffers",
            f"at least {SHM_FLOOR // GIB} GiB: --set runtime.shm_size=64g (the recipes' default)",
        )
    mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    # On CUDA the prefix cache's host tier lives in this /dev/shm (capacity/host_tier.py), and the
    # KV capacity check weighs it against the host's memory: only the rest is judged here.
    need = host_memory_need(deployment)
    tier = need.tier.bytes_per_host if need is not None and need.tier.in_shm else 0
    if want - tier > mem_total // 2:
        limit = mem_total // 2 + tier
        beside = f" (half, and the prefix cache's {tier / GIB:.1f} GiB host tier in it)" if tier else ""
        return Outcome(
            CheckStatus.WARN,
            f"runtime.shm_size={runtime.shm_size} is over half of this host's memory: the host has "
            f"{mem_total / GIB:.1f} GiB, so the limit is {limit / GIB:.1f} GiB{beside}",
            f"lower it to the limit: --set runtime.shm_size={max(limit, SHM_FLOOR) // GIB}g",
        )
    return Outcome(
        CheckStatus.OK, f"private /dev/shm of {runtime.shm_size} (host memory {mem_total / GIB:.0f} GiB)"
    )


# NCCL's shared-memory transport needs more than Docker's 64 MB; 1 GiB is a floor (capacity/
# host_tier.py asks the same of a /dev/shm beside the CUDA host tier).
SHM_FLOOR = NCCL_SHM_FLOOR


def memlock(ctx: CheckContext) -> Outcome:
    """The plan's ulimits and /dev/shm, tried for real: a throwaway container of the engine image
    with exactly those settings (dockerd's own limits decide, not this shell's)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    host = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"
    deployment = ctx.deployment
    if deployment is None or not deployment.plan.settings.runtime.ulimits:
        return Outcome(CheckStatus.OK, f"host locked-memory limit {host}; the plan sets no ulimits")
    unneeded = without_docker(ctx)
    if unneeded:  # runtime.ulimits are a container's; the process inherits this shell's
        return Outcome(
            CheckStatus.SKIP, f"{unneeded}: it runs under this shell's limits (locked memory {host})"
        )

    client = ctx.engine()
    spec = container_spec(deployment)
    if local_image(client, spec.image) is None:
        return Outcome(CheckStatus.SKIP, f"{spec.image} is not here to try the ulimits with (launch will)")
    error = trial_run(client, spec)
    wanted = ", ".join(f"{n}={s}" for n, s, _h in spec.ulimits) or "none"
    if error:
        return Outcome(
            CheckStatus.FAIL,
            f"the Docker Engine refuses the plan's ulimits ({wanted}): {error[:200]}",
            "raise dockerd's limits (LimitMEMLOCK=infinity in its systemd unit) or --set runtime.ulimits={}",
        )
    return Outcome(CheckStatus.OK, f"a container with ulimits {wanted} and the plan's /dev/shm starts")


def port(ctx: CheckContext) -> Outcome:
    """Every port the deployment listens on (a P/D group's roles and side channels too)."""
    listeners = ctx.require_deployment().listeners
    busy = [one for one in listeners if not port_free(one.bind, one.port)]
    if busy:
        shown = ", ".join(f"{one.bind}:{one.port} ({one.setting})" for one in busy)
        return Outcome(
            CheckStatus.FAIL,
            f"port{'s' if len(busy) > 1 else ''} {shown} in use",
            f"stop what listens there or move it: --set {busy[0].setting}=..."
            + (" (or --port)" if busy[0].setting == "runtime.port" else ""),
        )
    if len(listeners) == 1:
        return Outcome(CheckStatus.OK, f"port {listeners[0].bind}:{listeners[0].port} is free")
    return Outcome(
        CheckStatus.OK, f"{len(listeners)} ports free: " + ", ".join(str(one.port) for one in listeners)
    )
