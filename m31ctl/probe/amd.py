"""AMD probes: the amdsmi library first, the KFD sysfs topology as the fallback."""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from m31ctl.hardware import GPU, PRODUCTS, normalize_arch
from m31ctl.probe.snapshot import ProbeUnavailable, Runner, Snapshot, json_output, run_command

AMDSMI_LINK_XGMI = 2
KFD_TOPOLOGY = Path("/sys/class/kfd/kfd/topology/nodes")


def gfx_from_target_version(version: int) -> str:
    """KFD encodes gfx targets as major*10000 + minor*100 + step: 90500 -> gfx950, 90010 -> gfx90a."""
    major, minor, step = version // 10000, (version // 100) % 100, version % 100
    return f"gfx{major}{minor:x}{step:x}"


def _name_for(arch: str, device_id: str | None) -> str:
    for product in PRODUCTS.values():
        if product.pci_device_id and device_id and product.pci_device_id.lower() == device_id.lower():
            return product.name
    return f"AMD GPU ({arch})"


# Where ROCm keeps the amdsmi Python package that matches its own libamd_smi.so.
ROCM_AMDSMI = Path("/opt/rocm/share/amd_smi")


def amdsmi_install() -> str:
    """The command that puts amdsmi into the Python m31ctl runs in, as it works from a clone as
    from a wheel: that interpreter's pip (`pip install 'm31ctl[amd]'` asks the index for an
    m31ctl it does not have), with the copy the host's ROCm ships where there is one (the
    index's amdsmi must match ROCm's library), else the `amd` extra's package itself."""
    rocm_amdsmi = ROCM_AMDSMI
    python = sys.executable or "python3"
    with contextlib.suppress(ValueError):  # another drive: the path as it is
        near = os.path.relpath(python)
        python = near if not near.startswith("..") else python
    if rocm_amdsmi.is_dir():
        command = f"{shlex.quote(python)} -m pip install {shlex.quote(str(rocm_amdsmi))}"
        return f"`{command}` adds the copy this host's ROCm ships"
    return f"`{shlex.quote(python)} -m pip install amdsmi` adds it; it loads ROCm's libamd_smi.so"


class AmdSmiProbe:
    name = "amdsmi"

    def __init__(self, amdsmi: Any | None = None) -> None:
        self._lib = amdsmi

    def _module(self) -> Any:
        if self._lib is not None:
            return self._lib
        try:
            # optional: amdsmi exists only where ROCm is installed
            import amdsmi
        except ImportError:
            raise ProbeUnavailable(
                f"amdsmi is not installed in m31ctl's Python ({amdsmi_install()})"
            ) from None
        except OSError as exc:  # the Python package is there but libamd_smi.so is not
            raise ProbeUnavailable(f"amdsmi cannot load its library: {exc}") from None
        return amdsmi

    def probe(self) -> Snapshot:
        lib = self._module()
        try:
            lib.amdsmi_init()
        except Exception as exc:  # AmdSmiLibraryException and friends
            raise ProbeUnavailable(f"amdsmi: {exc}") from None
        try:
            handles = lib.amdsmi_get_processor_handles()
            gpus = []
            driver = None
            for index, h in enumerate(handles):
                asic = lib.amdsmi_get_gpu_asic_info(h)
                vram = lib.amdsmi_get_gpu_vram_info(h)
                driver = lib.amdsmi_get_gpu_driver_info(h).get("driver_version", driver)
                arch = normalize_arch(str(asic.get("target_graphics_version", "")))
                device_id = str(asic.get("device_id", "")).lower() or None
                gpus.append(
                    GPU(
                        index=index,
                        name=str(asic.get("market_name") or _name_for(arch, device_id)),
                        arch=arch,
                        memory_total_bytes=int(vram["vram_size"]) * 1024 * 1024,
                        pci_device_id=device_id,
                    )
                )
            links = set()
            for a in range(len(handles)):
                for b in range(a + 1, len(handles)):
                    try:
                        link = lib.amdsmi_topo_get_link_type(handles[a], handles[b])
                    except Exception:
                        continue
                    kind = link.get("type") if isinstance(link, dict) else link
                    if kind == AMDSMI_LINK_XGMI:
                        links.add((a, b))
        finally:
            with contextlib.suppress(Exception):
                lib.amdsmi_shut_down()
        return Snapshot(
            "amd", self.name, tuple(gpus), driver_version=driver, links=frozenset(links), link_kind="xgmi"
        )


def _properties(path: Path) -> dict[str, str]:
    props = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(" ")
        props[key] = value.strip()
    return props


