"""What a vLLM server's own log says about its start: when each milestone was logged, the
durations vLLM measured itself, and the memory figures its GPU worker profiled. Pure: text in,
typed records out (the GPU rehearsal's captures are read with it; docs/gpu-rehearsal.md).

The wording is vLLM 0.26.0's (and 0.32's, which keeps these lines): v1/engine/core.py "init
engine (profile, create kv cache, warmup model) took", v1/worker/gpu/model_runner.py "Model
loading took" and "Graph capturing finished in", compilation/monitor.py "torch.compile took",
v1/worker/gpu_worker.py "Memory profiling takes ..." (DEBUG) and "Available KV cache memory",
v1/core/kv_cache_utils.py "GPU KV cache size". A line that is not there reads as None.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import NamedTuple

GIB = 1024**3

# vLLM's log prefix: "(EngineCore pid=12) INFO 12-01 20:30:15 [file.py:116] message"
_STAMP = re.compile(r"(?:DEBUG|INFO|WARNING|ERROR) (\d\d-\d\d \d\d:\d\d:\d\d) \[")


class Milestone(NamedTuple):
    name: str
    pattern: re.Pattern[str]


# In the order a start goes through them; each is the first line that matches.
MILESTONES: tuple[Milestone, ...] = tuple(
    Milestone(name, re.compile(pattern))
    for name, pattern in (
        # 0.26 prints a banner, not 0.32's "vLLM API server version"; the arguments follow either
        ("api server", r"vLLM API server version|non-default args:"),
        ("engine core", r"Initializing a V1 LLM engine"),
        ("weights start", r"Loading weights on|Loading safetensors"),
        ("weights loaded", r"Model loading took"),
        ("compile start", r"Dynamo bytecode transform time"),
        ("compiled", r"torch\.compile took"),
        ("profiled", r"Available KV cache memory"),
        ("graphs captured", r"Graph capturing finished"),
        ("engine ready", r"init engine \(profile, create kv cache, warmup model\) took"),
        ("serving", r"Starting vLLM (?:API )?server|Application startup complete"),
    )
)


class StartupLog(NamedTuple):
    milestones: dict[str, float]  # seconds since the log's first time stamp
    model_loading_s: float | None
    compile_s: float | None
    memory_profiling_s: float | None
    graph_capture_s: float | None
    graph_pool_gib: float | None
    init_engine_s: float | None
    requested_gib: float | None
    available_kv_gib: float | None
    kv_cache_tokens: int | None
    weights_gib: float | None  # the profile's parts (DEBUG): weights, torch peak, non-torch
    torch_peak_gib: float | None
    non_torch_gib: float | None


def _stamp(line: str, year: int) -> datetime | None:
    found = _STAMP.search(line)
    return datetime.strptime(f"{year}-{found.group(1)}", "%Y-%m-%d %H:%M:%S") if found else None


def _number(pattern: str, text: str) -> float | None:
    found = re.search(pattern, text)
    return float(found.group(1).replace(",", "")) if found else None


def read_startup_log(text: str, year: int = 2026) -> StartupLog:
    """The figures of one server start (the log of one start: the native runtime appends)."""
    first: datetime | None = None
    milestones: dict[str, float] = {}
    for line in text.splitlines():
        when = _stamp(line, year)
        if when is None:
            continue
        first = first or when
        for milestone in MILESTONES:
            if milestone.name not in milestones and milestone.pattern.search(line):
                milestones[milestone.name] = (when - first).total_seconds()
    tokens = _number(r"GPU KV cache size: ([\d,]+) tokens", text)
    return StartupLog(
        milestones=milestones,
        model_loading_s=_number(r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds", text),
        compile_s=_number(r"torch\.compile took ([\d.]+) s in total", text),
        memory_profiling_s=_number(r"Memory profiling takes ([\d.]+) seconds", text),
        graph_capture_s=_number(r"Graph capturing finished in ([\d.]+) secs", text),
        graph_pool_gib=_number(r"Graph capturing finished in [\d.]+ secs, took ([\d.]+) GiB", text),
        init_engine_s=_number(
            r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s", text
        ),
        requested_gib=_number(r"worker requested memory: ([\d.]+) ?GiB", text),
        available_kv_gib=_number(r"Available KV cache memory: ([\d.]+) GiB", text),
        kv_cache_tokens=int(tokens) if tokens is not None else None,
        weights_gib=_number(r"weights memory: ([\d.]+) ?GiB", text),
        torch_peak_gib=_number(r"torch peak memory increase: ([\d.]+) ?GiB", text),
        non_torch_gib=_number(r"non-torch forward increase memory: ([\d.]+) ?GiB", text),
    )
