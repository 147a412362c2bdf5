"""The checks `m31ctl doctor` and `launch` run, in the order they are reported. Each reads the
Context and returns an Outcome; what they call to find out (the Docker Engine, a script run with
the engine's Python) sits behind the Context and the runtime seam.

    host.py    Docker, GPUs, memory, MIG, driver, ROCm, shared memory, ulimits, port
    model.py   checkpoint, disk, Hugging Face token, API key, KV capacity
    image.py   the engine image and its vLLM's schema
    deep.py    --deep: the engine's torch on the plan's GPUs and an all-reduce
    engine_config.py  --deep: vLLM builds its configuration from the plan's argv (its dry run)
"""

from __future__ import annotations

from m31ctl.doctor.base import Check
from m31ctl.doctor.checks.deep import collective, engine_image
from m31ctl.doctor.checks.engine_config import ENGINE_CONFIG_TIMEOUT_S, engine_config
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
from m31ctl.doctor.checks.image import engine, image
from m31ctl.doctor.checks.model import api_key, capacity, checkpoint, checkpoint_state, disk, hf_token
from m31ctl.doctor.engine_probe import DEEP_TIMEOUT_S


def all_checks() -> list[Check]:
    deep_limit = DEEP_TIMEOUT_S + 30  # the probe's own bound, and time to start it and read it
    return [
        Check("docker", "Docker daemon", docker_daemon),
        Check("gpu-runtime", "GPU container runtime", gpu_runtime),
        Check("gpus", "GPUs", gpus, timeout_s=1),
        Check("gpu-memory", "Free GPU memory", gpu_memory, timeout_s=1),
        Check("mig", "MIG mode", mig, timeout_s=1),
        Check("driver", "NVIDIA driver / CUDA", driver, timeout_s=1),
        Check("rocm", "ROCm", rocm, timeout_s=1),
        Check("disk", "Disk for the checkpoint", disk),
        Check("shm", "Shared memory", shm, timeout_s=1),
        Check("memlock", "Ulimits and /dev/shm, tried", memlock, timeout_s=15),
        Check("checkpoint", "Checkpoint complete", checkpoint, timeout_s=5),
        Check("port", "Port", port, timeout_s=1),
        Check("hf-token", "Hugging Face token", hf_token, timeout_s=1),
        Check("api-key", "API key", api_key, timeout_s=1),
        Check("image", "Engine image", image, timeout_s=8),
        Check("capacity", "KV capacity", capacity, timeout_s=2),
        Check("engine", "Engine accepts the argv", engine, timeout_s=120),
        Check("engine-image", "Engine on the plan's GPUs", engine_image, timeout_s=deep_limit, deep=True),
        Check("collective", "All-reduce on the plan's GPUs", collective, timeout_s=deep_limit, deep=True),
        Check(
            "engine-config",
            "vLLM builds the plan's configuration",
            engine_config,
            timeout_s=ENGINE_CONFIG_TIMEOUT_S + 30,
            deep=True,
        ),
    ]


__all__ = ["all_checks", "checkpoint_state", "disk"]
