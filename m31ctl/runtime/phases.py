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


# Which log lines mark each phase, in vLLM 0.32's own words (its logger calls; a real CPU start-up
# is tests/fixtures/vllm-logs/cpu-0.32.0-native-startup.log); the latest match in the log wins.
# Only lines that say a phase runs: "Enforce eager set, disabling torch.compile" and "Inductor
# compilation was disabled" mention compiling and mean the opposite, so no bare "compil" word.
_PATTERNS: tuple[tuple[re.Pattern[str], Phase], ...] = tuple(
    (re.compile(pattern, re.IGNORECASE), phase)
    for pattern, phase in (
        # entrypoints: "Starting vLLM server on http://...", uvicorn's "Application startup complete"
        (r"Application startup complete|Starting vLLM (?:API )?server|Uvicorn running", Phase.SERVING),
        # gpu_model_runner.py: tqdm "Capturing CUDA graphs (...)", "Graph capturing finished in"
        (r"Capturing CUDA graph|Graph capturing finished", Phase.CUDA_GRAPHS),
        # compilation/monitor.py "Starting torch.compile", "torch.compile took %.2f s in total";
        # decorators.py "torch.compile and initial profiling/warmup run together took"; older
        # vLLM "torch.compile takes %.2f s in total"; backends.py "Dynamo bytecode transform
        # time", "Compiling a graph for compile range", "Directly load the compiled graph(s)"
        (
            r"Starting torch\.compile|torch\.compile (?:takes|took|and initial profiling)"
            r"|Dynamo bytecode transform|Compiling a graph for|Directly load (?:the compiled graph|AOT compilation)",
            Phase.COMPILING,
        ),
        # model runners "Starting to load model", default_loader "Loading weights took", tqdm
        # "Loading safetensors checkpoint shards", "Model loading took"
        (r"Starting to load model|Loading weights|Loading safetensors|checkpoint shards|Model loading took",
         Phase.LOADING),
        (r"Downloading|Fetching \d+ files", Phase.DOWNLOADING),
        # api_utils "non-default args" (the API server's first line), core.py "Initializing a V1
        # LLM engine" (not "Initializing model took", which the loader prints while loading)
        (r"vLLM API server version|non-default args:|Initializing a V\d+ LLM engine", Phase.STARTING),
    )
)  # fmt: skip


def latest_phase(log_text: str) -> Phase | None:
    """The latest phase the log has reached."""
    best: tuple[int, Phase] | None = None
    for pattern, phase in _PATTERNS:
        for match in pattern.finditer(log_text):
            if best is None or match.start() > best[0]:
                best = (match.start(), phase)
    return best[1] if best else None
