"""The probe on real captures (tests/fixtures/gpu) and the public samples."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest

from m31ctl.errors import InputError, UnsupportedHardware
from m31ctl.hardware import family_for, normalize_arch
from m31ctl.plan.catalog import select_recipe
from m31ctl.probe import detect
from m31ctl.probe.amd import AmdSmiProbe, KfdSysfsProbe, gfx_from_target_version
from m31ctl.probe.nvidia import (
    NvidiaSmiProbe,
    NvmlProbe,
    gpus_from_smi,
    healthy_fabric,
    nvlink_pairs_from_topo,
)
from m31ctl.probe.snapshot import CommandResult
from tests.fakes import GPU_FIXTURES, FakeAmdSmi, FakeNvml, FakeRunner
from tests.support import cli_json

H200 = GPU_FIXTURES / "nvidia-h200x2"
H200_MEM = 150754820096


def nvml_h200() -> FakeNvml:
    return FakeNvml.from_file(H200 / "nvml.json")


def smi_runner(query: str | None = None, topo: str | None = None) -> FakeRunner:
    return FakeRunner(
        {
            ("nvidia-smi", "topo"): CommandResult(
                0, topo if topo is not None else (H200 / "nvidia-smi-topo.txt").read_text(), ""
            ),
            ("nvidia-smi",): CommandResult(
                0, query if query is not None else (H200 / "nvidia-smi-query.csv").read_text(), ""
            ),
        }
    )


def test_nvml_on_real_h200x2_capture():
    report = detect([NvmlProbe(nvml_h200())], env={})
    hw = report.hardware
    assert (hw.vendor, hw.family, hw.arch, hw.product) == ("nvidia", "hopper", "9.0", "NVIDIA H200")
    assert hw.count == 2 and hw.memory_per_gpu_bytes == H200_MEM
    assert hw.driver_version == "580.159.04" and hw.cuda_driver_version == "13.0"
    assert hw.nvlink is True and hw.mig_enabled is False and hw.fabric is None
    assert hw.gpus[0].pci_device_id == "0x2335" and hw.gpus[1].uuid.startswith("GPU-d787c64f")
    assert select_recipe(hw).recipe == "hopper"


def test_nvidia_smi_fallback_on_real_capture():
    missing = FakeNvml.from_file(H200 / "nvml.json")
    missing.init_error = "NVML Shared Library Not Found"
    report = detect([NvmlProbe(missing), NvidiaSmiProbe(smi_runner())], env={})
    hw = report.hardware
    assert hw.source == "nvidia-smi" and hw.family == "hopper" and hw.count == 2
    assert hw.memory_per_gpu_bytes == 143771 * 1024 * 1024  # nvidia-smi reports MiB
    assert hw.nvlink is True and hw.driver_version == "580.159.04" and hw.mig_enabled is False
    assert report.attempts[0].ok is False and "Library Not Found" in report.attempts[0].detail


def test_topology_parse_real_capture():
    assert nvlink_pairs_from_topo((H200 / "nvidia-smi-topo.txt").read_text()) == {(0, 1)}
    pcie = "\tGPU0\tGPU1\nGPU0\t X \tSYS\nGPU1\tSYS\t X \n"
    assert nvlink_pairs_from_topo(pcie) == frozenset()


def test_old_driver_without_compute_cap_field():
    # Driver 470 answers "Field "compute_cap" is not a valid field to query." (public sample).
    legacy_row = "0, NVIDIA H100 80GB HBM3, GPU-1, 00000000:01:00.0, 0x233010DE, 81559, 0, 81000, 470.182.03, Disabled, 700.00, 1980\n"

    class OldSmi(FakeRunner):
        def __call__(self, argv):  # type: ignore[no-untyped-def]
            self.calls.append(list(argv))
            if argv[1] == "topo":
                return CommandResult(0, "", "")
            if "compute_cap" in argv[1]:
                return CommandResult(2, 'Field "compute_cap" is not a valid field to query.\n', "")
            return CommandResult(0, legacy_row, "")

    hw = detect([NvidiaSmiProbe(OldSmi({}))], env={}).hardware
    assert hw.arch == "9.0" and hw.family == "hopper" and hw.driver_version == "470.182.03"
    assert any("compute_cap" in n for n in hw.notes)


NAMES = ("NVIDIA H200", "AMD Instinct MI355X", "NVIDIA Unknown")


def test_arch_from_name_matches_only_cuda_products():
    """Without compute_cap the architecture comes from the product name, among the products whose
    vendor row runs CUDA (the vendor row decides, not the shape of the arch string)."""
    rows = [{"index": str(i), "name": name, "memory.total": "1024"} for i, name in enumerate(NAMES)]
    assert [gpu.arch for gpu in gpus_from_smi(rows)] == ["9.0", None, None]


def test_no_gpu_is_a_normal_answer_with_reasons():
    nvml = nvml_h200()
    nvml.init_error = "Driver Not Loaded"
    report = detect(
        [NvmlProbe(nvml), NvidiaSmiProbe(FakeRunner({})), KfdSysfsProbe(GPU_FIXTURES / "absent")], env={}
    )
    assert report.hardware.count == 0
    details = [a.detail for a in report.attempts]
    assert "NVML: Driver Not Loaded" in details[0]
    assert "not found" in details[1] and "amdgpu driver not loaded" in details[2]
    with pytest.raises(UnsupportedHardware, match="no GPU"):
        select_recipe(report.hardware)


@pytest.mark.parametrize(
    ("env", "count", "nvlink"),
    [
        ({"CUDA_VISIBLE_DEVICES": "1"}, 1, None),
        ({"CUDA_VISIBLE_DEVICES": "GPU-d787c64f"}, 1, None),
        ({"CUDA_VISIBLE_DEVICES": "0,1"}, 2, True),
        ({"NVIDIA_VISIBLE_DEVICES": "all"}, 2, True),
        ({"NVIDIA_VISIBLE_DEVICES": "none"}, 0, None),
        ({"CUDA_VISIBLE_DEVICES": ""}, 0, None),
        ({"NVIDIA_VISIBLE_DEVICES": "1", "CUDA_VISIBLE_DEVICES": "0"}, 1, None),
    ],
)
def test_visible_devices_are_honoured(env, count, nvlink):
    report = detect([NvmlProbe(nvml_h200())], env=env)
    assert report.hardware.count == count
    assert report.hardware.nvlink is nvlink
    if env.get("NVIDIA_VISIBLE_DEVICES") == "1":
        assert report.hardware.gpus[0].uuid.startswith("GPU-d787c64f")


def test_visible_devices_naming_absent_gpu():
    with pytest.raises(InputError, match="CUDA_VISIBLE_DEVICES"):
        detect([NvmlProbe(nvml_h200())], env={"CUDA_VISIBLE_DEVICES": "5"})


def test_mixed_models_refused_unless_picked():
    # compute_cap sample [triton-inference-server/server#8070]: a TITAN V beside an RTX 5880 Ada.
    capture = json.loads((H200 / "nvml.json").read_text())
    capture["gpus"][0].update(name="NVIDIA TITAN V", cc=[7, 0])
    capture["gpus"][1].update(name="NVIDIA RTX 5880 Ada Generation", cc=[8, 9])
    with pytest.raises(UnsupportedHardware, match="mixes GPU models"):
        detect([NvmlProbe(FakeNvml(capture))], env={})
    picked = detect([NvmlProbe(FakeNvml(capture))], env={"CUDA_VISIBLE_DEVICES": "1"}).hardware
    with pytest.raises(UnsupportedHardware, match="Ada Lovelace"):
        select_recipe(picked)


def _with_fabric(state: int, status: int, clique: int, uuid: str) -> FakeNvml:
    capture = copy.deepcopy(json.loads((H200 / "nvml.json").read_text()))
    for gpu in capture["gpus"]:
        gpu.update(
            name="NVIDIA GB200",
            cc=[10, 0],
            fabric={"state": state, "status": status, "clique_id": clique, "cluster_uuid": uuid},
        )
    return FakeNvml(capture)


def test_fabric_membership_only_when_healthy():
    # GB200 NVL72, healthy [kubernetes-sigs/dra-driver-nvidia-gpu#626]
    hw = detect([NvmlProbe(_with_fabric(3, 0, 2, "dc6e40c4-d722-4357-9ba6-5291dd461278"))], env={}).hardware
    assert hw.fabric is not None and hw.fabric.clique_id == 2
    assert hw.fabric.cluster_uuid == "dc6e40c4-d722-4357-9ba6-5291dd461278"
    assert hw.family == "blackwell"
    # Insufficient Resources [Azure/azhpc-images#506]: NVML status is an error code, not SUCCESS
    assert detect([NvmlProbe(_with_fabric(3, 26, 0, "0" * 32))], env={}).hardware.fabric is None
    # Completed and Success but a zero cluster UUID, as the real H200 capture's -q shows: not a fabric
    assert healthy_fabric(3, 0, 0, "00000000-0000-0000-0000-000000000000") is None
    assert healthy_fabric(2, 0, 1, "dc6e40c4-d722-4357-9ba6-5291dd461278") is None  # still registering


@pytest.mark.parametrize(
    ("arch", "family"),
    [
        ("9.0", "hopper"),
        ("10.0", "blackwell"),
        ("10.3", "blackwell"),
        ("10.7", "rubin"),
        ("gfx950", "mi350"),
        ("gfx950:sramecc+:xnack-", "mi350"),
        ("12.0", None),
        ("12.1", None),
        ("11.0", None),
        ("gfx942", None),
        ("8.9", None),
    ],
)
def test_family_on_major_and_minor(arch, family):
    fam = family_for(arch)
    assert (fam.id if fam else None) == family


def test_rubin_pre_release_name_is_still_rubin():
    capture = json.loads((H200 / "nvml.json").read_text())
    for gpu in capture["gpus"]:
        gpu.update(name="NVIDIA Graphics Device", cc=[10, 7])
    hw = detect([NvmlProbe(FakeNvml(capture))], env={}).hardware
    assert hw.family == "rubin" and select_recipe(hw).recipe == "rubin"


def test_kfd_target_version_encoding():
    assert gfx_from_target_version(90500) == "gfx950"
    assert gfx_from_target_version(90402) == "gfx942"
    assert gfx_from_target_version(90010) == "gfx90a"
    assert normalize_arch("gfx950:sramecc+:xnack-") == "gfx950"


def test_kfd_sysfs_mi355x(tmp_path):
    root = tmp_path / "nodes"
    (root / "0").mkdir(parents=True)
    (root / "0" / "properties").write_text("cpu_cores_count 64\ngfx_target_version 0\n")
    for i in range(1, 9):
        node = root / str(i)
        (node / "mem_banks" / "0").mkdir(parents=True)
        (node / "properties").write_text(
            f"simd_count 1024\ngfx_target_version 90500\ndevice_id {0x75A3}\nlocation_id {i}\n"
        )
        (node / "mem_banks" / "0" / "properties").write_text(f"heap_type 1\nsize_in_bytes {288 * 2**30}\n")
    hw = detect([KfdSysfsProbe(root)], env={"ROCR_VISIBLE_DEVICES": "0,1,2,3"}).hardware
    assert (hw.vendor, hw.family, hw.arch, hw.count) == ("amd", "mi350", "gfx950", 4)
    assert hw.product == "AMD Instinct MI355X" and hw.memory_per_gpu_bytes == 288 * 2**30
    assert select_recipe(hw).recipe == "mi355x"


def test_amdsmi_mi350x_sample():
    # amd-smi static on MI350X [ROCm/rocm-systems#2987]
    gpu = {
        "asic": {
            "market_name": "AMD Instinct MI350X",
            "device_id": "0x75a0",
            "target_graphics_version": "gfx950",
        },
        "vram_mb": 294912,
    }
    hw = detect([AmdSmiProbe(FakeAmdSmi([gpu] * 8))], env={}).hardware
    assert hw.family == "mi350" and hw.count == 8 and hw.xgmi is True and hw.source == "amdsmi"
    hw = detect([AmdSmiProbe(FakeAmdSmi([gpu] * 8))], env={"HIP_VISIBLE_DEVICES": "2,3"}).hardware
    assert hw.count == 2


def test_amd_mi300x_is_refused_with_what_was_found():
    gpu = {
        "asic": {
            "market_name": "AMD Instinct MI300X",
            "device_id": "0x74a1",
            "target_graphics_version": "gfx942",
        },
        "vram_mb": 196608,
    }
    hw = detect([AmdSmiProbe(FakeAmdSmi([gpu] * 8))], env={}).hardware
    with pytest.raises(UnsupportedHardware, match=r"MI300X.*not supported by any recipe"):
        select_recipe(hw)


def test_cli_probe_without_gpu_exits_zero(cli, tmp_path):
    """A host where no method finds a GPU: exit 0 and every attempt listed. The tools' methods
    only, with nothing on PATH, so this holds on a GPU host too (where NVML would find one)."""
    methods = "nvidia-smi,amd-smi,rocm-smi"
    result = cli("probe", "--json", env={"PATH": str(tmp_path), "M31CTL_PROBE_METHODS": methods})
    assert result.returncode == 0, result.stderr
    data = cli_json.data(result.stdout)
    assert data["hardware"]["count"] == 0 and data["recipe"]["name"] is None
    assert [a["method"] for a in data["attempts"]] == methods.split(",")
    assert not any(a["ok"] for a in data["attempts"])


def test_amdsmi_missing_says_a_command_that_works_from_a_clone(cli, monkeypatch, tmp_path):
    """`pip install 'm31ctl[amd]'` asks the index for an m31ctl it has not got; the hint is the pip
    of the Python m31ctl runs in, with ROCm's own amdsmi where the host has one."""
    import sys

    from m31ctl.probe import amd
    from m31ctl.probe.snapshot import ProbeUnavailable

    monkeypatch.setitem(sys.modules, "amdsmi", None)  # `import amdsmi` raises ImportError
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ProbeUnavailable) as info:
        AmdSmiProbe().probe()
    said = str(info.value)
    assert "m31ctl[amd]" not in said and f"`{sys.executable} -m pip install amdsmi`" in said, said
    rocm = tmp_path / "amd_smi"
    rocm.mkdir()
    monkeypatch.setattr(amd, "ROCM_AMDSMI", rocm)
    with pytest.raises(ProbeUnavailable) as info:
        AmdSmiProbe().probe()
    assert f"-m pip install {rocm}` adds the copy this host's ROCm ships" in str(info.value)
    monkeypatch.setattr(amd, "ROCM_AMDSMI", tmp_path / "none")
    monkeypatch.chdir(Path(sys.executable).parents[2])  # in the clone: the venv's path as typed there
    shown = cli("probe", env={"COLUMNS": "80", "M31CTL_PROBE_METHODS": "amdsmi"}).stdout
    lines = shown.splitlines()
    assert all(len(line) <= 80 for line in lines), shown
    command = f"`{os.path.relpath(sys.executable)} -m pip install amdsmi`"
    assert any(command in line for line in lines), shown  # whole on one line, to be copied


