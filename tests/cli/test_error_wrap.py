"""An error line on an 80-column terminal (issue 51): wrapped between words, continuation lines
indented, no word split, so a setting, a path or a `--set key=value` can still be copied; piped,
as in CI logs, it stays one line for grep."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT
from tests.support.terminal import on_a_terminal

# A refusal whose one line is far wider than 80 columns and ends in a hint with settings in it.
ARGS = [
    "plan",
    "--hardware",
    "b300x8",
    "--set",
    "disaggregation.enabled=true",
    "--set",
    "cache.cpu_offload_gib=64",
]


def _on_a_terminal(columns: int) -> tuple[int, str]:
    return on_a_terminal(ARGS, "stderr", columns, rows=24, timeout=60)


def test_an_error_fits_an_80_column_terminal_word_by_word():
    piped = subprocess.run([sys.executable, "-m", "m31ctl", *ARGS], capture_output=True, text=True, cwd=ROOT)
    assert piped.returncode == 2 and len(piped.stderr.splitlines()) == 1
    (one_line,) = piped.stderr.splitlines()
    assert len(one_line) > 80
    code, shown = _on_a_terminal(80)
    lines = shown.strip("\n").split("\n")
    assert code == 2 and len(lines) > 1
    assert all(len(line) <= 80 for line in lines), lines
    assert all(line.startswith("  ") for line in lines[1:])
    assert " ".join(line.strip() for line in lines) == one_line  # the same words, none split
    assert "cache.cpu_offload_gib" in shown and "disaggregation.enabled" in shown
