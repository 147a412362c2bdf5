"""The real probe on a real GPU host (the lent H200 machine); skipped elsewhere."""

from __future__ import annotations

import json
import subprocess

import pytest

from m31ctl.plan.recipes import select_recipe
from m31ctl.probe import detect
from m31ctl.probe.nvidia import NvidiaSmiProbe, NvmlProbe

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
    data = json.loads(result.stdout)
    assert data["hardware"]["count"] == 1 and data["hardware"]["nvlink"] is None
