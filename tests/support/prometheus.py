"""A real Prometheus in a test: where its binaries are, every query m31ctl's monitoring files
hold, its start on the rendered files (scraping every second), and the bounded waits and the stop
around a process the test started (the Prometheus, the server it scrapes).
tests/render/test_observability.py runs it against a single vLLM, tests/runtime/test_launch_pd.py
against a launched P/D group."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from m31ctl.render import observability as obs

PROMETHEUS, PROMTOOL = shutil.which("prometheus"), shutil.which("promtool")
WAIT_S = 600  # generous: a condition is awaited, never a duration trusted
# How often the test's Prometheus scrapes and evaluates: the rendered 15 s would be waited out
# (up to 15 s for the first scrape, as much again for one after a load) and prove nothing more.
TEST_INTERVAL = "1s"


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


def start(rendered: Path, tmp_path: Path, web: int) -> subprocess.Popen[bytes]:
    """A real Prometheus on the rendered monitoring files (`rendered`: the folder with
    prometheus.yml and the rules it names) listening on 127.0.0.1:`web`. It reads a copy of
    prometheus.yml beside the original that differs in the global scrape and evaluation interval
    alone (TEST_INTERVAL): the targets, labels, rules and queries are the rendered ones."""
    config = yaml.safe_load((rendered / "prometheus.yml").read_text())
    assert set(config["global"]) == {"scrape_interval", "evaluation_interval"}, config["global"]
    assert all("scrape_interval" not in job for job in config["scrape_configs"])  # the global one rules
    config["global"] = {"scrape_interval": TEST_INTERVAL, "evaluation_interval": TEST_INTERVAL}
    fast = rendered / "prometheus-test.yml"  # beside the original: rule_files resolve the same
    fast.write_text(yaml.safe_dump(config))
    with (tmp_path / "prometheus.log").open("wb") as log:
        return subprocess.Popen(
            [PROMETHEUS or "prometheus", f"--config.file={fast}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{web}"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