DEVICE = GPU_FIXTURES / "device-h200x2"


def _as_recorded(actual: dict, recorded: dict) -> dict:  # type: ignore[type-arg]
    """`actual` without the fields added since the capture was recorded, where they hold their
    default (a field the probe did not fill then and cannot fill now, e.g. AMD's render_node, or
    `simulated`, False for every probed host)."""
    gpus = []
    for gpu, old in zip(actual.get("gpus", []), recorded.get("gpus", []), strict=False):
        gpus.append({k: v for k, v in gpu.items() if k in old or v is not None})
    top = {k: v for k, v in actual.items() if k in recorded or v not in (None, False)}
    return {**top, "gpus": gpus}


def test_replay_of_device_capture_matches_what_the_real_probe_printed():
    """The fake replays the NVML capture; its answer must equal the real probe's on that host."""
    capture = json.loads((DEVICE / "nvml-capture.json").read_text())
    recorded = cli_json.captured((DEVICE / "probe-2gpu.json").read_text())["hardware"]
    hw = detect([NvmlProbe(FakeNvml(capture))], env={"NVIDIA_VISIBLE_DEVICES": "all"}).hardware
    from m31ctl.cli.views import hardware_json

    assert _as_recorded(hardware_json(hw), recorded) == recorded
    one = cli_json.captured((DEVICE / "probe-1gpu.json").read_text())["hardware"]
    hw1 = detect([NvmlProbe(FakeNvml(capture))], env={"CUDA_VISIBLE_DEVICES": "0"}).hardware
    assert _as_recorded(hardware_json(hw1), one) == one


