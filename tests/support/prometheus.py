"""A real Prometheus in a test: where its binaries are, every query m31ctl's monitoring files
hold, and the bounded waits and the stop around a process the test started (the Prometheus, the
server it scrapes). tests/render/test_observability.py runs it against a single vLLM,
tests/runtime/test_launch_pd.py against a launched P/D group."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from typing import Any

import pytest

from m31ctl.render import observability as obs

PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
WAIT_S = 600  # generous: a condition is awaited, never a duration trusted


def all_queries(deployment: Any) -> list[tuple[str, str]]:
    """(what, PromQL) for every dashboard query and every alert's measured signal."""
    panels = [(f"panel {p.title!r} {q.legend}", q.expr) for p in obs.panels(deployment) for q in p.queries]
    return panels + [(f"alert {a.name}", a.signal.expr) for a in obs.alerts(deployment)]


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)


def until(what: str, check: Any, deadline_s: float = WAIT_S) -> Any:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            found = check()
        except OSError:
            found = None
        if found:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(1)


def stop(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is None:
        os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
