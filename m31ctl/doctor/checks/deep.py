"""doctor --deep: the engine's own Python on the plan's GPUs (engine-image, collective). Each
check here only judges a typed probe (m31ctl/doctor/engine_probe.py); how the probe runs is the
runtime's business (Runtime.run_engine_script)."""

from __future__ import annotations

import re

from m31ctl.checks import CheckStatus
from m31ctl.deployment import Deployment
from m31ctl.doctor.base import CheckContext, Outcome
from m31ctl.doctor.checks.host import version_tuple
from m31ctl.doctor.engine_probe import DeepProbe, collective_shape, deep_probe, deep_timeout

_NCCL_WARN = re.compile(r"NCCL (WARN|INFO.*(error|fail))|RCCL|ProcessGroup|Traceback|Error", re.IGNORECASE)


def likely_cause(stderr: str) -> str:
    """The probe's stderr read for the usual reasons an engine or a collective fails."""
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


def judge_engine(deployment: Deployment, host_cuda: str | None, probe: DeepProbe) -> Outcome:
    """Can this engine serve the plan on these GPUs: vLLM importable, the plan's GPUs visible,
    kernels for their architecture, and a host driver new enough for the engine's CUDA."""
    engine = probe.engine
    if engine is None:
        return Outcome(
            CheckStatus.FAIL,
            f"the engine's Python did not report (exit {probe.run.exit_code}): {likely_cause(probe.run.stderr)}",
            "run `m31ctl doctor --deep --json` for its stderr",
        )
    versions = f"torch {engine.torch}, vLLM {engine.vllm}"
    if not engine.vllm:
        return Outcome(
            CheckStatus.FAIL,
            f"{versions}: this Python cannot serve ({engine.vllm_error or 'vLLM not importable'})",
            "install vLLM there (pip install 'm31ctl[vllm]'), or use the engine image",
        )
    if not deployment.vendor.gpus:
        return Outcome(CheckStatus.OK, f"{versions} (CPU)")
    versions += f", {'HIP' if engine.hip_runtime else 'CUDA'} {engine.hip_runtime or engine.cuda_runtime}"
    world, _backend, _mib = collective_shape(deployment)
    if not engine.accelerator or engine.device_count < world:
        return Outcome(
            CheckStatus.FAIL,
            f"{versions}; {engine.device_count} GPUs visible, the plan needs {world}",
            "check the GPU runtime (nvidia-container-toolkit / /dev/kfd) and *_VISIBLE_DEVICES",
        )
    missing = sorted({d.arch for d in engine.devices if not d.kernels})
    if missing:
        return Outcome(
            CheckStatus.FAIL,
            f"{versions}; no kernels for {', '.join(missing)} in {list(engine.arch_list)}",
            "use an image built for this GPU architecture",
        )
    if engine.cuda_runtime and host_cuda and version_tuple(host_cuda) < version_tuple(engine.cuda_runtime):
        return Outcome(
            CheckStatus.FAIL,
            f"{versions}; the host driver supports CUDA {host_cuda} only",
            "upgrade the driver",
        )
    archs = ", ".join(sorted({d.arch for d in engine.devices}))
    return Outcome(
        CheckStatus.OK, f"{versions}; {engine.device_count} GPUs ({archs}) initialise with kernels"
    )


def judge_collective(probe: DeepProbe, bound_s: float) -> Outcome:
    """Did the all-reduce finish, on every rank, with the right sum; how fast was it. A hang is
    the script's own finding (its bound counts from the moment every rank started, so a slow
    start-up is never one); a run killed from outside never finished starting."""
    run, result = probe.run, probe.collective
    lines = [ln for ln in run.stderr.splitlines() if _NCCL_WARN.search(ln)][-3:]
    remedy = "; ".join(lines) or "rerun with NCCL_DEBUG=INFO"
    if result is not None and result.timed_out:
        cause = (
            likely_cause(run.stderr)
            if lines
            else "a rank never joined the group, or the all-reduce never finished"
        )
        bound = result.bound_s if result.bound_s is not None else bound_s
        return Outcome(
            CheckStatus.FAIL, f"the all-reduce {run.where} hung past {bound:.0f} s: {cause}", remedy
        )
    if run.timed_out:
        cause = likely_cause(run.stderr) if lines else "the engine's Python or a rank never finished starting"
        return Outcome(
            CheckStatus.FAIL,
            f"the collective check {run.where} did not finish in {run.seconds:.0f} s: {cause}",
            remedy,
        )
    if run.exit_code != 0 or result is None or not result.correct or not result.ranks_ok:
        return Outcome(
            CheckStatus.FAIL,
            f"the all-reduce {run.where} failed (exit {run.exit_code}): {likely_cause(run.stderr)}",
            "; ".join(lines) or "rerun with NCCL_DEBUG=INFO",
        )
    bus = result.busbw_gbps
    speed = f"{bus:.1f} GB/s bus bandwidth" if bus is not None else "one rank, no exchange"
    return Outcome(
        CheckStatus.OK,
        f"{result.backend} all-reduce over {result.world} ranks {run.where}: "
        f"{speed} ({result.bytes // 2**20} MiB, init {result.init_s} s)",
    )


def engine_image(ctx: CheckContext) -> Outcome:
    deployment = ctx.require_deployment()
    return judge_engine(deployment, ctx.probe.hardware.cuda_driver_version, deep_probe(ctx))


def collective(ctx: CheckContext) -> Outcome:
    return judge_collective(deep_probe(ctx), deep_timeout(ctx.env))
