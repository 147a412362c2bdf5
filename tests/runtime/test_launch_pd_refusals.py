"""A P/D plan where launch cannot run it, and how status shows a group with a part down (issue 36),
without vLLM: a runtime that runs no group refuses it in one line before any check; a group record whose
router runs (a real process) and whose decode record is missing is shown degraded, naming the
part."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from m31ctl.deployment import derive
from m31ctl.errors import InputError
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.render import PD_RENDERERS, RENDERERS
from m31ctl.runtime.native_group import statuses
from m31ctl.runtime.native_state import NativeServer, process_identity
from m31ctl.runtime.protocol import LaunchOptions
from tests.conftest import run_cli
from tests.support import cli_json


class _Single:
    """A runtime that runs one server only (every registered one runs a P/D group now)."""

    name, gates, runs_groups = "single", (), False


def test_a_runtime_without_groups_refuses_a_pd_plan_in_one_line_before_any_check(monkeypatch):
    from m31ctl import deploy

    registered = deploy.get_runtime
    monkeypatch.setattr(
        deploy, "get_runtime", lambda name: _Single() if name == "single" else registered(name)
    )
    d = derive(resolve(PlanRequest(simulated("cpu"), variant="pd")))
    options = LaunchOptions(report=lambda _: None, confirm=lambda _: False)
    for attempt in (lambda: deploy.launch(d, "single", options), lambda: deploy.dry_run(d, "single")):
        with pytest.raises(InputError) as refused:
            attempt()
        error = refused.value
        assert error.message == "the single runtime does not launch a P/D plan (prefill, decode and router)"
        # The hint names the registered runtimes that run a group, and targets that render one.
        assert "--runtime docker or native" in str(error.hint)
        named = {target for target in RENDERERS if re.search(rf"\b{target}\b", str(error.hint))}
        assert named and named <= set(PD_RENDERERS), named


def test_native_dry_run_shows_the_front_on_the_port_and_the_router_on_loopback():
    """issue 49: the group's command line is the front's, on the plan's port, forwarding to the
    router on loopback (port 0: launch picks a free one); the router no longer takes the port."""
    shown = run_cli(
        "launch", "--hardware", "cpu", "--variant", "pd", "--runtime", "native", "--dry-run", "--json",
        "--set", "runtime.api_key=true", "--port", "8123",
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    detail = cli_json.data(shown.stdout)
    front, router = detail["front"], detail["router"]
    assert detail["command"] == front and front[1] == "-c" and "m31ctl's router front" in front[2]
    assert front[front.index("--port") + 1] == "8123" and front[front.index("--upstream-port") + 1] == "0"
    assert front[-2:] == ["--key-env", "VLLM_API_KEY"]
    assert router[router.index("--host") + 1] == "127.0.0.1" and router[router.index("--port") + 1] == "0"


def test_native_dry_run_shows_the_three_command_lines():
    shown = run_cli(
        "launch", "--hardware", "cpu", "--variant", "pd", "--runtime", "native", "--dry-run", "--json"
    )
    assert shown.returncode == 0, shown.stderr
    detail = cli_json.data(shown.stdout)
    text = json.dumps(detail)
    assert "kv_producer" in text and "kv_consumer" in text and "--vllm-pd-disaggregation" in text


def _record(name: str, pid: int, identity: str | None, **extra: object) -> NativeServer:
    return NativeServer(
        name=name, pid=pid, plan_hash="abc", recipe="cpu", variant="pd", profile="latency",
        bind="127.0.0.1", port=1, log="/dev/null", argv=("sleep",), started_at=time.time(),
        stop_timeout=5, identity=identity, **extra,  # type: ignore[arg-type]
    )  # fmt: skip


def test_a_group_with_a_part_down_is_shown_degraded_naming_it():
    router = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        identity = process_identity(router.pid)
        group = _record("g", router.pid, identity, parts=("g-prefill", "g-decode"))
        prefill = _record("g-prefill", router.pid, identity, group="g")
        rows = statuses([group, prefill])
    finally:
        router.kill()
        router.wait()
    assert [(r.name, r.state, r.group) for r in rows] == [
        ("g", "degraded: g-decode down", None),
        ("g-prefill", "running", "g"),
        ("g-decode", "missing", "g"),
    ]
