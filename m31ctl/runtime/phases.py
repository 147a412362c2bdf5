"""Startup phases of a vLLM server, as its log shows them: one enum, read by the readiness wait,
the watchdog's budgets and the CLI's progress display. The values are the words `launch --json`
prints in its phase events (CI logs match on them), so they never change."""

from __future__ import annotations

import re
from enum import Enum


class Phase(str, Enum):
    STARTING = "starting the engine"
    DOWNLOADING = "downloading the checkpoint"
    LOADING = "loading weights"
    COMPILING = "compiling"
    CUDA_GRAPHS = "capturing CUDA graphs"
    SERVING = "serving"
    # Not a log line: /v1/models lists the served model (the wait's end).
    READY = "ready"
    # Not a log line either: the Docker Engine pulls the image before the container exists.
    PULLING = "pulling the image"

    def __str__(self) -> str:
        return self.value


# Which log lines mark each phase (vLLM 0.32's wording); the latest match in the log wins.
_PATTERNS: tuple[tuple[re.Pattern[str], Phase], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), phase)
    for pattern, phase in (
        (r"Application startup complete|Starting vLLM API server|Uvicorn running", Phase.SERVING),
        (r"Capturing CUDA graph|CUDA graphs", Phase.CUDA_GRAPHS),
        (r"torch\.compile|Compiling a graph|compilation", Phase.COMPILING),
        (r"Loading weights|Loading safetensors|checkpoint shards", Phase.LOADING),
        (r"Downloading|Fetching \d+ files", Phase.DOWNLOADING),
        (r"vLLM API server version|Initializing", Phase.STARTING),
    )
)


def latest_phase(log_text: str) -> Phase | None:
    """The latest phase the log has reached."""
    best: tuple[int, Phase] | None = None
    for pattern, phase in _PATTERNS:
        for match in pattern.finditer(log_text):
            if best is None or match.start() > best[0]:
                best = (match.start(), phase)
    return best[1] if best else None