def test_device_smi_capture_agrees_with_nvml_capture():
    smi = detect(
        [
            NvidiaSmiProbe(
                smi_runner(
                    (DEVICE / "nvidia-smi-query.csv").read_text(),
                    (DEVICE / "nvidia-smi-topo.txt").read_text(),
                )
            )
        ],
        env={},
    ).hardware
    nvml = detect([NvmlProbe(FakeNvml.from_file(DEVICE / "nvml-capture.json"))], env={}).hardware
    assert (smi.count, smi.arch, smi.product, smi.memory_per_gpu_bytes, smi.nvlink, smi.driver_version) == (
        nvml.count,
        nvml.arch,
        nvml.product,
        nvml.memory_per_gpu_bytes,
        nvml.nvlink,
        nvml.driver_version,
    )
    assert [g.uuid for g in smi.gpus] == [g.uuid for g in nvml.gpus]


def test_replay_of_single_gpu_device_capture():
    single = GPU_FIXTURES / "device-h200x1"
    capture = json.loads((single / "nvml-capture.json").read_text())
    recorded = cli_json.captured((single / "probe-1gpu.json").read_text())["hardware"]
    hw = detect([NvmlProbe(FakeNvml(capture))], env={"NVIDIA_VISIBLE_DEVICES": "all"}).hardware
    from m31ctl.cli.views import hardware_json

    assert _as_recorded(hardware_json(hw), recorded) == recorded
    assert hw.count == 1 and hw.nvlink is None and hw.family == "hopper"


