"""The checks `m31ctl doctor` and `launch` run. Each reads the Context and returns an Outcome."""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from m31ctl.deployment import Deployment
from m31ctl.redact import SECRET_ENV
from m31ctl.doctor.base import Check, Context, Outcome, SkipCheck
from m31ctl.errors import M31Error
from m31ctl.hardware import vendor_facts
from m31ctl.netaddr import port_free
from m31ctl.runtime.engine_api import explanation, local_image, registry_error
from m31ctl.units import parse_size

GB = 1e9
GIB = 1024**3


def docker_daemon(ctx: Context) -> Outcome:
    client = ctx.docker_client()
    version = client.version()
    return Outcome("ok", f"Docker Engine {version.get('Version')} (API {version.get('ApiVersion')})")


def gpu_runtime(ctx: Context) -> Outcome:
    facts = ctx.deployment.vendor if ctx.deployment else vendor_facts(ctx.probe.hardware.vendor)
    if not facts.gpus:
        if ctx.deployment is None:
            return Outcome("skip", "no GPU vendor to check a container runtime for")
        ctx.engine()  # the plan still needs an engine
        return Outcome("ok", "the plan runs on no GPU: no GPU runtime needed")
    nodes = facts.device_nodes
    if nodes:
        missing = [d for d in nodes if not os.access(d, os.R_OK | os.W_OK)]
        if missing:
            return Outcome(
                "fail",
                f"no access to {', '.join(missing)}",
                "load the amdgpu driver and add the user to the video and render groups",
            )
        return Outcome("ok", f"{' and '.join(nodes)} are accessible")
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
    if ctx.deployment is not None and not ctx.deployment.vendor.gpus:
        return Outcome("ok", "the plan runs on no GPU")
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
    deployment = ctx.require_deployment()
    needed = deployment.layout.gpus_per_node
    planned = deployment.hardware
    if planned.simulated and (planned.family, planned.arch) != (hw.family, hw.arch):
        return Outcome(
            "fail",
            f"{found}, but the plan is for {planned.count}x {planned.product} ({planned.source})",
            "drop --hardware to check this host's own plan",
        )
    recipe = deployment.plan.recipe.recipe
    per_node = f" on each of {deployment.layout.nodes} nodes" if deployment.layout.spans_nodes else ""
    if hw.count < needed:
        return Outcome(
            "fail",
            f"{found}; the {recipe} plan needs {needed}{per_node}",
            "use a host with enough GPUs, another profile, or spread the layout with parallelism.nodes",
        )
    return Outcome("ok", f"{found}; the {recipe} plan uses {needed}{per_node}")


def gpu_memory(ctx: Context) -> Outcome:
    deployment = ctx.require_deployment()
    plan = deployment.plan
    from m31ctl.capacity.fit import plan_fit

    fit = plan_fit(deployment)
    need = fit.weights_per_gpu_bytes
    gpus = ctx.probe.hardware.gpus[: deployment.layout.gpus_per_node]
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
        # vLLM 0.32 raises at start when free memory is below utilization x total
        # (v1/worker/utils.py): this host cannot start the plan as it is.
        return Outcome(
            "fail",
            f"{lowest / GB:.1f} GB free on the fullest GPU, below gpu_memory_utilization={util:g} "
            f"of {total / GB:.1f} GB: vLLM refuses to start",
            "free the GPUs (another process holds memory: nvidia-smi shows it) or lower "
            "serving.gpu_memory_utilization",
        )
    return Outcome("ok", f"{lowest / GB:.1f} GB free per GPU; weights need {need / GB:.1f} GB per GPU")


def mig(ctx: Context) -> Outcome:
    hw = ctx.probe.hardware
    if vendor_facts(hw.vendor).driver_stack != "cuda":
        return Outcome("skip", "MIG applies to NVIDIA GPUs")
    if hw.mig_enabled:
        return Outcome("fail", "MIG mode is enabled", "disable it: nvidia-smi -mig 0 (then reset the GPUs)")
    if hw.mig_enabled is None:
        return Outcome("ok", "MIG not supported on these GPUs")
    return Outcome("ok", "MIG disabled")


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


def image_cuda_version(ctx: Context) -> str | None:
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


