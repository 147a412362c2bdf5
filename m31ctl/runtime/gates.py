"""The ids of doctor's checks, as typed values: each runtime names the checks that gate a launch
on it with these, so a misspelt gate is a name error, not a check silently left out.

They live here, not in doctor/, because the runtimes may not import doctor (data flows one way:
doctor imports runtime). doctor's registry (m31ctl/doctor/checks/__init__.py) is keyed by these
members and builds one check per member through an exhaustive match, so a gate without a check
cannot be written: mypy refuses the match that lacks it. The declaration order is the report's.
"""

from __future__ import annotations

from enum import Enum


class CheckId(str, Enum):
    DOCKER = "docker"
    GPU_RUNTIME = "gpu-runtime"
    GPUS = "gpus"
    GPU_MEMORY = "gpu-memory"
    MIG = "mig"
    DRIVER = "driver"
    ROCM = "rocm"
    DISK = "disk"
    SHM = "shm"
    MEMLOCK = "memlock"
    CHECKPOINT = "checkpoint"
    PORT = "port"
    FABRIC = "fabric"  # a P/D plan whose KV moves over UCX only (doctor/checks/fabric.py)
    HF_TOKEN = "hf-token"
    API_KEY = "api-key"
    IMAGE = "image"
    CAPACITY = "capacity"
    ENGINE = "engine"
    ROUTER = "router"  # a P/D plan's router image runs vllm-router (doctor/checks/image.py)
    ENGINE_IMAGE = "engine-image"
    COLLECTIVE = "collective"
    ENGINE_CONFIG = "engine-config"
    LOCK = "lock"  # doctor --locked FILE only

    def __str__(self) -> str:
        return self.value
