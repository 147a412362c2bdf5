"""launch --blue-green for real, natively, with the stand-in engine that answers verify's checks
(tests/runtime/gated_standin, over tests/standin_vllm): the switch to another port with the
endpoint move in --json, the gate failing (the old server keeps serving), a plain launch that
would start a second server refused, and --rollback putting the previous plan back. Each engine
starts in under a second; the file runs in a few seconds."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, last_json, run_cli
from tests.support import cli_json
from tests.support.native import Native

GATED = ROOT / "tests" / "runtime" / "gated_standin"


@pytest.fixture
def native(tmp_path):
    server = Native(tmp_path)
    server.env["PYTHONPATH"] = str(GATED)
    yield server
    if server.state.is_dir():
        run_cli("stop", "--runtime", "native", env=server.env)
    for pid in server.engines():  # whatever a failing test left
        os.kill(pid, signal.SIGKILL)


def _served(endpoint: str) -> bool:
    try:
        return httpx.get(f"{endpoint}/v1/models", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def _servers(native: Native) -> dict[str, dict]:
    status = run_cli("status", "--runtime", "native", "--json", env=native.env)
    return {s["name"]: s for s in cli_json.data(status.stdout)["servers"]}


def test_a_changed_plan_switches_beside_the_old_one_and_rolls_back(native):
    first = run_cli(*native.args("--json"), env=native.env)
    assert first.returncode == 0, first.stderr
    old = last_json(first.stdout)
    changed = native.args("--blue-green", "--gate-no-load", "--set", "serving.max_model_len=1024", "--json")

    switched = run_cli(*changed, env=native.env)
    assert switched.returncode == 0, switched.stderr
    new = last_json(switched.stdout)
    green = f"{native.name}-green"
    assert new["server"] == green and new["action"] == "created" and new["ready"] is True
    assert new["endpoint"] == f"http://127.0.0.1:{native.port + 1}"  # the next free port
    rollout = new["rollout"]
    assert rollout["previous"] == {
        "server": native.name,
        "endpoint": old["endpoint"],
        "plan_hash": old["plan_hash"],
    }
    assert rollout["downtime_s"] is None and rollout["gpus"] == []
    assert {"plan", "chat", "stream", "max-model-len", "kv-cache-dtype"} <= set(rollout["gate"])
    assert rollout["rollback"] == f"m31ctl launch --rollback --name {native.name} --gate-no-load"
    assert "gate passed" in switched.stderr and f"stopping {native.name}" in switched.stderr
    assert not _served(old["endpoint"]) and _served(new["endpoint"])
    servers = _servers(native)
    assert list(servers) == [green] and servers[green]["plan_hash"] == new["plan_hash"]

    # The same plan again changes nothing, whichever slot serves it; a plain launch would start
    # a second server on the plan's own port beside the green one: refused.
    again = run_cli(*changed, env=native.env)
    assert again.returncode == 0 and last_json(again.stdout)["action"] == "unchanged", again.stderr
    assert last_json(again.stdout)["server"] == green
    plain = run_cli(*native.args("--set", "serving.max_model_len=1024"), env=native.env)
    assert plain.returncode == 4 and f"{green} serves {native.name}'s deployment" in plain.stderr
    assert "--blue-green" in plain.stderr and list(_servers(native)) == [green]

    back = run_cli(
        "launch", "--rollback", "--name", native.name, "--gate-no-load", "--skip-deep", "--timeout", "60",
        "--runtime", "native", "--json", env=native.env,
    )  # fmt: skip
    assert back.returncode == 0, back.stderr
    rolled = last_json(back.stdout)
    assert rolled["server"] == native.name and rolled["endpoint"] == old["endpoint"]
    assert rolled["plan_hash"] == old["plan_hash"]  # the first plan, in its own slot and port
    assert rolled["rollout"]["previous"]["server"] == green
    assert list(_servers(native)) == [native.name] and _served(old["endpoint"])
    kept = json.loads((native.state / "rollouts" / f"{native.name}.json").read_text())
    assert kept["server"] == green  # a second rollback goes forward again


def test_a_failed_gate_stops_the_new_server_and_the_old_keeps_serving(native):
    first = run_cli(*native.args("--json"), env=native.env)
    assert first.returncode == 0, first.stderr
    old = last_json(first.stdout)
    # /health and /v1/models answer, generation fails: ready, then the gate's chat fails.
    broken = native.args(
        "--blue-green", "--gate-no-load", "--set", "runtime.env.FAKE_ENGINE_GENERATION=fail", "--json"
    )
    result = run_cli(*broken, env=native.env)
    assert result.returncode == 1, result.stderr
    error = json.loads(result.stdout.splitlines()[-1])["error"]
    green = f"{native.name}-green"
    assert error["message"].startswith(f"blue-green: {green} failed the gate (")
    assert error["message"].endswith(f"it is stopped and {native.name} keeps serving on {old['endpoint']}")
    assert (
        "chat: " in error["message"]
        and error["hint"] == f"run the same checks on a server of this plan: m31ctl verify --name {green}"
    )
    assert "Traceback" not in result.stderr
    assert list(_servers(native)) == [native.name] and _served(old["endpoint"])
    assert not (native.state / "rollouts").exists()  # nothing replaced, nothing to roll back
    assert not (native.state / "native" / f"{green}.json").exists()


def test_bad_flag_combinations_are_one_line(native):
    for extra, says in (
        (("--accept-downtime",), "--accept-downtime applies to --blue-green or --rollback"),
        (("--blue-green", "--detach"), "--detach and --blue-green exclude each other"),
    ):
        refused = run_cli(*native.args(*extra), env=native.env)
        assert refused.returncode == 2 and says in refused.stderr and "Traceback" not in refused.stderr
    refused = run_cli("launch", "--rollback", "--name", native.name, "--runtime", "native", env=native.env)
    assert refused.returncode == 6 and f"no previous plan of {native.name} is kept" in refused.stderr
    refused = run_cli("launch", "--rollback", "--hardware", "cpu", "--name", native.name, env=native.env)
    assert refused.returncode == 2 and "plan options, --port and --locked do not apply" in refused.stderr
    assert not Path(native.state / "native").exists() or not list((native.state / "native").glob("*.json"))