def driver(ctx: Context) -> Outcome:
    hw = ctx.probe.hardware
    if vendor_facts(hw.vendor).driver_stack != "cuda":
        return Outcome("skip", "no NVIDIA driver on this host")
    recommended = ctx.plan.recipe.recommended.cuda_driver if ctx.plan else None
    found = f"driver {hw.driver_version}, CUDA {hw.cuda_driver_version or 'unknown'}"
    floor = image_cuda_version(ctx)
    if floor and hw.cuda_driver_version and _version_tuple(hw.cuda_driver_version) < _version_tuple(floor):
        # The floor: a driver runs CUDA up to the version it reports; the image's CUDA runtime
        # needs at least that (CUDA's compatibility rule; forward-compat packages aside).
        return Outcome(
            "fail",
            f"{found}; the engine image is built on CUDA {floor}, newer than this driver supports",
            f"upgrade the driver to one that supports CUDA {floor} or later",
        )
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
    return Outcome("ok", found + (f"; the image needs CUDA {floor}" if floor else ""))


def rocm(ctx: Context) -> Outcome:
    hw = ctx.probe.hardware
    if vendor_facts(hw.vendor).driver_stack != "rocm":
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


def _snapshot(deployment: Deployment) -> Path | None:
    """The checkpoint directory: a local one, or the newest cached snapshot of the hub repo."""
    model = deployment.model
    if model.host_path is not None:
        return Path(model.host_path) if Path(model.host_path).is_dir() else None
    snapshots = (
        Path(deployment.hf_cache) / "hub" / f"models--{model.reference.replace('/', '--')}" / "snapshots"
    )
    found = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    return found[-1] if found else None


def checkpoint_state(deployment: Deployment) -> tuple[str, str]:
    """("complete" | "partial" | "absent", why): every shard model.safetensors.index.json names is
    present with a plausible size, and the dspark/ draft too when the plan uses DSpark."""
    plan = deployment.plan
    directory = _snapshot(deployment)
    if directory is None:
        return "absent", "not downloaded"
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
        except (OSError, ValueError):
            return "partial", f"{index} is unreadable"
        shards = sorted(set(weight_map.values()))
    else:
        shards = [p.name for p in directory.glob("*.safetensors")]
        if not shards:
            return "partial", f"{directory} has no weights (no model.safetensors.index.json, no .safetensors)"
    missing = [s for s in shards if not (directory / s).is_file() or (directory / s).stat().st_size < 1024]
    if missing:
        return "partial", f"{len(missing)} of {len(shards)} shards missing or empty (e.g. {missing[0]})"
    if plan.settings.speculative.method == "dspark" and not (directory / "dspark").is_dir():
        return "partial", "the dspark/ draft the plan uses is missing"
    return "complete", f"{len(shards)} shards in {directory}"


def _checkpoint(ctx: Context) -> tuple[str, str]:
    """checkpoint_state once per doctor run: the checkpoint, disk and hf-token checks all ask."""
    deployment = ctx.require_deployment()
    found: tuple[str, str] = ctx.once("checkpoint", lambda: checkpoint_state(deployment))
    return found


def checkpoint(ctx: Context) -> Outcome:
    state, why = _checkpoint(ctx)
    if state == "complete":
        return Outcome("ok", f"checkpoint complete: {why}")
    if state == "partial":
        return Outcome(
            "fail",
            f"checkpoint incomplete: {why}",
            "finish the download (huggingface-cli download REPO) or remove the partial snapshot",
        )
    return Outcome("ok", "not downloaded yet: launch downloads it (see the disk check)")


def disk(ctx: Context) -> Outcome:
    deployment = ctx.require_deployment()
    plan = deployment.plan
    local = deployment.model.host_path
    if local is not None:  # a local checkpoint directory, mounted as it is
        if Path(local).is_dir():
            return Outcome("ok", f"local checkpoint {local}")
        return Outcome(
            "fail",
            f"the model path {local} does not exist",
            "create it (scripts/rehearse makes the rehearsal model) or --set model.path=...",
        )
    if _checkpoint(ctx)[0] == "complete":
        return Outcome("ok", f"checkpoint already in {deployment.hf_cache}")
    path = Path(deployment.hf_cache)
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
    deployment = ctx.require_deployment()
    plan = deployment.plan
    runtime = plan.settings.runtime
    if runtime.ipc_host:
        size = shutil.disk_usage("/dev/shm").total if Path("/dev/shm").exists() else 0
        if size < GIB:
            return Outcome(
                "warn", f"host /dev/shm is {size / GIB:.1f} GiB", "NCCL needs more; enlarge /dev/shm"
            )
        return Outcome("ok", f"host IPC namespace, /dev/shm {size / GIB:.0f} GiB")
    want = parse_size(runtime.shm_size)
    if want < SHM_FLOOR and deployment.layout.gpus_per_node > 1:
        # NCCL puts its intra-node buffers in /dev/shm; Docker's 64 MB default makes it fail.
        return Outcome(
            "fail",
            f"runtime.shm_size={runtime.shm_size} is too small for {deployment.layout.gpus_per_node} GPUs' NCCL buffers",
            f"at least {SHM_FLOOR // GIB} GiB: --set runtime.shm_size=64g (the recipes' default)",
        )
    mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if want > mem_total // 2:
        return Outcome(
            "warn",
            f"runtime.shm_size={runtime.shm_size} is over half of host memory ({mem_total / GIB:.0f} GiB)",
            "lower --set runtime.shm_size",
        )
    return Outcome("ok", f"private /dev/shm of {runtime.shm_size} (host memory {mem_total / GIB:.0f} GiB)")


