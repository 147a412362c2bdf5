"""The hardware description every later stage reads, and the GPU catalogue.

Families are classified on (major, minor) compute capability or the gfx target, never on
the major alone: 10.7 (Rubin) would otherwise be taken for Blackwell.
Sources: ../shared/fixtures/gpu/public-samples.md (identifier facts) and the real 2xH200 capture.
"""

from __future__ import annotations

import difflib
import os
import platform
import re
from enum import Enum
from typing import NamedTuple

from pydantic import BaseModel, ConfigDict

from m31ctl.errors import InputError, close_matches
from m31ctl.units import parse_size

MIB = 1024 * 1024


class Family(NamedTuple):
    id: str
    vendor: str
    description: str


# Families a recipe serves, keyed by architecture.
SERVED_ARCHS: dict[str, Family] = {
    "9.0": Family("hopper", "nvidia", "NVIDIA Hopper (H100, H200, GH200)"),
    "10.0": Family("blackwell", "nvidia", "NVIDIA Blackwell (B200, GB200)"),
    "10.3": Family("blackwell", "nvidia", "NVIDIA Blackwell Ultra (B300, GB300)"),
    "10.7": Family("rubin", "nvidia", "NVIDIA Rubin"),
    "gfx950": Family("mi350", "amd", "AMD Instinct MI350 series (MI350X, MI355X)"),
}


class Platform(Enum):
    """The compute platform a plan runs on (and an engine image is built for): a vendor's driver
    stack, or vLLM's CPU build. Typed, so a branch on it is a member, never a spelling."""

    CUDA = "cuda"
    ROCM = "rocm"
    CPU = "cpu"

    @property
    def title(self) -> str:
        return _PLATFORM_TITLES[self]


_PLATFORM_TITLES = {Platform.CUDA: "CUDA", Platform.ROCM: "ROCm", Platform.CPU: "CPU"}


class GpuContainerRuntime(NamedTuple):
    """How the Docker Engine hands a vendor's GPUs to a container by device request: the runtime
    its toolkit registers with the daemon (also the device request's driver in Compose's
    `deploy.resources.reservations.devices`), or a CDI spec for its devices."""

    name: str  # the daemon's runtime, and Compose's device driver
    cdi_vendor: str  # a CDI spec's file name carries it; its devices are <cdi_vendor>.com/gpu
    maker: str  # as messages name it
    install: str  # the remedy when the daemon has neither


NVIDIA_CONTAINER_TOOLKIT = GpuContainerRuntime(
    name="nvidia",
    cdi_vendor="nvidia",
    maker="NVIDIA",
    install="install nvidia-container-toolkit and run `nvidia-ctk runtime configure --runtime=docker`",
)


class VendorFacts(NamedTuple):
    """What every later stage needs to know about a device vendor: one row per vendor, so a new
    vendor is one entry here rather than a branch in the probe, the container, doctor and each target."""

    # Visibility variables, outermost first: the container runtime picks devices, then the
    # compute runtime numbers what it was given (NVML and amdsmi ignore them; the probe applies them).
    visibility_vars: tuple[str, ...]
    # Docker: NVIDIA GPUs come through a device request (the NVIDIA container toolkit's runtime);
    # AMD GPUs are device nodes plus the groups that own them (ROCm's Docker guide).
    gpu_runtime: GpuContainerRuntime | None
    device_nodes: tuple[str, ...]
    group_add: tuple[str, ...]
    cap_add: tuple[str, ...]
    # Kubernetes: the device plugin's extended resource.
    k8s_resource: str | None
    # Kubernetes: the node label that names the GPU product, published by NVIDIA's GPU feature
    # discovery (the product name, spaces as '-') or AMD's node labeller (-device-id: the PCI id).
    k8s_product_label: str | None = None
    k8s_product_by_pci_id: bool = False
    # The variable a user sets to pick devices (named in the probe's advice).
    pick_var: str | None = None
    # Whether the plan runs on GPUs at all (the CPU rehearsal and a GPU-less host do not).
    gpus: bool = False
    # The platform: the driver stack doctor checks (CUDA: driver and CUDA floor, MIG; ROCm), the
    # engine build the image must be, the kernels the plan's rules know of.
    platform: Platform = Platform.CPU
    # The collective the deep check runs (RCCL answers to "nccl" on ROCm), over how many ranks
    # (None: the plan's tensor-parallel group on one node) and how many MiB.
    collective_backend: str | None = None
    collective_ranks: int | None = None
    collective_mib: int = 256

    @property
    def device_request(self) -> bool:
        """GPUs through a device request (a GPU container runtime) rather than device nodes."""
        return self.gpu_runtime is not None


