"""The checks `m31ctl doctor` and `launch` run. Each reads the Context and returns an Outcome."""

from __future__ import annotations

import os
import resource
import shutil
from pathlib import Path

from m31ctl.doctor.base import Check, Context, Outcome
from m31ctl.errors import M31Error
from m31ctl.hardware import vendor_facts
from m31ctl.netaddr import port_free
from m31ctl.plan import Plan
from m31ctl.runtime.engine_api import local_image, registry_error
from m31ctl.runtime.launching import API_KEY_ENV
from m31ctl.units import parse_size

GB = 1e9
GIB = 1024**3


def docker_daemon(ctx: Context) -> Outcome:
    client = ctx.docker_client()
    version = client.version()
    return Outcome("ok", f"Docker Engine {version.get('Version')} (API {version.get('ApiVersion')})")


def gpu_runtime(ctx: Context) -> Outcome:
    vendor = ctx.plan.hardware.vendor if ctx.plan else ctx.probe.hardware.vendor
    if vendor == "cpu":
        ctx.engine()  # still needs an engine
        return Outcome("ok", "the CPU rehearsal needs no GPU runtime")
    nodes = vendor_facts(vendor).device_nodes
    if nodes:
        missing = [d for d in nodes if not os.access(d, os.R_OK | os.W_OK)]
        if missing:
            return Outcome(
                "fail",
                f"no access to {', '.join(missing)}",
                "load the amdgpu driver and add the user to the video and render groups",
            )
        return Outcome("ok", f"{' and '.join(nodes)} are accessible")
    if vendor == "none":
        return Outcome("skip", "no GPU vendor to check a container runtime for")
    info = ctx.engine().info()
    runtimes = sorted((info.get("Runtimes") or {}).keys())
    cdi = [str(p) for p in info.get("CDISpecDirs") or []]
    cdi_nvidia = any(Path(d).is_dir() and any("nvidia" in f.name for f in Path(d).iterdir()) for d in cdi)
    if "nvidia" in runtimes or cdi_nvidia:
        how = "nvidia runtime" if "nvidia" in runtimes else "CDI spec for nvidia.com/gpu"
        return Outcome("ok", f"GPU container support: {how}")
    return Outcome(
        "fail",
        f"the daemon has no NVIDIA runtime (runtimes: {', '.join(runtimes) or 'none'}) and no NVIDIA CDI spec",
        "install nvidia-container-toolkit and run `nvidia-ctk runtime configure --runtime=docker`",
    )


def gpus(ctx: Context) -> Outcome:
    hw = ctx.probe.hardware
    if ctx.plan is not None and ctx.plan.hardware.vendor == "cpu":
        return Outcome("ok", "the CPU rehearsal needs no GPU")
    if hw.count == 0:
        reasons = "; ".join(f"{a.method}: {a.detail}" for a in ctx.probe.attempts if not a.ok)
        return Outcome(
            "fail",
            f"no GPU found ({reasons})" if reasons else "no GPU found",
            "check the driver (nvidia-smi / amd-smi), or pass --hardware to plan for another host",
        )
    found = f"{hw.count}x {hw.product} ({hw.family or 'no recipe'}, arch {hw.arch}) via {hw.source}"
    if ctx.plan is None:
        return Outcome("fail", f"{found}: {ctx.plan_error}", "see `m31ctl probe`")
    needed = ctx.plan.gpus_needed
    planned = ctx.plan.hardware
    if planned.source.startswith("simulated") and (planned.family, planned.arch) != (hw.family, hw.arch):
        return Outcome(
            "fail",
            f"{found}, but the plan is for {planned.count}x {planned.product} ({planned.source})",
            "drop --hardware to check this host's own plan",
        )
    if hw.count < needed:
        return Outcome(
            "fail",
            f"{found}; the {ctx.plan.recipe.recipe} plan needs {needed}",
            "use a host with enough GPUs or another profile",
        )
    return Outcome("ok", f"{found}; the {ctx.plan.recipe.recipe} plan uses {needed}")


def gpu_memory(ctx: Context) -> Outcome:
    plan = ctx.require_plan()
    from m31ctl.capacity.fit import plan_fit

    fit = plan_fit(plan)
    need = fit.weights_per_gpu_bytes
    gpus = ctx.probe.hardware.gpus[: plan.gpus_needed]
    free = [g.memory_free_bytes for g in gpus if g.memory_free_bytes is not None]
    if not free:
        return Outcome("skip", "free GPU memory unknown (no GPU, or the probe could not read it)")
    lowest = min(free)
    util = plan.settings.serving.gpu_memory_utilization
    total = ctx.probe.hardware.memory_per_gpu_bytes
    if lowest < need:
        return Outcome(
            "fail",
            f"{lowest / GB:.1f} GB free on the fullest GPU; the plan's weights need {need / GB:.1f} GB per GPU",
            "free the GPUs (nvidia-smi shows who holds them) or use more GPUs",
        )
    if lowest < total * util:
        return Outcome(
            "warn",
            f"{lowest / GB:.1f} GB free on the fullest GPU, below gpu_memory_utilization={util:g} "
            f"of {total / GB:.1f} GB",
            "another process holds GPU memory; vLLM will refuse to start",
        )
    return Outcome("ok", f"{lowest / GB:.1f} GB free per GPU; weights need {need / GB:.1f} GB per GPU")