SHM_FLOOR = GIB  # NCCL's shared-memory transport needs more than Docker's 64 MB; 1 GiB is a floor


def memlock(ctx: Context) -> Outcome:
    """The plan's ulimits and /dev/shm, tried for real: a throwaway container of the engine image
    with exactly those settings (dockerd's own limits decide, not this shell's)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    host = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"
    deployment = ctx.deployment
    if deployment is None or not deployment.plan.settings.runtime.ulimits:
        return Outcome("ok", f"host locked-memory limit {host}; the plan sets no ulimits")
    from m31ctl.container import container_spec
    from m31ctl.runtime.docker import trial_run

    client = ctx.engine()
    spec = container_spec(deployment)
    if local_image(client, spec.image) is None:
        return Outcome("skip", f"{spec.image} is not here to try the ulimits with (launch will)")
    error = trial_run(client, spec)
    wanted = ", ".join(f"{n}={s}" for n, s, _h in spec.ulimits) or "none"
    if error:
        return Outcome(
            "fail",
            f"the Docker Engine refuses the plan's ulimits ({wanted}): {error[:200]}",
            "raise dockerd's limits (LimitMEMLOCK=infinity in its systemd unit) or --set runtime.ulimits={}",
        )
    return Outcome("ok", f"a container with ulimits {wanted} and the plan's /dev/shm starts")


def port(ctx: Context) -> Outcome:
    network = ctx.require_deployment().network
    if not port_free(network.bind, network.port):
        return Outcome(
            "fail",
            f"port {network.bind}:{network.port} is in use",
            "stop what listens there or pass --port / --set runtime.port=...",
        )
    return Outcome("ok", f"port {network.bind}:{network.port} is free")


def hf_token(ctx: Context) -> Outcome:
    deployment = ctx.require_deployment()
    if _checkpoint(ctx)[0] == "complete":
        return Outcome("ok", "checkpoint cached; no token needed to start")
    token_file = Path(deployment.hf_cache) / "token"
    if any(ctx.env.get(name) for name in SECRET_ENV if name != deployment.secrets.api_key):
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
    findings = validate(build_invocation(ctx.require_deployment()), schema_from_data(data, name))
    if findings:
        return Outcome(
            "fail",
            f"the image's vLLM {data.get('version')} would reject {findings[0].line()}"
            + (f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""),
            "fix the setting, or use an image whose vLLM supports it",
        )
    return Outcome("ok", f"argv and environment match the vLLM {data.get('version')} inside {name}")


def api_key(ctx: Context) -> Outcome:
    name = ctx.require_deployment().secrets.api_key
    if name is None:
        return Outcome("ok", "the server takes no API key (loopback only)")
    if ctx.env.get(name):
        return Outcome("ok", f"{name} is set (not shown)")
    return Outcome(
        "fail",
        f"runtime.api_key is set but {name} is not in the environment",
        f"export {name} (m31ctl passes it by reference, never in argv)",
    )


def capacity(ctx: Context) -> Outcome:
    deployment = ctx.require_deployment()
    from m31ctl.capacity.fit import capacity_warning, plan_fit

    warning = capacity_warning(deployment)
    if warning:
        return Outcome("warn", warning, "lower serving.max_model_len / max_num_seqs or add GPUs")
    fit = plan_fit(deployment)
    basis = fit.sequences_published_basis
    published = "" if basis is None else f"; {basis} on the launch post's basis (main attention only)"
    return Outcome(
        "ok",
        f"{fit.sequences} sequences of {fit.context} tokens fit ({fit.layout}, "
        f"{fit.kv_cache_tokens:,} KV tokens per engine){published}",
    )


# --- doctor --deep: in the engine, on the plan's GPUs ----------------------------------------------

COLLECTIVE_SCRIPT = Path(__file__).resolve().parent.parent / "engine" / "collective_check.py"
DEEP_TIMEOUT_S = 180.0
DEEP_TIMEOUT_ENV = "M31CTL_DEEP_TIMEOUT_S"  # a shorter bound for the all-reduce (tests, impatient CI)


def _deep_timeout(env: Mapping[str, str]) -> float:
    try:
        value = float(env.get(DEEP_TIMEOUT_ENV, DEEP_TIMEOUT_S))
    except ValueError:
        return DEEP_TIMEOUT_S
    return value if 0 < value <= DEEP_TIMEOUT_S else DEEP_TIMEOUT_S


_NCCL_WARN = re.compile(r"NCCL (WARN|INFO.*(error|fail))|RCCL|ProcessGroup|Traceback|Error", re.IGNORECASE)


def _collective_shape(deployment: Deployment) -> tuple[int, str, int]:
    """(world size, backend, MiB) from the vendor's row: the plan's tensor-parallel group on one
    node over NCCL on GPUs (RCCL answers to the same name on ROCm), two gloo ranks on the CPU."""
    facts = deployment.vendor
    layout = deployment.layout
    world = facts.collective_ranks or min(layout.tensor, deployment.hardware.count or 1)
    return max(1, world), facts.collective_backend or "gloo", facts.collective_mib


def deep_probe(ctx: Context) -> dict[str, Any]:
    """Run collective_check.py once per doctor run, where --deep says: in the engine image with
    launch's container settings, or with the native runtime's Python."""
    deployment = ctx.require_deployment()
    plan = deployment.plan
    timeout = _deep_timeout(ctx.env)

    def run() -> dict[str, Any]:
        world, backend, mib = _collective_shape(deployment)
        args = ["--world", str(world), "--backend", backend, "--mib", str(mib)]
        started = time.monotonic()
        if ctx.deep == "native":
            python = plan.settings.runtime.native_python or sys.executable
            env = {**os.environ, **dict(plan.settings.runtime.env)}
            code, out, err = _run_group([python, str(COLLECTIVE_SCRIPT), *args], env, timeout)
        else:
            from m31ctl.container import container_spec
            from m31ctl.runtime.docker import run_in_engine

            client = ctx.engine()
            spec = container_spec(deployment)
            if local_image(client, spec.image) is None:
                raise SkipCheck(f"{spec.image} is not here to run the check in", "pull it, or --deep native")
            try:
                code, out, err = run_in_engine(
                    client,
                    spec,
                    ["python3", "/m31ctl/collective_check.py", *args],
                    {str(COLLECTIVE_SCRIPT.parent): "/m31ctl"},
                    timeout,
                )
            except Exception as exc:
                text = explanation(exc)
                if "executable file not found" in text or "no such file or directory" in text.lower():
                    # Every vLLM image has python3; an image without it is not an engine.
                    raise SkipCheck(f"{spec.image} has no python3 to run the check with") from None
                raise
        result: dict[str, Any] = {
            "exit_code": code,
            "stderr": err[-4000:],
            "seconds": round(time.monotonic() - started, 2),
        }
        for line in out.strip().splitlines():  # {"engine": ...} then {"collective": ...}
            with contextlib.suppress(ValueError):  # not a report line: the stderr says why
                part = json.loads(line)
                if isinstance(part, dict):
                    result.update(part)
        return result

    found: dict[str, Any] = ctx.once("deep", run)
    return found


def _run_group(argv: list[str], env: Mapping[str, str], timeout: float) -> tuple[int | None, str, str]:
    """Run in a session of its own, so a hang is ended with every rank it spawned (exit None)."""
    import signal

    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(env), start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err


def _likely_cause(stderr: str) -> str:
    text = stderr.lower()
    if "no module named 'torch'" in text:
        return "this Python has no PyTorch: it cannot run vLLM (runtime.native_python)"
    if "no space left" in text or "shm" in text:
        return "shared memory: /dev/shm is too small (runtime.shm_size)"
    if "peer" in text or "p2p" in text or "acs" in text:
        return "GPU peer-to-peer access (P2P/ACS) is blocked"
    if "invalid device ordinal" in text or "no cuda-capable device" in text or "no hip" in text:
        return "the GPUs are not visible in the container (device request, *_VISIBLE_DEVICES)"
    if "executable file not found" in text or ("no such file" in text and "python3" in text):
        return "the image has no python3: not a vLLM image"
    return "see the NCCL lines above (NCCL_DEBUG=INFO for more)"


def engine_image(ctx: Context) -> Outcome:
    deployment = ctx.require_deployment()
    data = deep_probe(ctx)
    engine = data.get("engine")
    if not isinstance(engine, dict):
        return Outcome("fail", f"the engine's Python did not report (exit {data.get('exit_code')}): "
                       f"{_likely_cause(data.get('stderr', ''))}", "run `m31ctl doctor --deep --json` for its stderr")  # fmt: skip
    versions = f"torch {engine.get('torch')}, vLLM {engine.get('vllm')}"
    if not engine.get("vllm"):
        return Outcome(
            "fail",
            f"{versions}: this Python cannot serve ({engine.get('vllm_error', 'vLLM not importable')})",
            "install vLLM there (pip install 'm31ctl[vllm]'), or use the engine image",
        )
    if not deployment.vendor.gpus:
        return Outcome("ok", f"{versions} (CPU)")
    runtime = engine.get("hip_runtime") or engine.get("cuda_runtime")
    versions += f", {'HIP' if engine.get('hip_runtime') else 'CUDA'} {runtime}"
    world, _backend, _mib = _collective_shape(deployment)
    if not engine.get("accelerator") or int(engine.get("device_count") or 0) < world:
        return Outcome("fail", f"{versions}; {engine.get('device_count', 0)} GPUs visible, the plan needs {world}",
                       "check the GPU runtime (nvidia-container-toolkit / /dev/kfd) and *_VISIBLE_DEVICES")  # fmt: skip
    missing = [d["arch"] for d in engine.get("devices", []) if not d.get("kernels")]
    if missing:
        return Outcome("fail", f"{versions}; no kernels for {', '.join(sorted(set(missing)))} in {engine.get('arch_list')}",
                       "use an image built for this GPU architecture")  # fmt: skip
    host_cuda = ctx.probe.hardware.cuda_driver_version
    if (
        engine.get("cuda_runtime")
        and host_cuda
        and _version_tuple(host_cuda) < _version_tuple(str(engine["cuda_runtime"]))
    ):
        return Outcome("fail", f"{versions}; the host driver supports CUDA {host_cuda} only",
                       "upgrade the driver")  # fmt: skip
    archs = ", ".join(sorted({d["arch"] for d in engine.get("devices", [])}))
    return Outcome("ok", f"{versions}; {engine.get('device_count')} GPUs ({archs}) initialise with kernels")


def collective(ctx: Context) -> Outcome:
    data = deep_probe(ctx)
    result = data.get("collective") or {}
    stderr = str(data.get("stderr") or "")
    lines = [ln for ln in stderr.splitlines() if _NCCL_WARN.search(ln)][-3:]
    where = "in the engine image" if ctx.deep != "native" else "natively"
    if data.get("exit_code") is None:
        cause = (
            _likely_cause(stderr)
            if lines
            else "a rank never joined the group, or the all-reduce never finished"
        )
        return Outcome("fail", f"the all-reduce {where} hung past {_deep_timeout(ctx.env):.0f} s: {cause}",
                       "; ".join(lines) or "rerun with NCCL_DEBUG=INFO")  # fmt: skip
    if data.get("exit_code") != 0 or not result.get("correct") or any(result.get("exit_codes") or [1]):
        return Outcome("fail", f"the all-reduce {where} failed (exit {data.get('exit_code')}): {_likely_cause(stderr)}",
                       "; ".join(lines) or "rerun with NCCL_DEBUG=INFO")  # fmt: skip
    bus = result.get("busbw_gbps")
    speed = f"{bus:.1f} GB/s bus bandwidth" if isinstance(bus, (int, float)) else "one rank, no exchange"
    return Outcome(
        "ok",
        f"{result.get('backend')} all-reduce over {result.get('world')} ranks {where}: "
        f"{speed} ({result.get('bytes', 0) // 2**20} MiB, init {result.get('init_s')} s)",
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
        Check("memlock", "Ulimits and /dev/shm, tried", memlock, timeout_s=15),
        Check("checkpoint", "Checkpoint complete", checkpoint, timeout_s=5),
        Check("port", "Port", port, timeout_s=1),
        Check("hf-token", "Hugging Face token", hf_token, timeout_s=1),
        Check("api-key", "API key", api_key, timeout_s=1),
        Check("image", "Engine image", image, timeout_s=8),
        Check("capacity", "KV capacity", capacity, timeout_s=2),
        Check("engine", "Engine accepts the argv", engine, timeout_s=120),
        Check(
            "engine-image",
            "Engine on the plan's GPUs",
            engine_image,
            timeout_s=DEEP_TIMEOUT_S + 30,
            deep=True,
        ),
        Check(
            "collective",
            "All-reduce on the plan's GPUs",
            collective,
            timeout_s=DEEP_TIMEOUT_S + 30,
            deep=True,
        ),
    ]


__all__ = ["M31Error", "all_checks"]
