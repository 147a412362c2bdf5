"""NVIDIA probes: NVML through nvidia-ml-py first, `nvidia-smi` as the fallback."""

from __future__ import annotations

import contextlib
import csv
import ctypes
import io
from typing import Any

from m31ctl.hardware import GPU, PRODUCTS, Fabric, Platform, vendor_facts
from m31ctl.probe.snapshot import ProbeUnavailable, Runner, Snapshot, require_success, run_command

# nvidia-smi fields; the order matches the real 2xH200 capture (fixtures/gpu/nvidia-h200x2).
SMI_FIELDS = (
    "index",
    "name",
    "uuid",
    "pci.bus_id",
    "pci.device_id",
    "compute_cap",
    "memory.total",
    "memory.used",
    "memory.free",
    "driver_version",
    "mig.mode.current",
    "power.limit",
    "clocks.max.sm",
)
NVML_FABRIC_STATE_COMPLETED = 3


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fabric_uuid(raw: Any) -> str:
    if isinstance(raw, (bytes, bytearray)) and len(raw) == 16:
        h = raw.hex()
        return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
    if isinstance(raw, (list, tuple)) and len(raw) == 16:
        return _fabric_uuid(bytes(raw))
    return _text(raw)


def healthy_fabric(state: int, status: int, clique_id: int, cluster_uuid: str) -> Fabric | None:
    """Fabric membership counts only when registration completed, succeeded, and has a cluster."""
    if state != NVML_FABRIC_STATE_COMPLETED or status != 0 or cluster_uuid.strip("-0") == "":
        return None
    return Fabric(clique_id=clique_id, cluster_uuid=cluster_uuid)


def _fabric_member(nvml: Any, handle: Any) -> Fabric | None:
    """NVL72-style fabric registration; None where the GPU or the binding has no fabric."""
    try:
        info = nvml.c_nvmlGpuFabricInfo_v2_t()  # the binding fills a versioned struct in place
        nvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
    except (nvml.NVMLError, AttributeError, TypeError):
        return None  # Hopper PCIe/HGX boards answer NOT_SUPPORTED; old bindings lack the call
    return healthy_fabric(
        int(info.state), int(info.status), int(info.cliqueId), _fabric_uuid(bytes(info.clusterUuid))
    )


class NvmlProbe:
    name = "nvml"

    def __init__(self, nvml: Any | None = None) -> None:
        self._nvml = nvml

    def _module(self) -> Any:
        if self._nvml is not None:
            return self._nvml
        try:
            # optional: nvidia-ml-py (m31ctl[nvidia]); absent, this method is unavailable
            import pynvml
        except ImportError:
            raise ProbeUnavailable("nvidia-ml-py is not installed (pip install 'm31ctl[nvidia]')") from None
        return pynvml

    def probe(self) -> Snapshot:
        nvml = self._module()
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise ProbeUnavailable(f"NVML: {_text(exc)}") from None
        try:
            return self._read(nvml)
        finally:
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlShutdown()

    def _read(self, nvml: Any) -> Snapshot:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        cuda = nvml.nvmlSystemGetCudaDriverVersion_v2()
        cuda_version = f"{cuda // 1000}.{(cuda % 1000) // 10}"
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        gpus = []
        fabric: dict[int, Fabric] = {}
        for index, h in enumerate(handles):
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(h)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            pci = nvml.nvmlDeviceGetPciInfo(h)
            try:
                mig = bool(nvml.nvmlDeviceGetMigMode(h)[0])
            except nvml.NVMLError:
                mig = None  # not supported on this GPU
            gpus.append(
                GPU(
                    index=index,
                    name=_text(nvml.nvmlDeviceGetName(h)),
                    arch=f"{major}.{minor}",
                    memory_total_bytes=int(mem.total),
                    memory_free_bytes=int(mem.free),
                    uuid=_text(nvml.nvmlDeviceGetUUID(h)),
                    pci_device_id=f"0x{pci.pciDeviceId >> 16:04x}",
                    bus_id=_text(pci.busId),
                    mig_enabled=mig,
                )
            )
            member = _fabric_member(nvml, h)
            if member:
                fabric[index] = member
        links = set()
        for a in range(len(handles)):
            for b in range(a + 1, len(handles)):
                try:
                    status = nvml.nvmlDeviceGetP2PStatus(
                        handles[a], handles[b], nvml.NVML_P2P_CAPS_INDEX_NVLINK
                    )
                except nvml.NVMLError:
                    continue
                if status == nvml.NVML_P2P_STATUS_OK:
                    links.add((a, b))
        return Snapshot(
            "nvidia",
            self.name,
            tuple(gpus),
            driver_version=driver,
            cuda_driver_version=cuda_version,
            links=frozenset(links),
            link_kind="nvlink",
            fabric=fabric,
        )