# amd-smi 6.1+ wraps its list in gpu_data; the vram block carries a value and a unit. Shapes as in
# public amd-smi output; values from the MI350X sample (public-samples.md).
AMD_SMI_STATIC = {
    "gpu_data": [
        {
            "gpu": i,
            "asic": {
                "market_name": "AMD Instinct MI350X",
                "device_id": "0x75a0",
                "target_graphics_version": "gfx950",
            },
            "vram": {"type": "HBM3E", "size": {"value": 294912, "unit": "MB"}},
            "driver": {"name": "amdgpu", "version": "6.12.12"},
        }
        for i in range(8)
    ]
}


def test_amd_smi_cli_fallback():
    from m31ctl.probe.amd import AmdSmiCliProbe

    runner = FakeRunner({("amd-smi",): CommandResult(0, json.dumps(AMD_SMI_STATIC), "")})
    hw = detect(
        [AmdSmiProbe(FakeAmdSmi([], init_error="amdsmi not found")), AmdSmiCliProbe(runner)], env={}
    ).hardware
    assert (hw.source, hw.family, hw.count, hw.driver_version) == ("amd-smi", "mi350", 8, "6.12.12")
    assert hw.memory_per_gpu_bytes == 294912 * 2**20
    older = FakeRunner({("amd-smi",): CommandResult(0, json.dumps(AMD_SMI_STATIC["gpu_data"][:4]), "")})
    assert detect([AmdSmiCliProbe(older)], env={}).hardware.count == 4


