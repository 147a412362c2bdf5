"""The tests' vLLM for the Python scripts here: scripts/vllm-env is the one place that says where
it lives (outside the clone, keyed by its pins; M31CTL_VLLM_VENV names another)."""

from __future__ import annotations

import subprocess
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent


def python() -> Path:
    """The vLLM environment's Python (scripts/setup-vllm makes it)."""
    return Path(subprocess.check_output([str(SCRIPTS / "vllm-env"), "python"], text=True).strip())
