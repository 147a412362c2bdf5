"""CUDA_VISIBLE_DEVICES and friends: NVML and amdsmi ignore them, so we apply them."""

from __future__ import annotations

from collections.abc import Mapping

from m31ctl.errors import InputError
from m31ctl.hardware import GPU, vendor_facts


def _select(gpus: tuple[GPU, ...], spec: str, var: str) -> tuple[GPU, ...]:
    spec = spec.strip()
    if spec.lower() == "all":
        return gpus
    if spec == "" or spec.lower() in ("none", "void", "nodevfiles"):
        return ()
    chosen: list[GPU] = []
    for token in (t.strip() for t in spec.split(",")):
        if not token:
            continue
        if token.lstrip("-").isdigit():
            index = int(token)
            if index < 0:
                break  # CUDA stops at the first invalid ordinal
            # Ordinals count the devices still visible, as CUDA and ROCm number them.
            match = [gpus[index]] if index < len(gpus) else []
        else:
            match = [g for g in gpus if g.uuid and g.uuid.lower().startswith(token.lower())]
        if not match:
            raise InputError(
                f"{var}={spec!r} names a device that is not present ({token!r})",
                hint=f"visible ordinals: 0..{len(gpus) - 1}" if gpus else "no GPU is visible",
            )
        if match[0] not in chosen:
            chosen.append(match[0])
    return tuple(chosen)


def apply_visibility(
    gpus: tuple[GPU, ...], vendor: str, env: Mapping[str, str]
) -> tuple[tuple[GPU, ...], str | None]:
    """Filter GPUs as the container runtime / CUDA / ROCm would; returns which variable applied."""
    applied = None
    for var in vendor_facts(vendor).visibility_vars:
        if var in env:
            gpus = _select(gpus, env[var], var)
            applied = var if applied is None else f"{applied}, {var}"
    return gpus, applied
