"""README.md's commands, read from README.md itself and run as written: the reader (its
```console blocks' `$ ` lines and its ```bash blocks, continuation lines joined), the one command
that starts with given words, and the runner (through bash, `m31ctl` on PATH this checkout's, in
a scratch directory). tests/test_readme_commands.py runs them all; a test that runs one command
itself and checks more than its exit code (tests/rehearsal/test_rehearse_layouts.py) takes it
from here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from tests.conftest import ROOT

README = ROOT / "README.md"


class Command(NamedTuple):
    text: str  # as README writes it, continuation lines joined, the trailing comment dropped
    line: int  # where it starts in README.md


def readme_commands(text: str) -> list[Command]:
    found = []
    for block in re.finditer(r"^```(console|bash)\n(.*?)^```", text, re.S | re.M):
        kind, body = block.group(1), block.group(2)
        first_line = text.count("\n", 0, block.start(2)) + 1
        logical: list[tuple[int, str]] = []
        for number, raw in enumerate(body.splitlines(), start=first_line):
            if logical and logical[-1][1].endswith("\\"):
                logical[-1] = (logical[-1][0], logical[-1][1][:-1].rstrip() + " " + raw.strip())
            else:
                logical.append((number, raw.rstrip()))
        for number, line in logical:
            if kind == "console":
                if not line.startswith("$ "):
                    continue  # output, not a command
                line = line[2:]
            command = re.sub(r"\s+#\s.*$", "", line).strip()  # a comment after the command
            if command and not command.startswith("#"):
                found.append(Command(command, number))
    return found


def readme_command(start: str) -> Command:
    """The one command README.md shows that starts with `start`, as README writes it."""
    found = [c for c in readme_commands(README.read_text()) if c.text.startswith(start)]
    assert len(found) == 1, f"README.md shows {len(found)} commands starting {start!r}: {found}"
    return found[0]


def _shim(tmp: Path) -> Path:
    """A bin/ whose `m31ctl` is this checkout's, on this interpreter."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    shim = bin_dir / "m31ctl"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m m31ctl "$@"\n')
    shim.chmod(0o755)
    return bin_dir


def run_as_written(
    command: Command, tmp_path: Path, env: dict[str, str] | None = None, timeout: float = 1800
) -> subprocess.CompletedProcess[str]:
    """`command` through bash exactly as README writes it, `m31ctl` on PATH this checkout's, in
    the scratch directory `tmp_path` (scripts/ commands in the repository root)."""
    environ = {**os.environ, "PATH": f"{_shim(tmp_path)}{os.pathsep}{os.environ['PATH']}",
               "PYTHONPATH": str(ROOT), "COLUMNS": "100", **(env or {})}  # fmt: skip
    cwd = ROOT if command.text.startswith("scripts/") else tmp_path
    return subprocess.run(
        ["bash", "-o", "pipefail", "-c", command.text],
        cwd=cwd,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
