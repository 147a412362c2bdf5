"""Detect the host's accelerators and describe them; the only place NVML/amdsmi are touched."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from m31ctl.errors import InputError, UnsupportedHardware
from m31ctl.hardware import Hardware, describe_arch, family_for, vendor_facts
from m31ctl.probe.amd import AmdSmiCliProbe, AmdSmiProbe, KfdSysfsProbe, RocmSmiProbe
from m31ctl.probe.nvidia import NvidiaSmiProbe, NvmlProbe
from m31ctl.probe.snapshot import ProbeUnavailable, Snapshot, environ
from m31ctl.probe.visibility import apply_visibility


class ProbeMethod(Protocol):
    name: str

    def probe(self) -> Snapshot: ...


@dataclass(frozen=True)
class Attempt:
    method: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class ProbeReport:
    hardware: Hardware
    attempts: tuple[Attempt, ...]
    visibility: str | None = None


METHODS_ENV = "M31CTL_PROBE_METHODS"


def default_methods(env: Mapping[str, str]) -> list[ProbeMethod]:
    """All methods in order, or the comma-separated subset named by M31CTL_PROBE_METHODS."""
    methods: list[ProbeMethod] = [
        NvmlProbe(),
        NvidiaSmiProbe(),
        AmdSmiProbe(),
        AmdSmiCliProbe(),
        RocmSmiProbe(),
        KfdSysfsProbe(),
    ]
    wanted = [m.strip() for m in env.get(METHODS_ENV, "").split(",") if m.strip()]
    if wanted:
        unknown = set(wanted) - {m.name for m in methods}
        if unknown:
            raise InputError(
                f"{METHODS_ENV} names unknown probe methods: {', '.join(sorted(unknown))}",
                hint=f"known: {', '.join(m.name for m in methods)}",
            )
        methods = [m for m in methods if m.name in wanted]
    return methods


NO_GPU = Hardware(
    vendor="none", family=None, arch=None, product=None, count=0, memory_per_gpu_bytes=0, source="probe"
)


def describe(snapshot: Snapshot, env: Mapping[str, str]) -> tuple[Hardware, str | None]:
    gpus, applied = apply_visibility(snapshot.gpus, snapshot.vendor, env)
    if not gpus:
        return NO_GPU.model_copy(update={"source": snapshot.method}), applied
    models = sorted({(g.name, g.arch) for g in gpus})
    if len(models) > 1:
        found = ", ".join(f"{name} ({describe_arch(arch)})" for name, arch in models)
        var = vendor_facts(snapshot.vendor).pick_var or "CUDA_VISIBLE_DEVICES"
        raise UnsupportedHardware(
            f"this host mixes GPU models: {found}",
            hint=f"pick identical devices with {var}=0,1,... or pass --hardware",
        )
    first = gpus[0]
    family = family_for(first.arch)
    visible = {g.index for g in gpus}
    linked = {pair for pair in snapshot.links if set(pair) <= visible}
    all_pairs = len(gpus) * (len(gpus) - 1) // 2
    interconnect = (len(linked) == all_pairs) if len(gpus) > 1 else None
    fabrics = {snapshot.fabric[g.index] for g in gpus if g.index in snapshot.fabric}
    migs = {g.mig_enabled for g in gpus}
    return Hardware(
        vendor=snapshot.vendor,
        family=family.id if family else None,
        arch=first.arch,
        product=first.name,
        count=len(gpus),
        memory_per_gpu_bytes=min(g.memory_total_bytes for g in gpus),
        driver_version=snapshot.driver_version,
        cuda_driver_version=snapshot.cuda_driver_version,
        rocm_version=snapshot.rocm_version,
        mig_enabled=True if True in migs else (False if migs == {False} else None),
        nvlink=interconnect if snapshot.link_kind == "nvlink" else None,
        xgmi=interconnect if snapshot.link_kind == "xgmi" else None,
        fabric=next(iter(fabrics)) if len(fabrics) == 1 else None,
        gpus=gpus,
        source=snapshot.method,
        notes=snapshot.notes,
    ), applied


def detect(methods: Sequence[ProbeMethod] | None = None, env: Mapping[str, str] | None = None) -> ProbeReport:
    """Try each method in order; the first that answers wins. No GPU at all is a normal answer."""
    env = environ() if env is None else env
    attempts: list[Attempt] = []
    # A vendor's fallback runs only when its primary failed; the first vendor that sees GPUs wins.
    for method in methods if methods is not None else default_methods(env):
        try:
            snapshot = method.probe()
        except ProbeUnavailable as exc:
            attempts.append(Attempt(method.name, False, str(exc)))
            continue
        except Exception as exc:  # a broken method must not hide the fallbacks behind it
            attempts.append(Attempt(method.name, False, f"unexpected {type(exc).__name__}: {exc}"))
            continue
        attempts.append(Attempt(method.name, True, f"{len(snapshot.gpus)} GPU(s)"))
        if snapshot.gpus:
            hardware, applied = describe(snapshot, env)
            return ProbeReport(hardware, tuple(attempts), applied)
    return ProbeReport(NO_GPU, tuple(attempts))
