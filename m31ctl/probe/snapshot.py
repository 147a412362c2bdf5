"""The probe seam: each method returns GPUs and host facts, or says why it cannot."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from m31ctl.hardware import GPU, Fabric


class ProbeUnavailable(Exception):
    """This method cannot answer on this host (library missing, driver not loaded, ...)."""


@dataclass(frozen=True)
class Snapshot:
    """What one probe method saw, before visibility filtering and classification."""

    vendor: str
    method: str
    gpus: tuple[GPU, ...]
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    rocm_version: str | None = None
    # Pairs of GPU indices joined by NVLink / xGMI.
    links: frozenset[tuple[int, int]] = frozenset()
    link_kind: str | None = None  # "nvlink" | "xgmi"
    fabric: Mapping[int, Fabric] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class CommandResult:
    returncode: int
    stdout: str
    stderr: str


Runner = Callable[[Sequence[str]], CommandResult]


def require_success(result: CommandResult, tool: str) -> CommandResult:
    """A tool that answered with an error is unavailable; its first line says why."""
    if result.returncode != 0:
        lines = (result.stdout + result.stderr).strip().splitlines()
        raise ProbeUnavailable(f"{tool} failed: {lines[0] if lines else f'exit {result.returncode}'}")
    return result


def json_output(runner: Runner, argv: Sequence[str]) -> Any:
    """Run a tool's JSON mode and parse what it printed."""
    result = require_success(runner(argv), argv[0])
    try:
        return json.loads(result.stdout)
    except ValueError:
        raise ProbeUnavailable(f"{argv[0]} printed no JSON") from None


def run_command(argv: Sequence[str], timeout: float = 10.0) -> CommandResult:
    """Run a probe tool; a missing binary is ProbeUnavailable, never a crash."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except FileNotFoundError:
        raise ProbeUnavailable(f"{argv[0]} not found on PATH") from None
    except PermissionError:
        raise ProbeUnavailable(f"permission denied running {argv[0]}") from None
    except subprocess.TimeoutExpired:
        raise ProbeUnavailable(f"{argv[0]} did not answer within {timeout:g} s") from None
    return CommandResult(proc.returncode, proc.stdout, proc.stderr)


def environ() -> Mapping[str, str]:
    return os.environ
