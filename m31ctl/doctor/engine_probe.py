"""doctor --deep's probe of the engine: collective_check.py run once per doctor run with the
engine's own Python (through the runtime seam), and what it printed read into typed records.

The output is read field by field with its type checked: it comes from another Python (an image
may carry any vLLM and torch), and a missing or odd field must read as unknown, never crash a
check or pass one.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m31ctl.deployment import Deployment
from m31ctl.doctor.base import CheckContext, SkipCheck
from m31ctl.errors import DockerUnreachable
from m31ctl.runtime.protocol import ScriptRun, ScriptUnavailable

COLLECTIVE_SCRIPT = Path(__file__).resolve().parent.parent / "engine" / "collective_check.py"
DEEP_TIMEOUT_S = 180.0
DEEP_TIMEOUT_ENV = "M31CTL_DEEP_TIMEOUT_S"  # a shorter bound for the all-reduce (tests, impatient CI)
# The all-reduce's bound counts from the moment every rank has started (collective_check.py keeps
# it); before that, the engine's Python imports vLLM and each rank its torch, which takes what it
# takes on this machine (22 s on an idle 2-core host, several times that on a busy one). Only a
# start-up that never ends meets this allowance, which ends the whole run.
DEEP_START_ALLOWANCE_S = 600.0
DEEP_RUN_LIMIT_S = DEEP_TIMEOUT_S + DEEP_START_ALLOWANCE_S


def deep_timeout(env: Mapping[str, str]) -> float:
    try:
        value = float(env.get(DEEP_TIMEOUT_ENV, DEEP_TIMEOUT_S))
    except ValueError:
        return DEEP_TIMEOUT_S
    return value if 0 < value <= DEEP_TIMEOUT_S else DEEP_TIMEOUT_S


@dataclass(frozen=True)
class DeviceFacts:
    index: int
    name: str
    arch: str  # sm_90, gfx950
    kernels: bool  # torch has kernels (or PTX) for it


@dataclass(frozen=True)
class EngineFacts:
    """What the engine's Python says about itself and the GPUs it sees."""

    torch: str | None
    vllm: str | None
    vllm_error: str | None
    cuda_runtime: str | None
    hip_runtime: str | None
    accelerator: bool
    device_count: int
    arch_list: tuple[str, ...]
    devices: tuple[DeviceFacts, ...]


@dataclass(frozen=True)
class CollectiveFacts:
    """One all-reduce over `world` ranks; exit codes per rank (None: still running when joined).
    timed_out: the script killed a collective still running at its bound (bound_s), counted from
    the moment every rank had started."""

    backend: str | None
    world: int | None
    exit_codes: tuple[int | None, ...]
    init_s: float | None
    bytes: int
    busbw_gbps: float | None  # NCCL-tests' bus bandwidth; None for one rank (nothing exchanged)
    correct: bool
    timed_out: bool = False
    bound_s: float | None = None

    @property
    def ranks_ok(self) -> bool:
        return bool(self.exit_codes) and all(code == 0 for code in self.exit_codes)


@dataclass(frozen=True)
class DeepProbe:
    run: ScriptRun
    engine: EngineFacts | None  # None: the engine's Python never reported
    collective: CollectiveFacts | None  # None: the collective never finished


def _str(data: Mapping[str, Any], key: str) -> str | None:
    value = data.get(key)
    return value if isinstance(value, str) else None


def _int(data: Mapping[str, Any], key: str) -> int | None:
    value = data.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float(data: Mapping[str, Any], key: str) -> float | None:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def engine_facts(data: Mapping[str, Any]) -> EngineFacts:
    devices = tuple(
        DeviceFacts(
            _int(d, "index") or 0, _str(d, "name") or "?", _str(d, "arch") or "", d.get("kernels") is True
        )
        for d in data.get("devices") or []
        if isinstance(d, dict)
    )
    arch_list = data.get("arch_list")
    return EngineFacts(
        torch=_str(data, "torch"),
        vllm=_str(data, "vllm"),
        vllm_error=_str(data, "vllm_error"),
        cuda_runtime=_str(data, "cuda_runtime"),
        hip_runtime=_str(data, "hip_runtime"),
        accelerator=data.get("accelerator") is True,
        device_count=_int(data, "device_count") or 0,
        arch_list=tuple(a for a in arch_list if isinstance(a, str)) if isinstance(arch_list, list) else (),
        devices=devices,
    )


def collective_facts(data: Mapping[str, Any]) -> CollectiveFacts:
    codes = data.get("exit_codes")
    return CollectiveFacts(
        backend=_str(data, "backend"),
        world=_int(data, "world"),
        exit_codes=tuple(c if isinstance(c, int) else None for c in codes) if isinstance(codes, list) else (),
        init_s=_float(data, "init_s"),
        bytes=_int(data, "bytes") or 0,
        busbw_gbps=_float(data, "busbw_gbps"),
        correct=data.get("correct") is True,
        timed_out=data.get("timed_out") is True,
        bound_s=_float(data, "bound_s"),
    )


def read_probe(run: ScriptRun) -> DeepProbe:
    """collective_check.py prints {"engine": ...} then {"collective": ...}, one JSON line each;
    any other line is not a report (the stderr says why it stopped)."""
    engine: EngineFacts | None = None
    collective: CollectiveFacts | None = None
    for line in run.stdout.splitlines():
        with contextlib.suppress(ValueError):
            part = json.loads(line)
            if isinstance(part, dict) and isinstance(part.get("engine"), dict):
                engine = engine_facts(part["engine"])
            if isinstance(part, dict) and isinstance(part.get("collective"), dict):
                collective = collective_facts(part["collective"])
    return DeepProbe(run, engine, collective)


def collective_shape(deployment: Deployment) -> tuple[int, str, int]:
    """(world size, backend, MiB) from the vendor's row: the plan's tensor-parallel group on one
    node over NCCL on GPUs (RCCL answers to the same name on ROCm), two gloo ranks on the CPU."""
    facts = deployment.vendor
    world = facts.collective_ranks or min(deployment.layout.tensor, deployment.hardware.count or 1)
    return max(1, world), facts.collective_backend or "gloo", facts.collective_mib


def run_engine_script(
    ctx: CheckContext, script: Path, args: list[str], timeout: float, env: Mapping[str, str] | None = None
) -> ScriptRun:
    """A script with the engine's Python through the runtime --deep names; a runtime that has no
    engine Python to ask here (no image, no Docker Engine) makes the check skip, not fail."""
    deployment = ctx.require_deployment()
    try:
        return ctx.engine_scripts().run_engine_script(deployment, script, args, timeout, env)
    except ScriptUnavailable as exc:
        raise SkipCheck(exc.message, exc.hint or "") from None
    except DockerUnreachable:
        raise SkipCheck("needs the Docker Engine (see the docker check)", "or --runtime native") from None


def deep_probe(ctx: CheckContext) -> DeepProbe:
    """collective_check.py once per doctor run (engine-image and collective both read it)."""
    deployment = ctx.require_deployment()

    def run() -> DeepProbe:
        world, backend, mib = collective_shape(deployment)
        bound = deep_timeout(ctx.env)
        args = ["--world", str(world), "--backend", backend, "--mib", str(mib), "--bound", f"{bound:g}"]
        return read_probe(run_engine_script(ctx, COLLECTIVE_SCRIPT, args, bound + DEEP_START_ALLOWANCE_S))

    found: DeepProbe = ctx.once("deep", run)
    return found
