"""The real probe on a real GPU host (the lent H200 machine); skipped elsewhere."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from m31ctl.plan.catalog import select_recipe
from m31ctl.probe import detect
from m31ctl.probe.nvidia import NvidiaSmiProbe, NvmlProbe
from tests.support import cli_json

pytestmark = pytest.mark.gpu


def smi_count_and_mib() -> tuple[int, int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return len(out), int(out[0])


def test_real_probe_matches_nvidia_smi_and_selects_hopper():
    count, mib = smi_count_and_mib()
    hw = detect(env={}).hardware
    assert hw.count == count and hw.source == "nvml"
    assert hw.memory_per_gpu_bytes == mib * 1024 * 1024
    assert hw.family == "hopper" and hw.arch == "9.0"
    assert select_recipe(hw).recipe == "hopper"
    if count >= 2:
        assert hw.nvlink is True


def test_nvml_and_nvidia_smi_agree():
    a = detect([NvmlProbe()], env={}).hardware
    b = detect([NvidiaSmiProbe()], env={}).hardware
    assert (a.count, a.arch, a.product, a.memory_per_gpu_bytes, a.nvlink, a.driver_version) == (
        b.count,
        b.arch,
        b.product,
        b.memory_per_gpu_bytes,
        b.nvlink,
        b.driver_version,
    )


def test_visible_devices_on_real_host(cli):
    result = cli("probe", "--json", env={"CUDA_VISIBLE_DEVICES": "0"})
    data = cli_json.data(result.stdout)
    assert data["hardware"]["count"] == 1 and data["hardware"]["nvlink"] is None


def _python_with_vllm() -> str | None:
    """The host's own Python when it has vLLM (the GPU rehearsal serves with it)."""
    import shutil

    python = shutil.which("python3")
    if python is None:
        return None
    found = subprocess.run([python, "-c", "import vllm"], capture_output=True, check=False)
    return python if found.returncode == 0 else None


@pytest.mark.slow
@pytest.mark.vllm
def test_gpu_rehearsal_serves_and_verifies_on_this_gpu(cli, tmp_path):
    """The rehearsal recipe on this host's GPU with its own vLLM, through launch, verify and stop
    (scripts/device-gpu-rehearsal does the whole capture; tests/test_gpu_rehearsal.py replays it)."""
    python = _python_with_vllm()
    if python is None:
        pytest.skip("this host's python3 has no vLLM (scripts/device-vllm install)")
    model = tmp_path / "model"
    subprocess.run(
        [
            python,
            str(Path(__file__).resolve().parent.parent / "m31ctl" / "rehearsal" / "make_tiny_model.py"),
            str(model),
        ],
        check=True,
        capture_output=True,
    )
    plan = ["--recipe", "cpu", "--set", f"model.path={model}", "--set", "engine.image=vllm/vllm-openai:v0.26.0",
            "--set", f"runtime.native_python={python}", "--set", "serving.max_model_len=1024",
            "--set", "serving.gpu_memory_utilization=0.1", "--set", "cache.kv_dtype=fp8",
            "--set", "cache.block_size=128"]  # fmt: skip
    env = {
        "M31CTL_STATE_DIR": str(tmp_path / "state"),
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
        "NCCL_NVLS_ENABLE": "0",
    }
    launched = cli("launch", *plan, "--runtime", "native", "--yes", "--no-pull", "--json", env=env)
    try:
        assert launched.returncode == 0, launched.stderr[-2000:]
        verified = cli("verify", *plan, "--runtime", "native", "--json", env=env)
        checks = {c["id"]: c for c in cli_json.data(verified.stdout)["checks"]}
        assert checks["kv-cache-dtype"]["status"] == "ok" and checks["block-size"]["status"] == "ok"
    finally:
        cli("stop", "--runtime", "native", env=env)