VENDORS: dict[str, VendorFacts] = {
    "nvidia": VendorFacts(
        visibility_vars=("NVIDIA_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"),
        gpu_runtime=NVIDIA_CONTAINER_TOOLKIT,
        device_nodes=(),
        group_add=(),
        cap_add=(),
        k8s_resource="nvidia.com/gpu",
        k8s_product_label="nvidia.com/gpu.product",
        pick_var="CUDA_VISIBLE_DEVICES",
        gpus=True,
        platform=Platform.CUDA,
        collective_backend="nccl",
    ),
    "amd": VendorFacts(
        visibility_vars=("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"),
        gpu_runtime=None,
        device_nodes=("/dev/kfd", "/dev/dri"),
        # `video` exists in every Debian/Ubuntu image; `render` may not, and `--group-add render`
        # then aborts `docker run` ("Unable to find group render"): launch adds the host's
        # numeric render GID instead, as ROCm's container docs do.
        group_add=("video",),
        cap_add=("SYS_PTRACE",),
        k8s_resource="amd.com/gpu",
        k8s_product_label="amd.com/gpu.device-id",
        k8s_product_by_pci_id=True,
        pick_var="ROCR_VISIBLE_DEVICES",
        gpus=True,
        platform=Platform.ROCM,
        collective_backend="nccl",
    ),
    # The CPU rehearsal: vLLM's CPU backend, two gloo ranks for the deep check.
    "cpu": VendorFacts(
        (), None, (), (), (), None, collective_backend="gloo", collective_ranks=2, collective_mib=16
    ),
}
# A host without GPUs (the probe's answer on a laptop): no facts at all.
NO_VENDOR = VendorFacts((), None, (), (), (), None)


def vendor_facts(vendor: str) -> VendorFacts:
    """The row for `vendor`; a GPU-less host has none of these facts."""
    return VENDORS.get(vendor, NO_VENDOR)


# Real hardware that no recipe serves: named so the refusal says what was found.
KNOWN_UNSERVED: dict[str, str] = {
    "12.0": "NVIDIA RTX Blackwell (RTX PRO 6000, RTX 50 series)",
    "12.1": "NVIDIA GB10 (DGX Spark)",
    "11.0": "NVIDIA Jetson Thor",
    "8.9": "NVIDIA Ada Lovelace",
    "8.6": "NVIDIA Ampere (GA10x)",
    "8.0": "NVIDIA Ampere (A100)",
    "7.0": "NVIDIA Volta",
    "gfx942": "AMD Instinct MI300 series (MI300X, MI300A, MI325X)",
    "gfx90a": "AMD Instinct MI200 series",
}


class Product(NamedTuple):
    """A GPU product, for `--hardware NAMExCOUNT` simulation and name matching."""

    id: str
    vendor: str  # Hardware.vendor: the row of VENDORS its host gets
    name: str  # as nvidia-smi / amd-smi print it
    arch: str
    memory_mib: int  # as nvidia-smi reports memory.total; vendor figure where no capture exists
    pci_device_id: str | None = None
    memory_source: str = "nvidia-smi (public-samples.md)"


PRODUCTS: dict[str, Product] = {
    p.id: p
    for p in (
        Product("h100", "nvidia", "NVIDIA H100 80GB HBM3", "9.0", 81559),
        Product(
            "h200", "nvidia", "NVIDIA H200", "9.0", 143771, "0x2335", "nvidia-smi (nvidia-h200x2 capture)"
        ),
        Product("b200", "nvidia", "NVIDIA B200", "10.0", 183359, "0x2901"),
        Product("gb200", "nvidia", "NVIDIA GB200", "10.0", 189471),
        Product("b300", "nvidia", "NVIDIA B300 SXM6 AC", "10.3", 275040),
        Product("gb300", "nvidia", "NVIDIA GB300", "10.3", 284208),
        # No capture yet: vendor figure, 288 GB HBM4.
        Product("rubin", "nvidia", "NVIDIA Rubin", "10.7", 274658, memory_source="vendor figure, 288 GB"),
        # amd-smi reports VRAM in MB; 288 GB HBM3E on both MI350X and MI355X.
        Product("mi350x", "amd", "AMD Instinct MI350X", "gfx950", 294912, "0x75a0", "vendor figure, 288 GB"),
        Product("mi355x", "amd", "AMD Instinct MI355X", "gfx950", 294912, "0x75a3", "vendor figure, 288 GB"),
        Product("mi300x", "amd", "AMD Instinct MI300X", "gfx942", 196608, "0x74a1", "vendor figure, 192 GB"),
        Product(
            "rtxpro6000",
            "nvidia",
            "NVIDIA RTX PRO 6000 Blackwell",
            "12.0",
            97887,
            memory_source="vendor figure, 96 GB",
        ),
    )
}


