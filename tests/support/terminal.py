"""m31ctl run with one of its streams on a pseudo-terminal of a given size, as a user's terminal
would hold it (tests/cli/test_error_wrap.py, tests/cli/test_screen.py)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from collections.abc import Mapping
from pathlib import Path

from tests.conftest import ROOT


def on_a_terminal(
    argv: list[str],
    stream: str,
    columns: int,
    *,
    rows: int = 50,
    cwd: Path = ROOT,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
) -> tuple[int, str]:
    """`m31ctl ARGV` with its `stream` ("stdout" or "stderr") on a pty of `columns` x `rows` (the
    other stream discarded): the exit code and what the terminal got, colours left out."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    streams = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, stream: follower}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "m31ctl", *argv], **streams, cwd=cwd, env=env, timeout=timeout, check=False
        )
    finally:
        os.close(follower)
    said = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the follower side is closed and everything was read
            break
        if not chunk:
            break
        said += chunk
    os.close(leader)
    return done.returncode, re.sub(r"\x1b\[[0-9;]*m", "", said.decode().replace("\r\n", "\n"))
