"""The ids of doctor's checks, as typed values: each runtime names the checks that gate a launch
on it with these, so a misspelt gate is a name error, not a check silently left out.

They live here, not in doctor/, because the runtimes may not import doctor (data flows one way:
doctor imports runtime). doctor's registry is keyed by the same strings; deploy.py refuses a gate
that no registered check carries, and tests/test_runtime.py checks that every member names one.
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
    HF_TOKEN = "hf-token"
    API_KEY = "api-key"
    IMAGE = "image"
    CAPACITY = "capacity"
    ENGINE = "engine"
    ENGINE_IMAGE = "engine-image"
    COLLECTIVE = "collective"

    def __str__(self) -> str:
        return self.value


def unknown_gates(gates: tuple[CheckId, ...], registered: set[str]) -> list[CheckId]:
    """The gates no registered check carries (a check renamed or removed in doctor)."""
    return [gate for gate in gates if gate.value not in registered]