class KfdSysfsProbe:
    """Reads /sys/class/kfd: works without ROCm user space, as long as amdgpu is loaded."""

    name = "kfd-sysfs"

    def __init__(self, root: Path = KFD_TOPOLOGY) -> None:
        self._root = root

    def probe(self) -> Snapshot:
        if not self._root.is_dir():
            raise ProbeUnavailable("no KFD topology in sysfs (amdgpu driver not loaded)")
        gpus: list[GPU] = []
        try:
            nodes = sorted(self._root.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 1 << 30)
            for node in nodes:
                props = _properties(node / "properties")
                target = int(props.get("gfx_target_version", "0"))
                if target == 0:
                    continue  # CPU node
                arch = gfx_from_target_version(target)
                device_id = f"0x{int(props.get('device_id', '0')):04x}"
                minor = props.get("drm_render_minor")  # kfd_topology.c publishes it per GPU node
                size = 0
                for bank in sorted((node / "mem_banks").glob("*/properties")):
                    size += int(_properties(bank).get("size_in_bytes", "0"))
                gpus.append(
                    GPU(
                        index=len(gpus),
                        name=_name_for(arch, device_id),
                        arch=arch,
                        memory_total_bytes=size,
                        pci_device_id=device_id,
                        render_node=f"/dev/dri/renderD{minor}" if minor and minor.isdigit() else None,
                    )
                )
        except PermissionError as exc:
            raise ProbeUnavailable(f"permission denied reading {exc.filename}") from None
        return Snapshot(
            "amd",
            self.name,
            tuple(gpus),
            notes=("read from the KFD sysfs topology; driver version and xGMI links unknown",),
        )


def _vram_bytes(vram: Any) -> int:
    """amd-smi's vram block: {"size": {"value": N, "unit": "MB"}} (ROCm 6.1+) or {"vram_size": N} (MB)."""
    if not isinstance(vram, dict):
        return 0
    size = vram.get("size")
    if isinstance(size, dict):
        value, unit = size.get("value", 0), str(size.get("unit", "MB")).upper()
        scale = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3}.get(unit, 1024**2)
        return int(value) * scale
    return int(vram.get("vram_size", 0) or 0) * 1024**2


class AmdSmiCliProbe:
    """`amd-smi static --asic --vram --driver --json`, for hosts with the CLI but not the module."""

    name = "amd-smi"

    def __init__(self, runner: Runner = run_command) -> None:
        self._run = runner

    def probe(self) -> Snapshot:
        data = json_output(self._run, ["amd-smi", "static", "--asic", "--vram", "--driver", "--json"])
        entries = data.get("gpu_data", []) if isinstance(data, dict) else data  # newer releases wrap the list
        gpus, driver = [], None
        for index, entry in enumerate(entries):
            asic = entry.get("asic") or {}
            arch = normalize_arch(str(asic.get("target_graphics_version", "")))
            device_id = str(asic.get("device_id", "")).lower() or None
            driver = (entry.get("driver") or {}).get("version", driver)
            gpus.append(
                GPU(
                    index=int(entry.get("gpu", index)),
                    name=str(asic.get("market_name") or _name_for(arch, device_id)),
                    arch=arch,
                    memory_total_bytes=_vram_bytes(entry.get("vram")),
                    pci_device_id=device_id,
                )
            )
        return Snapshot(
            "amd",
            self.name,
            tuple(gpus),
            driver_version=driver,
            notes=("read from amd-smi's CLI; xGMI links not checked",),
        )


class RocmSmiProbe:
    """`rocm-smi --showproductname --showmeminfo vram --json`: older ROCm. Its gfx strings are
    unreliable (gfx90a printed as gfx9010), so the PCI device id decides where it is known."""

    name = "rocm-smi"

    def __init__(self, runner: Runner = run_command) -> None:
        self._run = runner

    def probe(self) -> Snapshot:
        data = json_output(self._run, ["rocm-smi", "--showproductname", "--showmeminfo", "vram", "--json"])
        cards = sorted((k, v) for k, v in data.items() if k.startswith("card") and k[4:].isdigit())
        gpus = []
        for key, card in cards:
            device_id = str(card.get("Card Model", "")).lower() or None
            known = next((p for p in PRODUCTS.values() if p.pci_device_id == device_id), None)
            arch = known.arch if known else normalize_arch(str(card.get("GFX Version", "")))
            gpus.append(
                GPU(
                    index=int(key[4:]),
                    name=known.name if known else str(card.get("Card Series", "AMD GPU")),
                    arch=arch,
                    memory_total_bytes=int(card.get("VRAM Total Memory (B)", 0) or 0),
                    pci_device_id=device_id,
                )
            )
        driver = (data.get("system") or {}).get("Driver version")
        return Snapshot(
            "amd",
            self.name,
            tuple(gpus),
            driver_version=driver,
            notes=("read from rocm-smi; xGMI links not checked",),
        )