def test_rocm_smi_fallback_trusts_device_ids_over_gfx_strings():
    from m31ctl.probe.amd import RocmSmiProbe

    # rocm-smi prints gfx strings badly (gfx90a as gfx9010, public sample); the device id decides.
    cards = {
        f"card{i}": {
            "Card Series": "AMD Instinct MI355X",
            "Card Model": "0x75a3",
            "GFX Version": "gfx9500",
            "VRAM Total Memory (B)": str(288 * 2**30),
        }
        for i in range(4)
    }
    cards["system"] = {"Driver version": "6.12.12"}
    runner = FakeRunner({("rocm-smi",): CommandResult(0, json.dumps(cards), "")})
    hw = detect([RocmSmiProbe(runner)], env={}).hardware
    assert (hw.arch, hw.family, hw.count, hw.product) == ("gfx950", "mi350", 4, "AMD Instinct MI355X")
    assert select_recipe(hw).recipe == "mi355x"


def test_amd_cli_missing_is_a_reason_not_a_crash():
    from m31ctl.probe.amd import AmdSmiCliProbe, RocmSmiProbe

    report = detect([AmdSmiCliProbe(FakeRunner({})), RocmSmiProbe(FakeRunner({}))], env={})
    assert report.hardware.count == 0
    assert [a.detail for a in report.attempts] == ["amd-smi not found on PATH", "rocm-smi not found on PATH"]