def mig(ctx: Context) -> Outcome:
    hw = ctx.probe.hardware
    if hw.vendor != "nvidia":
        return Outcome("skip", "MIG applies to NVIDIA GPUs")
    if hw.mig_enabled:
        return Outcome("fail", "MIG mode is enabled", "disable it: nvidia-smi -mig 0 (then reset the GPUs)")
    if hw.mig_enabled is None:
        return Outcome("ok", "MIG not supported on these GPUs")
    return Outcome("ok", "MIG disabled")


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def driver(ctx: Context) -> Outcome:
    hw = ctx.probe.hardware
    if hw.vendor != "nvidia":
        return Outcome("skip", "no NVIDIA driver on this host")
    recommended = ctx.plan.recipe.recommended.cuda_driver if ctx.plan else None
    found = f"driver {hw.driver_version}, CUDA {hw.cuda_driver_version or 'unknown'}"
    if (
        recommended
        and hw.cuda_driver_version
        and _version_tuple(hw.cuda_driver_version) < _version_tuple(recommended)
    ):
        return Outcome(
            "warn",
            f"{found}; the {ctx.plan.recipe.recipe if ctx.plan else ''} recipe recommends CUDA {recommended}",
            f"upgrade the driver to one that supports CUDA {recommended} (QMUL4 NVFP4->FP8 decode)",
        )
    return Outcome("ok", found)


def rocm(ctx: Context) -> Outcome:
    hw = ctx.probe.hardware
    if hw.vendor != "amd":
        return Outcome("skip", "no AMD GPU on this host")
    version = hw.rocm_version
    if version is None:
        path = Path("/opt/rocm/.info/version")
        version = path.read_text().strip() if path.exists() else None
    if version is None:
        return Outcome(
            "warn",
            "ROCm version unknown",
            "the container brings its own ROCm user space; the host needs amdgpu",
        )
    return Outcome("ok", f"ROCm {version}")


def _hf_cache(plan: Plan) -> Path:
    return Path(os.path.expanduser(plan.settings.runtime.hf_cache))


