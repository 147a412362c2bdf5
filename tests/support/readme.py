"""The commands README.md and the docs it sends a user to (DOCUMENTS) show, read from those files
and run as written: the reader (their ```console blocks' `$ ` lines and their ```bash blocks,
continuation lines joined), the one command that starts with given words, and the runner (through
bash, `m31ctl` on PATH this checkout's, in a scratch directory). tests/test_readme_commands.py
runs them all; a test that runs one command itself and checks more than its exit code
(tests/rehearsal/test_rehearse_layouts.py) takes it from here."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from tests.conftest import ROOT

README = ROOT / "README.md"
# The README and the docs that took its user material (issue 51): every example in them runs as
# written. The other docs (decisions, gpu-rehearsal, ci, ...) quote commands of other hosts.
DOCUMENTS = (
    README,
    ROOT / "docs" / "guide.md",
    ROOT / "docs" / "reference.md",
    ROOT / "docs" / "operations.md",
    ROOT / "docs" / "development.md",
)


class Command(NamedTuple):
    text: str  # as the file writes it, continuation lines joined, the trailing comment dropped
    line: int  # where it starts in its file
    source: str = "README.md"  # the file, relative to the repository root


def readme_commands(text: str, source: str = "README.md") -> list[Command]:
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
                found.append(Command(command, number, source))
    return found


def documented_commands() -> list[Command]:
    """Every command README.md and DOCUMENTS show, file by file, in the order written."""
    return [
        command
        for path in DOCUMENTS
        for command in readme_commands(path.read_text(), str(path.relative_to(ROOT)))
    ]


def readme_command(start: str) -> Command:
    """The one command README.md or a file of DOCUMENTS shows that starts with `start`, as
    written there."""
    found = [c for c in documented_commands() if c.text.startswith(start)]
    assert len(found) == 1, f"README.md and docs show {len(found)} commands starting {start!r}: {found}"
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
