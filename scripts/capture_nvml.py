#!/usr/bin/env python3
"""Record what NVML answers on this host, in the format tests/fakes.py replays.

Run on a GPU host: python3 scripts/capture_nvml.py > nvml.json
"""

from __future__ import annotations

import ctypes
import json
import sys

import pynvml as nvml


def text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def main() -> None:
    nvml.nvmlInit()
    count = nvml.nvmlDeviceGetCount()
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    gpus = []
    for h in handles:
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        pci = nvml.nvmlDeviceGetPciInfo(h)
        try:
            mig: list[int] | None = list(nvml.nvmlDeviceGetMigMode(h))
        except nvml.NVMLError:
            mig = None
        try:
            info = nvml.c_nvmlGpuFabricInfo_v2_t()
            nvml.nvmlDeviceGetGpuFabricInfoV(h, ctypes.byref(info))
            raw = bytes(info.clusterUuid)
            h16 = raw.hex()
            fabric: dict[str, object] | str = {
                "state": int(info.state),
                "status": int(info.status),
                "clique_id": int(info.cliqueId),
                "cluster_uuid": f"{h16[:8]}-{h16[8:12]}-{h16[12:16]}-{h16[16:20]}-{h16[20:32]}",
            }
        except (nvml.NVMLError, AttributeError, TypeError) as exc:
            fabric = f"unavailable: {exc}"
        links = []
        for link in range(18):
            try:
                links.append(int(nvml.nvmlDeviceGetNvLinkState(h, link)))
            except nvml.NVMLError:
                break
        gpus.append(
            {
                "name": text(nvml.nvmlDeviceGetName(h)),
                "cc": list(nvml.nvmlDeviceGetCudaComputeCapability(h)),
                "uuid": text(nvml.nvmlDeviceGetUUID(h)),
                "mem_total": int(mem.total),
                "mem_free": int(mem.free),
                "pci_device_id": f"0x{pci.pciDeviceId:08x}",
                "bus_id": text(pci.busId),
                "mig": mig,
                "nvlink_states": links,
                "fabric": fabric,
            }
        )
    p2p = [
        [
            bool(
                a != b
                and nvml.nvmlDeviceGetP2PStatus(handles[a], handles[b], nvml.NVML_P2P_CAPS_INDEX_NVLINK)
                == nvml.NVML_P2P_STATUS_OK
            )
            for b in range(count)
        ]
        for a in range(count)
    ]
    json.dump(
        {
            "driver": text(nvml.nvmlSystemGetDriverVersion()),
            "cuda_driver": nvml.nvmlSystemGetCudaDriverVersion_v2(),
            "nvml": text(nvml.nvmlSystemGetNVMLVersion()),
            "count": count,
            "gpus": gpus,
            "p2p_nvlink": p2p,
        },
        sys.stdout,
        indent=1,
    )
    sys.stdout.write("\n")
    nvml.nvmlShutdown()


if __name__ == "__main__":
    main()