def _checkpoint_cached(plan: Plan) -> bool:
    repo = plan.settings.model.path
    if Path(repo).is_dir():
        return True
    return (_hf_cache(plan) / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots").is_dir()


def disk(ctx: Context) -> Outcome:
    plan = ctx.require_plan()
    local = plan.settings.model.path
    if os.path.isabs(local):  # a local checkpoint directory, mounted as it is
        if Path(local).is_dir():
            return Outcome("ok", f"local checkpoint {local}")
        return Outcome(
            "fail",
            f"the model path {local} does not exist",
            "create it (scripts/rehearse makes the rehearsal model) or --set model.path=...",
        )
    if _checkpoint_cached(plan):
        return Outcome("ok", f"checkpoint already in {_hf_cache(plan)}")
    path = _hf_cache(plan)
    probe_path = path
    while not probe_path.exists():
        probe_path = probe_path.parent
    free = shutil.disk_usage(probe_path).free
    need = plan.model.checkpoint_gb * GB
    if free < need:
        return Outcome(
            "fail",
            f"{free / GB:.0f} GB free at {probe_path}; the checkpoint needs {need / GB:.1f} GB",
            "free space, or point runtime.hf_cache at a larger disk (--set runtime.hf_cache=/data/hf)",
        )
    return Outcome("ok", f"{free / GB:.0f} GB free at {probe_path} for the {need / GB:.1f} GB checkpoint")


def shm(ctx: Context) -> Outcome:
    plan = ctx.require_plan()
    runtime = plan.settings.runtime
    if runtime.ipc_host:
        size = shutil.disk_usage("/dev/shm").total if Path("/dev/shm").exists() else 0
        if size < GIB:
            return Outcome(
                "warn", f"host /dev/shm is {size / GIB:.1f} GiB", "NCCL needs more; enlarge /dev/shm"
            )
        return Outcome("ok", f"host IPC namespace, /dev/shm {size / GIB:.0f} GiB")
    want = parse_size(runtime.shm_size)
    mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if want > mem_total // 2:
        return Outcome(
            "warn",
            f"runtime.shm_size={runtime.shm_size} is over half of host memory ({mem_total / GIB:.0f} GiB)",
            "lower --set runtime.shm_size",
        )
    return Outcome("ok", f"private /dev/shm of {runtime.shm_size} (host memory {mem_total / GIB:.0f} GiB)")


def memlock(ctx: Context) -> Outcome:
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    host = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"
    wanted = ctx.plan.settings.runtime.ulimits.get("memlock") if ctx.plan else None
    if wanted is None:
        return Outcome("ok", f"host locked-memory limit {host}; the plan sets no memlock ulimit")
    return Outcome(
        "ok",
        f"host locked-memory limit {host}; the container asks for memlock={wanted} "
        "(dockerd's own limit must allow it)",
    )


def port(ctx: Context) -> Outcome:
    plan = ctx.require_plan()
    runtime = plan.settings.runtime

    if not port_free(runtime.bind, runtime.port):
        return Outcome(
            "fail",
            f"port {runtime.bind}:{runtime.port} is in use",
            "stop what listens there or pass --port / --set runtime.port=...",
        )
    return Outcome("ok", f"port {runtime.bind}:{runtime.port} is free")


def hf_token(ctx: Context) -> Outcome:
    plan = ctx.require_plan()
    if _checkpoint_cached(plan):
        return Outcome("ok", "checkpoint cached; no token needed to start")
    token_file = _hf_cache(plan) / "token"
    if ctx.env.get("HF_TOKEN") or ctx.env.get("HUGGING_FACE_HUB_TOKEN"):
        return Outcome("ok", "Hugging Face token present in the environment (not shown)")
    if token_file.exists():
        return Outcome("ok", f"Hugging Face token present in {token_file} (not shown)")
    return Outcome(
        "warn",
        "no Hugging Face token: anonymous downloads are rate limited",
        "export HF_TOKEN (m31ctl passes it by reference, never in argv)",
    )


def image(ctx: Context) -> Outcome:
    plan = ctx.require_plan()
    name = plan.settings.engine.image
    client = ctx.engine()
    img = local_image(client, name)
    if img is not None:
        return Outcome("ok", f"{name} present locally ({img.short_id})")
    problem = registry_error(client, name)
    if problem is not None:
        return Outcome(
            "warn",
            f"{name} is not present locally and its registry did not answer ({problem[:120]})",
            "pull it where the registry is reachable, or `docker load` it",
        )
    return Outcome("ok", f"{name} not present locally; the registry has it (launch pulls it)")


def engine(ctx: Context) -> Outcome:
    plan = ctx.require_plan()
    from m31ctl.engine.adapter import build_invocation
    from m31ctl.engine.validate import schema_from_data, validate

    name = plan.settings.engine.image
    image = local_image(ctx.engine(), name)
    if image is None:
        return Outcome(
            "skip",
            f"{name} is not present locally, so its own vLLM cannot be asked",
            "pull it, then run doctor again (plan-time validation used the vLLM 0.32 schema)",
        )
    from m31ctl.runtime.images import engine_schema

    data = engine_schema(ctx.engine(), image)
    findings = validate(build_invocation(plan), schema_from_data(data, name))
    if findings:
        return Outcome(
            "fail",
            f"the image's vLLM {data.get('version')} would reject {findings[0].line()}"
            + (f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""),
            "fix the setting, or use an image whose vLLM supports it",
        )
    return Outcome("ok", f"argv and environment match the vLLM {data.get('version')} inside {name}")


def api_key(ctx: Context) -> Outcome:
    plan = ctx.require_plan()
    if not plan.settings.runtime.api_key:
        return Outcome("ok", "the server takes no API key (loopback only)")
    if ctx.env.get(API_KEY_ENV):
        return Outcome("ok", f"{API_KEY_ENV} is set (not shown)")
    return Outcome(
        "fail",
        f"runtime.api_key is set but {API_KEY_ENV} is not in the environment",
        f"export {API_KEY_ENV} (m31ctl passes it by reference, never in argv)",
    )


def capacity(ctx: Context) -> Outcome:
    plan = ctx.require_plan()
    from m31ctl.capacity.fit import capacity_warning, plan_fit

    warning = capacity_warning(plan)
    if warning:
        return Outcome("warn", warning, "lower serving.max_model_len / max_num_seqs or add GPUs")
    fit = plan_fit(plan)
    basis = fit.sequences_published_basis
    published = "" if basis is None else f"; {basis} on the launch post's basis (main attention only)"
    return Outcome(
        "ok",
        f"{fit.sequences} sequences of {fit.context} tokens fit ({fit.layout}, "
        f"{fit.kv_cache_tokens:,} KV tokens per engine){published}",
    )


def all_checks() -> list[Check]:
    return [
        Check("docker", "Docker daemon", docker_daemon),
        Check("gpu-runtime", "GPU container runtime", gpu_runtime),
        Check("gpus", "GPUs", gpus, timeout_s=1),
        Check("gpu-memory", "Free GPU memory", gpu_memory, timeout_s=1),
        Check("mig", "MIG mode", mig, timeout_s=1),
        Check("driver", "NVIDIA driver / CUDA", driver, timeout_s=1),
        Check("rocm", "ROCm", rocm, timeout_s=1),
        Check("disk", "Disk for the checkpoint", disk),
        Check("shm", "Shared memory", shm, timeout_s=1),
        Check("memlock", "Locked-memory limit", memlock, timeout_s=1),
        Check("port", "Port", port, timeout_s=1),
        Check("hf-token", "Hugging Face token", hf_token, timeout_s=1),
        Check("api-key", "API key", api_key, timeout_s=1),
        Check("image", "Engine image", image, timeout_s=8),
        Check("capacity", "KV capacity", capacity, timeout_s=2),
        Check("engine", "Engine accepts the argv", engine, timeout_s=120),
    ]


__all__ = ["M31Error", "all_checks"]