def _arch_from_name(name: str) -> str | None:
    """A CUDA product's compute capability from the name nvidia-smi prints (an old nvidia-smi
    has no compute_cap field); only products whose vendor row runs CUDA are matched."""
    for product in PRODUCTS.values():
        cuda = vendor_facts(product.vendor).platform is Platform.CUDA
        if cuda and product.name.lower() == name.lower():
            return product.arch
    return None


def parse_smi_csv(text: str, fields: tuple[str, ...]) -> list[dict[str, str]]:
    rows = []
    for row in csv.reader(io.StringIO(text), skipinitialspace=True):
        if not row:
            continue
        if len(row) != len(fields):
            raise ProbeUnavailable(f"nvidia-smi printed {len(row)} columns, expected {len(fields)}")
        rows.append({f: v.strip() for f, v in zip(fields, row, strict=True)})
    return rows


def _int_or_none(value: str) -> int | None:
    try:
        return int(float(value))
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def gpus_from_smi(rows: list[dict[str, str]]) -> tuple[GPU, ...]:
    gpus = []
    for row in rows:
        arch = row.get("compute_cap") or _arch_from_name(row["name"])
        total = _int_or_none(row["memory.total"]) or 0
        free = _int_or_none(row.get("memory.free", ""))
        mig = row.get("mig.mode.current", "")
        device_id = row.get("pci.device_id", "")
        gpus.append(
            GPU(
                index=int(row["index"]),
                name=row["name"],
                arch=arch,
                memory_total_bytes=total * 1024 * 1024,
                memory_free_bytes=free * 1024 * 1024 if free is not None else None,
                uuid=row.get("uuid"),
                bus_id=row.get("pci.bus_id"),
                pci_device_id=f"0x{int(device_id, 16) >> 16:04x}" if device_id.startswith("0x") else None,
                mig_enabled={"Enabled": True, "Disabled": False}.get(mig),
            )
        )
    return tuple(gpus)


def nvlink_pairs_from_topo(text: str) -> frozenset[tuple[int, int]]:
    """`nvidia-smi topo -m`: an NV# cell joins two GPUs by bonded NVLinks."""
    pairs = set()
    for line in text.splitlines():
        cells = line.split()
        if not cells or not cells[0].startswith("GPU") or not cells[0][3:].isdigit():
            continue
        a = int(cells[0][3:])
        for b, cell in enumerate(cells[1:]):
            if cell.startswith("NV") and cell[2:].isdigit() and a != b:
                pairs.add((min(a, b), max(a, b)))
    return frozenset(pairs)


class NvidiaSmiProbe:
    name = "nvidia-smi"

    def __init__(self, runner: Runner = run_command) -> None:
        self._run = runner

    def _query(self, fields: tuple[str, ...]) -> Any:
        return self._run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"])

    def probe(self) -> Snapshot:
        fields: tuple[str, ...] = SMI_FIELDS
        result = self._query(fields)
        notes: tuple[str, ...] = ()
        if result.returncode != 0 and "compute_cap" in (result.stdout + result.stderr):
            # Drivers before ~510 lack the compute_cap field: ask without it, classify by name.
            fields = tuple(f for f in SMI_FIELDS if f != "compute_cap")
            result = self._query(fields)
            notes = (
                "this driver's nvidia-smi has no compute_cap field; architecture inferred from the name",
            )
        require_success(result, "nvidia-smi")
        rows = parse_smi_csv(result.stdout, fields)
        gpus = gpus_from_smi(rows)
        driver = rows[0]["driver_version"] if rows else None
        topo = self._run(["nvidia-smi", "topo", "-m"])
        links = nvlink_pairs_from_topo(topo.stdout) if topo.returncode == 0 else frozenset()
        return Snapshot(
            "nvidia", self.name, gpus, driver_version=driver, links=links, link_kind="nvlink", notes=notes
        )