class Fabric(BaseModel):
    """NVL72-style fabric membership; present only when the fabric is healthy."""

    model_config = ConfigDict(frozen=True, defer_build=True)
    clique_id: int
    cluster_uuid: str


class GPU(BaseModel):
    model_config = ConfigDict(frozen=True, defer_build=True)
    index: int
    name: str
    arch: str | None  # "9.0" or "gfx950"; None when the driver cannot tell (old nvidia-smi)
    memory_total_bytes: int
    memory_free_bytes: int | None = None
    uuid: str | None = None
    pci_device_id: str | None = None
    bus_id: str | None = None
    mig_enabled: bool | None = None
    # AMD: the DRM render node (/dev/dri/renderD128) that gives a container this GPU alone.
    render_node: str | None = None


class Hardware(BaseModel):
    """What the accelerators of one host are: the probe's answer, or a simulated host. `count` is
    that host's GPUs; a layout over several such hosts says so itself (parallelism.nodes)."""

    model_config = ConfigDict(frozen=True, defer_build=True)
    vendor: str  # nvidia | amd | none
    family: str | None  # hopper | blackwell | rubin | mi350, None when no recipe serves it
    arch: str | None
    product: str | None
    count: int
    memory_per_gpu_bytes: int
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    rocm_version: str | None = None
    mig_enabled: bool | None = None
    nvlink: bool | None = None
    xgmi: bool | None = None
    fabric: Fabric | None = None
    gpus: tuple[GPU, ...] = ()
    source: str  # for people: "nvml", "nvidia-smi", "amdsmi", "kfd-sysfs", "simulated (b300x4)"
    # A host described by --hardware rather than probed: nothing on this machine stands behind it.
    simulated: bool = False
    notes: tuple[str, ...] = ()
    # The host's memory where a --hardware spec declares it (`b300x8,host-memory=2t`): the plan
    # checks the prefix cache's host tier against it (m31ctl/capacity/host_tier.py). A GPU product
    # does not fix its server's memory (DGX and OEM builds differ), so the catalogue names none.
    host_memory_bytes: int | None = None

    @property
    def memory_per_gpu_gib(self) -> float:
        return self.memory_per_gpu_bytes / (1024**3)


def catalogued(hw: Hardware) -> Product | None:
    """The catalogue's entry for this host's GPUs, found by the name the driver prints."""
    return next((p for p in PRODUCTS.values() if p.name == hw.product), None)


def hardware_spec(hw: Hardware) -> str | None:
    """The `--hardware` value that plans for this host without probing it (`b300x4`, `cpu`), or
    None for a product the catalogue does not name."""
    if vendor_facts(hw.vendor).platform is Platform.CPU:
        return "cpu"
    product = catalogued(hw)
    if product is None:
        return None
    host = f",{HOST_MEMORY_KEY}={_size_text(hw.host_memory_bytes)}" if hw.host_memory_bytes else ""
    return f"{product.id}x{hw.count}{host}"


def _size_text(size: int) -> str:
    """Bytes as units.parse_size reads them back: the largest binary unit that divides them."""
    for unit, scale in (("t", 1024**4), ("g", 1024**3), ("m", 1024**2), ("k", 1024)):
        if size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def k8s_product_selector(hw: Hardware) -> dict[str, str]:
    """The node label and value that pin pods to nodes with this GPU product ({} when unknown)."""
    facts = vendor_facts(hw.vendor)
    label = facts.k8s_product_label
    if label is None or not hw.product:
        return {}
    if not facts.k8s_product_by_pci_id:
        return {label: hw.product.replace(" ", "-")}
    product = catalogued(hw)
    device = (product.pci_device_id if product else None) or next(
        (g.pci_device_id for g in hw.gpus if g.pci_device_id), None
    )
    return {label: device.lower().removeprefix("0x")} if device else {}


def normalize_arch(arch: str) -> str:
    """'gfx950:sramecc+:xnack-' -> 'gfx950'; '9.0' stays."""
    arch = arch.strip().lower()
    if arch.startswith("gfx"):
        return arch.split(":", 1)[0]
    return arch


def family_for(arch: str | None) -> Family | None:
    if arch is None:
        return None
    return SERVED_ARCHS.get(normalize_arch(arch))


def describe_arch(arch: str | None) -> str:
    if arch is None:
        return "unknown architecture"
    arch = normalize_arch(arch)
    fam = SERVED_ARCHS.get(arch)
    if fam:
        return fam.description
    if arch in KNOWN_UNSERVED:
        return KNOWN_UNSERVED[arch]
    return f"architecture {arch}"


