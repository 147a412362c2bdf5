from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
SHARED_GPU = ROOT.parent / "shared" / "fixtures" / "gpu"


def run_cli(
    *args: str, env: dict[str, str] | None = None, input: str | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run m31ctl as a whole process, as users and CI do."""
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "m31ctl", *args],
        capture_output=True,
        text=True,
        env=full_env,
        input=input,
        cwd=cwd,
        timeout=120,
        check=False,
    )


@pytest.fixture
def cli():
    return run_cli
