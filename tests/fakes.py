"""Fakes at the probe seams. Their answers come from real captures (tests/fixtures/gpu)."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from m31ctl.probe.snapshot import CommandResult, ProbeUnavailable

GPU_FIXTURES = Path(__file__).parent / "fixtures" / "gpu"


class FakeNVMLError(Exception):
    pass


class FabricInfo(ctypes.Structure):
    """Same fields as pynvml's c_nvmlGpuFabricInfo_v2_t."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_uint8 * 16),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint8),
        ("healthMask", ctypes.c_uint32),
    ]


class FakeNvml:
    """Answers like pynvml from a capture in the format of nvidia-h200x2/nvml.json."""

    NVMLError = FakeNVMLError
    NVML_P2P_CAPS_INDEX_NVLINK = 4  # pynvml's values
    NVML_P2P_STATUS_OK = 0
    NVML_P2P_STATUS_NOT_SUPPORTED = 5

    def __init__(self, capture: dict[str, Any], init_error: str | None = None) -> None:
        self.capture = capture
        self.init_error = init_error
        self.gpus = capture["gpus"]

    @classmethod
    def from_file(cls, path: Path) -> FakeNvml:
        return cls(json.loads(path.read_text()))

    def nvmlInit(self) -> None:
        if self.init_error:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        pass

    def nvmlSystemGetDriverVersion(self) -> str:
        return str(self.capture["driver"])

    def nvmlSystemGetCudaDriverVersion_v2(self) -> int:
        return int(self.capture["cuda_driver"])

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return str(self.gpus[h]["name"])

    def nvmlDeviceGetCudaComputeCapability(self, h: int) -> tuple[int, int]:
        major, minor = self.gpus[h]["cc"]
        return int(major), int(minor)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> SimpleNamespace:
        g = self.gpus[h]
        return SimpleNamespace(total=g["mem_total"], free=g["mem_free"])

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return str(self.gpus[h]["uuid"])

    def nvmlDeviceGetPciInfo(self, h: int) -> SimpleNamespace:
        g = self.gpus[h]
        return SimpleNamespace(pciDeviceId=int(g["pci_device_id"], 16), busId=g["bus_id"])

    def nvmlDeviceGetMigMode(self, h: int) -> tuple[int, int]:
        mig = self.gpus[h].get("mig")
        if mig is None:
            raise FakeNVMLError("Not Supported")
        return int(mig[0]), int(mig[1])

    c_nvmlGpuFabricInfo_v2_t = FabricInfo

    def nvmlDeviceGetGpuFabricInfoV(self, h: int, ref: Any) -> int:
        fabric = self.gpus[h].get("fabric")
        if not isinstance(fabric, dict):
            raise FakeNVMLError("Not Supported")
        info = ref._obj
        info.state, info.status, info.cliqueId = fabric["state"], fabric["status"], fabric["clique_id"]
        info.clusterUuid[:] = list(bytes.fromhex(fabric["cluster_uuid"].replace("-", "")))
        return 0

    def nvmlDeviceGetP2PStatus(self, a: int, b: int, cap: int) -> int:
        assert cap == self.NVML_P2P_CAPS_INDEX_NVLINK
        matrix = self.capture.get("p2p_nvlink")
        if matrix is not None:
            return self.NVML_P2P_STATUS_OK if matrix[a][b] else self.NVML_P2P_STATUS_NOT_SUPPORTED
        linked = all(self.gpus[a].get("nvlink_states") or [0]) and all(
            self.gpus[b].get("nvlink_states") or [0]
        )
        return self.NVML_P2P_STATUS_OK if linked else self.NVML_P2P_STATUS_NOT_SUPPORTED


class FakeRunner:
    """Answers probe commands from canned outputs; unknown commands are 'not found'."""

    def __init__(self, answers: dict[tuple[str, ...], CommandResult]) -> None:
        self.answers = answers
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str]) -> CommandResult:
        self.calls.append(list(argv))
        for prefix, result in self.answers.items():
            if tuple(argv[: len(prefix)]) == prefix:
                return result
        raise ProbeUnavailable(f"{argv[0]} not found on PATH")


class FakeAmdSmi:
    """Answers like the amdsmi module; values from the public MI350X sample."""

    def __init__(self, gpus: list[dict[str, Any]], xgmi: bool = True, init_error: str | None = None) -> None:
        self.gpus = gpus
        self.xgmi = xgmi
        self.init_error = init_error

    def amdsmi_init(self) -> None:
        if self.init_error:
            raise RuntimeError(self.init_error)

    def amdsmi_shut_down(self) -> None:
        pass

    def amdsmi_get_processor_handles(self) -> list[int]:
        return list(range(len(self.gpus)))

    def amdsmi_get_gpu_asic_info(self, h: int) -> dict[str, Any]:
        return self.gpus[h]["asic"]

    def amdsmi_get_gpu_vram_info(self, h: int) -> dict[str, Any]:
        return {"vram_size": self.gpus[h]["vram_mb"]}

    def amdsmi_get_gpu_driver_info(self, h: int) -> dict[str, Any]:
        return {"driver_version": "6.12.12"}

    def amdsmi_topo_get_link_type(self, a: int, b: int) -> dict[str, Any]:
        return {"hops": 1, "type": 2 if self.xgmi else 1}