def cpu_host() -> Hardware:
    """`--hardware cpu`: this machine's CPU as the one device of the CPU rehearsal recipe."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Hardware(
        vendor="cpu",
        family="cpu",
        arch=platform.machine(),
        product=f"CPU ({os.cpu_count()} cores)",
        count=1,
        memory_per_gpu_bytes=memory,
        source="this host's CPU",
        notes=("CPU rehearsal: vLLM's CPU backend, not MiniMax-M3.1-Flash",),
    )


# A simulated host holds at most this many GPUs (the largest single systems have 8-16; an NVL72
# rack is several hosts): a bound, so `--hardware b300x99999999999` cannot allocate without end.
MAX_GPUS_PER_HOST = 64
_HW_SPEC = re.compile(r"^(?P<product>[a-z0-9]+?)x(?P<count>[0-9]+)(?:,host-memory=(?P<host>[^,]+))?$")
HOST_MEMORY_KEY = "host-memory"


def simulated(spec: str) -> Hardware:
    """`--hardware b300x4`: a host of COUNT identical PRODUCT GPUs, no probing."""
    if spec.strip().lower() in ("cpu", "cpux1"):
        return cpu_host()
    match = _HW_SPEC.match(spec.strip().lower())
    product = PRODUCTS.get(match.group("product")) if match else None
    if match is None or product is None:
        meant = likely_spec(spec)  # the count typed is kept: the product is the near miss
        hint = ""
        if meant is not None:
            hint = f"did you mean {meant[0]}x{meant[1]}? " if meant[1] else f"did you mean {meant[0]}? "
        raise InputError(
            f"unknown --hardware {spec!r}",
            hint=f"{hint}use PRODUCTxCOUNT with PRODUCT one of {', '.join(PRODUCTS)} "
            f"(a host's memory may follow: b300x8,{HOST_MEMORY_KEY}=2t)",
        )
    count = int(match.group("count")[:6])  # the digits past a sane count are never converted
    if not 1 <= count <= MAX_GPUS_PER_HOST or len(match.group("count")) > 6:
        raise InputError(
            f"--hardware {spec!r}: the GPU count must be from 1 to {MAX_GPUS_PER_HOST}",
            hint="a host, not a cluster: e.g. b300x4 or h200x8 (multi-node layouts render to --target k8s)",
        )
    fam = family_for(product.arch)
    memory = product.memory_mib * MIB
    host_memory = _host_memory(spec, match.group("host"))
    # Plain data, validated inside Hardware's own schema: building GPU's validator apart for
    # these would cost start-up for nothing.
    gpus = [
        {
            "index": i,
            "name": product.name,
            "arch": product.arch,
            "memory_total_bytes": memory,
            "pci_device_id": product.pci_device_id,
            "mig_enabled": False,
        }
        for i in range(count)
    ]
    return Hardware(
        vendor=product.vendor,
        family=fam.id if fam else None,
        arch=product.arch,
        product=product.name,
        count=count,
        memory_per_gpu_bytes=memory,
        mig_enabled=False,
        gpus=gpus,
        source=f"simulated ({spec.lower()})",
        simulated=True,
        notes=(f"memory per GPU: {product.memory_source}",),
        host_memory_bytes=host_memory,
    )


def likely_spec(spec: str) -> tuple[str, int | None] | None:
    """The catalogue product and GPU count a --hardware the catalogue does not know most likely
    meant, the count as typed (None where none was): `mi355x8` is mi355x with 8 (the separating
    x left out), `h20x8` h200 with 8, `b3004` b300 with 4. Every way of reading the trailing
    digits as the count is weighed, and the product spelt closest wins; None where none is close."""
    text = spec.strip().lower().split(",", 1)[0]
    digits = len(text) - len(text.rstrip("0123456789"))
    readings: list[tuple[str, int | None]] = [(text, None)]  # no count at all
    for width in range(1, min(digits, 6) + 1):
        head, typed = text[:-width], int(text[-width:])
        if 1 <= typed <= MAX_GPUS_PER_HOST:
            readings += [(head, typed), (head.removesuffix("x"), typed)]
    best: tuple[float, str, int | None] | None = None
    for head, count in readings:
        if not head:
            continue
        for product in close_matches(head, list(PRODUCTS), n=1):
            score = difflib.SequenceMatcher(None, head, product).ratio()
            if best is None or score > best[0]:
                best = (score, product, count)
    return (best[1], best[2]) if best else None


def _host_memory(spec: str, text: str | None) -> int | None:
    if text is None:
        return None
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise InputError(f"--hardware {spec!r}: {exc}", hint="e.g. b300x8,host-memory=2t") from None
    if size < 1:
        raise InputError(f"--hardware {spec!r}: the host's memory must be more than 0")
    return size
