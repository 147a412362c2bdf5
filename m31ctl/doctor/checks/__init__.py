"""The checks `m31ctl doctor` and `launch` run, in the order they are reported. Each reads the
CheckContext and returns an Outcome; what they call to find out (the Docker Engine, a script run with
the engine's Python) sits behind the CheckContext and the runtime seam.

    host.py    Docker, GPUs, memory, MIG, driver, ROCm, shared memory, ulimits, port
    model.py   checkpoint, disk, Hugging Face token, API key, KV capacity
    image.py   the engine image and its vLLM's schema; a P/D plan's router image
    fabric.py  a P/D plan's KV transfer over UCX, and fabric.rdma's HCAs, on this host
    deep.py    --deep: the engine's torch on the plan's GPUs and an all-reduce
    engine_config.py  --deep: vLLM builds its configuration from the plan's argv (its dry run)
    lock.py    --locked FILE: the deployment against its lock

The registry is keyed by CheckId (m31ctl/runtime/gates.py), the ids the runtimes gate launches
on: `_check` matches every member, so a check id without a check is a type error (mypy's
exhaustiveness check), not a gate silently dropped from a preflight.
"""

from __future__ import annotations

from typing import NoReturn

from m31ctl.deployment import Deployment
from m31ctl.doctor.base import Check
from m31ctl.doctor.checks.deep import collective, engine_image
from m31ctl.doctor.checks.engine_config import ENGINE_CONFIG_TIMEOUT_S, engine_config
from m31ctl.doctor.checks.fabric import crosses_a_fabric, fabric
from m31ctl.doctor.checks.host import (
    docker_daemon,
    driver,
    gpu_memory,
    gpu_runtime,
    gpus,
    memlock,
    mig,
    port,
    rocm,
    shm,
)
from m31ctl.doctor.checks.image import applies_to_a_pair, engine, image, router
from m31ctl.doctor.checks.lock import LOCK_CHECK_TIMEOUT_S, lock
from m31ctl.doctor.checks.model import api_key, capacity, checkpoint, checkpoint_state, disk, hf_token
from m31ctl.doctor.engine_probe import DEEP_RUN_LIMIT_S
from m31ctl.runtime.gates import CheckId

# The deep probe's own bounds (start-up, all-reduce), and time to read it.
_DEEP_LIMIT_S = DEEP_RUN_LIMIT_S + 30


def _unregistered(check_id: NoReturn) -> NoReturn:
    """typing.assert_never (Python 3.11+; m31ctl runs on 3.10): mypy rejects a call that a
    member the match lacks can reach."""
    raise AssertionError(f"no doctor check is registered for {check_id}")


def _check(check_id: CheckId) -> Check:
    match check_id:
        case CheckId.DOCKER:
            return Check(check_id, "Docker daemon", docker_daemon)
        case CheckId.GPU_RUNTIME:
            return Check(check_id, "GPU container runtime", gpu_runtime)
        case CheckId.GPUS:
            return Check(check_id, "GPUs", gpus, timeout_s=1)
        case CheckId.GPU_MEMORY:
            return Check(check_id, "Free GPU memory", gpu_memory, timeout_s=1)
        case CheckId.MIG:
            return Check(check_id, "MIG mode", mig, timeout_s=1)
        case CheckId.DRIVER:
            return Check(check_id, "NVIDIA driver / CUDA", driver, timeout_s=1)
        case CheckId.ROCM:
            return Check(check_id, "ROCm", rocm, timeout_s=1)
        case CheckId.DISK:
            return Check(check_id, "Disk for the checkpoint", disk)
        case CheckId.SHM:
            return Check(check_id, "Shared memory", shm, timeout_s=1)
        case CheckId.MEMLOCK:
            return Check(check_id, "Ulimits and /dev/shm, tried", memlock, timeout_s=15)
        case CheckId.CHECKPOINT:
            return Check(check_id, "Checkpoint complete", checkpoint, timeout_s=5)
        case CheckId.PORT:
            return Check(check_id, "Port", port, timeout_s=1)
        case CheckId.FABRIC:
            # ucx_info -v, where the host has it, within the probe runner's 10 s.
            return Check(
                check_id, "Fabric: KV transfer (UCX), RDMA", fabric, timeout_s=12, applies=crosses_a_fabric
            )
        case CheckId.HF_TOKEN:
            return Check(check_id, "Hugging Face token", hf_token, timeout_s=1)
        case CheckId.API_KEY:
            return Check(check_id, "API key", api_key, timeout_s=1)
        case CheckId.IMAGE:
            return Check(check_id, "Engine image", image, timeout_s=8)
        case CheckId.CAPACITY:
            return Check(check_id, "KV capacity", capacity, timeout_s=2)
        case CheckId.ENGINE:
            return Check(check_id, "Engine accepts the argv", engine, timeout_s=120)
        case CheckId.ROUTER:
            return Check(
                check_id, "Router image runs vllm-router", router, timeout_s=90, applies=applies_to_a_pair
            )
        case CheckId.ENGINE_IMAGE:
            return Check(
                check_id, "Engine on the plan's GPUs", engine_image, timeout_s=_DEEP_LIMIT_S, deep=True
            )
        case CheckId.COLLECTIVE:
            return Check(
                check_id, "All-reduce on the plan's GPUs", collective, timeout_s=_DEEP_LIMIT_S, deep=True
            )
        case CheckId.ENGINE_CONFIG:
            return Check(
                check_id,
                "vLLM builds the plan's configuration",
                engine_config,
                timeout_s=ENGINE_CONFIG_TIMEOUT_S + 30,
                deep=True,
            )
        case CheckId.LOCK:
            return Check(check_id, "Lock file", lock, timeout_s=LOCK_CHECK_TIMEOUT_S, locked=True)
        case _:
            _unregistered(check_id)


def all_checks(deployment: Deployment | None = None) -> list[Check]:
    """One check per CheckId, in the enum's order (the report's), less those with nothing to
    judge in `deployment` (Check.applies: the fabric check only where KV moves over UCX)."""
    checks = (_check(check_id) for check_id in CheckId)
    return [check for check in checks if check.applies(deployment)]


def get_check(check_id: CheckId) -> Check:
    return _check(check_id)


__all__ = ["all_checks", "checkpoint_state", "disk", "get_check"]
