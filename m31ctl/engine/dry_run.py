"""Ask the engine itself whether it would start a plan: run config_check.py with the engine's own
Python on the plan's exact `vllm serve` argv and read its one JSON answer.

vLLM builds its configuration (and refuses a bad one) before it loads weights; config_check.py
does only that, offline. `dry_run_config` is the typed way in: given the engine's Python (a local
interpreter, or a command prefix that runs python3 in the engine image) and the argv the adapter
produces, it returns an `EngineConfigCheck`: ok with what vLLM resolved, or vLLM's own refusal.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from m31ctl.errors import M31Error

CONFIG_CHECK_SCRIPT = Path(__file__).resolve().parent / "config_check.py"


class EngineConfigCheck(NamedTuple):
    """config_check.py's answer. `stage`: None when ok; "import", "parse", "config" or "usage"
    where it stopped. `reason` is vLLM's own sentence (pydantic's wrapping removed); `message`
    the exception text verbatim."""

    ok: bool
    vllm: str | None
    platform: str | None
    resolved: Mapping[str, Any]
    stage: str | None = None
    error: str | None = None
    reason: str | None = None
    message: str | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EngineConfigCheck:
        return cls(
            ok=bool(data.get("ok")),
            vllm=data.get("vllm"),
            platform=data.get("platform"),
            resolved=dict(data.get("resolved") or {}),
            stage=data.get("stage"),
            error=data.get("error"),
            reason=data.get("reason") or data.get("message"),
            message=data.get("message"),
        )

    @property
    def refusal(self) -> str | None:
        """What vLLM said when it refused, or None when it built the configuration."""
        return None if self.ok else self.reason


class EngineCheckFailed(M31Error):
    """config_check.py did not answer (the interpreter is missing, it crashed, it timed out)."""


def dry_run_config(
    python: str | Sequence[str],
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
    script: str | None = None,
) -> EngineConfigCheck:
    """Build vLLM's engine config from `argv` (what follows `vllm serve`: the model first) with
    `python`, offline (HF_HUB_OFFLINE=1), on this host's platform. `python` is an interpreter
    path, or a command that ends in one (e.g. a `docker run ... IMAGE python3` prefix, with
    `script` the path config_check.py has inside the container). `env` adds to this process's
    environment (the plan's runtime.env; VLLM_CPU_OMP_THREADS_BIND for TP on the CPU build)."""
    prefix = [python] if isinstance(python, str) else list(python)
    command = [*prefix, script or str(CONFIG_CHECK_SCRIPT), "--", *argv]
    environment = {**os.environ, **(env or {}), "HF_HUB_OFFLINE": "1"}
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, env=environment, check=False
        )
    except FileNotFoundError as exc:
        raise EngineCheckFailed(
            f"cannot run the engine's Python: {exc}", hint="check the interpreter path"
        ) from None
    except subprocess.TimeoutExpired:
        raise EngineCheckFailed(
            f"the engine's configuration check did not answer within {timeout:g} s"
        ) from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    try:
        data = json.loads(lines[-1]) if lines else None
    except ValueError:
        data = None
    if not isinstance(data, dict):
        tail = tuple((done.stderr or done.stdout).strip().splitlines()[-12:])
        raise EngineCheckFailed(
            f"the engine's configuration check gave no answer (exit {done.returncode})", details=tail
        )
    return EngineConfigCheck.from_json(data)
