"""The runtime seam without Docker: the pure convergence decision, the registry, and the native
runtime driving a stand-in server (tests/standin_vllm) through the CLI in-process."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest

from m31ctl.errors import InputError
from m31ctl.runtime import RUNTIMES, get_runtime
from m31ctl.runtime.converge import Action, ExistingServer, decide
from tests.conftest import ROOT, last_json, run_cli
from tests.ports import free_port
from tests.support import cli_json

STANDIN = ROOT / "tests" / "standin_vllm"


@pytest.mark.parametrize(
    ("existing", "action", "confirm"),
    [
        (None, Action.CREATE, False),
        (ExistingServer(owned=False, plan_hash="abc", state="running"), Action.REFUSE, False),
        (ExistingServer(owned=True, plan_hash="abc", state="running", serving=True), Action.UNCHANGED, False),
        (ExistingServer(owned=True, plan_hash="abc", state="running", serving=False), Action.ADOPT, False),
        (ExistingServer(owned=True, plan_hash="abc", state="created"), Action.ADOPT, False),
        (ExistingServer(owned=True, plan_hash="abc", state="restarting"), Action.ADOPT, False),
        (ExistingServer(owned=True, plan_hash="abc", state="exited"), Action.RECREATE, False),
        (ExistingServer(owned=True, plan_hash="old", state="running", serving=True), Action.RECREATE, True),
        (ExistingServer(owned=True, plan_hash="old", state="exited"), Action.RECREATE, False),
        (ExistingServer(owned=True, plan_hash=None, state="running"), Action.RECREATE, True),
    ],
)
def test_decide(existing, action, confirm):
    decision = decide(existing, "abc")
    assert (decision.action, decision.needs_confirmation) == (action, confirm)
    assert decision.reason


def test_registry_builds_every_runtime_and_refuses_unknown_names():
    for name in RUNTIMES:
        runtime = get_runtime(name)
        assert runtime.name == name and runtime.gates
        for method in ("dry_run", "launch", "servers", "foreign", "logs", "stop", "bench_runner"):
            assert callable(getattr(runtime, method))
    with pytest.raises(InputError, match="unknown --runtime 'k8s'"):
        get_runtime("k8s")


@pytest.fixture
def native_env(tmp_path):
    state = tmp_path / "state"
    model = tmp_path / "model"
    model.mkdir()
    env = {
        "M31CTL_STATE_DIR": str(state),
        "PYTHONPATH": str(STANDIN),
        # No Docker Engine here, on purpose: commands without --runtime must still find native servers.
        "DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock",
    }
    name = f"m31ctl-native-{uuid.uuid4().hex[:6]}"
    port = free_port()
    args = [
        "launch", "--hardware", "cpu", "--runtime", "native", "--name", name, "--port", str(port),
        "--set", f"model.path={model}", "--timeout", "30",
        "--skip-deep",  # the stand-in engine has no torch to run the all-reduce with
    ]  # fmt: skip
    yield env, name, port, args, state
    run_cli("stop", "--runtime", "native", env=env)


def _pid(state: Path, name: str) -> int:
    return int(json.loads((state / "native" / f"{name}.json").read_text())["pid"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z"


def test_native_server_is_found_and_stopped_without_runtime_flag(native_env):
    env, name, port, args, state = native_env
    launched = run_cli(*args, "--json", env=env)
    assert launched.returncode == 0, launched.stderr
    assert last_json(launched.stdout)["runtime"] == "native"
    pid = _pid(state, name)

    status = run_cli("status", "--json", env=env)
    data = cli_json.data(status.stdout)
    assert [s["name"] for s in data["containers"]] == [name]
    assert "cannot reach the Docker Engine" in data["unreachable"]["docker"]
    assert status.returncode == 3  # the answer is incomplete: Docker could not be asked

    smoke = run_cli("smoke", "--json", env=env)
    assert smoke.returncode == 0, smoke.stderr
    assert cli_json.data(smoke.stdout)["endpoint"] == f"http://127.0.0.1:{port}"

    stopped = run_cli("stop", "--name", name, "--json", env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert cli_json.data(stopped.stdout) == {"stopped": [name]}
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)
    assert (
        cli_json.data(run_cli("status", "--runtime", "native", "--json", env=env).stdout)["containers"] == []
    )


def test_native_launch_refuses_a_missing_model_before_starting(native_env, tmp_path):
    env, name, _port, args, state = native_env
    missing = tmp_path / "no-such-model"
    result = run_cli(*args, "--set", f"model.path={missing}", env=env)
    assert result.returncode == 6
    assert "preflight check disk failed" in result.stderr and str(missing) in result.stderr
    assert not (state / "native" / f"{name}.json").exists()  # nothing started


def test_native_crash_while_loading_is_exit_5_with_log_lines(native_env):
    env, _name, _port, args, _state = native_env
    result = run_cli(*args, "--set", "runtime.env.FAKE_ENGINE_MODE=crash", env=env)
    assert result.returncode == 5
    assert "out of GPU memory" in result.stderr and "CUDA out of memory" in result.stderr


def test_stop_of_an_unknown_name_is_not_success(native_env):
    env, *_ = native_env
    result = run_cli("stop", "--runtime", "native", "--name", "nobody-here", env=env)
    assert result.returncode == 6 and "no m31ctl server named nobody-here" in result.stderr


def test_verify_smoke_and_status_use_the_servers_recorded_plan(native_env):
    """After a launch with plan options, bare `verify` and `smoke` act on the plan the server was
    launched with (before, verify probed this host for a plan: exit 6, no GPU); with plan options
    verify and status name the setting that differs."""
    env, name, port, args, _state = native_env
    launched = run_cli(*args, "--json", env=env)
    assert launched.returncode == 0, launched.stderr
    plan_hash = last_json(launched.stdout)["plan_hash"]

    bare = run_cli("verify", "--no-load", "--json", env=env)
    report = cli_json.data(bare.stdout)
    assert "checks" in report, (report, bare.stderr)
    checks = {c["id"]: c for c in report["checks"]}
    assert report["plan_hash"] == plan_hash and "no GPU" not in bare.stderr, bare.stderr
    assert checks["plan"]["status"] == "ok", checks["plan"]
    smoke = run_cli("smoke", "--json", env=env)
    assert smoke.returncode == 0 and cli_json.data(smoke.stdout)["ok"], smoke.stdout

    model = args[args.index("--set") + 1]
    changed = [
        "--hardware", "cpu", "--set", model, "--set", f"runtime.container_name={name}",
        "--set", f"runtime.port={port}", "--set", "serving.max_model_len=1024",
    ]  # fmt: skip
    other = run_cli("verify", *changed, "--no-load", "--json", env=env)
    checks = {c["id"]: c for c in cli_json.data(other.stdout)["checks"]}
    assert other.returncode == 1 and checks["plan"]["status"] == "fail"
    assert "serving.max_model_len: 2048 -> 1024" in checks["plan"]["message"], checks["plan"]
    status = cli_json.data(run_cli("status", *changed, "--runtime", "native", "--json", env=env).stdout)
    [row] = status["servers"]
    assert row["runs_plan"] is False and row["plan_differences"] == ["serving.max_model_len: 2048 -> 1024"]
    same = cli_json.data(run_cli("status", *changed[:-2], "--runtime", "native", "--json", env=env).stdout)
    assert same["servers"][0]["runs_plan"] is True and same["servers"][0]["plan_recorded"] is True


def test_a_pulled_checkpoint_reaches_the_container_offline():
    """launch pulls first and then sets HF_HUB_OFFLINE=1 for the engine: the native runtime
    inherits it, and the container runtime must pass it through the Engine API too (or the
    engine would ask the hub again inside its startup budget)."""
    from m31ctl.container import container_spec
    from m31ctl.deployment import derive
    from m31ctl.hardware import simulated
    from m31ctl.plan import PlanRequest, resolve
    from m31ctl.runtime.docker_create import create_container

    class Api:
        def __init__(self) -> None:
            self.created: dict[str, object] = {}

        def create_host_config(self, **kwargs: object) -> dict[str, object]:
            return kwargs

        def create_container(self, **kwargs: object) -> dict[str, str]:
            self.created = kwargs
            return {"Id": "x"}

    class Client:
        api = Api()

        class containers:
            @staticmethod
            def get(_id: str) -> str:
                return _id

    spec = container_spec(derive(resolve(PlanRequest(hardware=simulated("b300x4")))))
    create_container(Client(), spec, {"HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_x", "UNRELATED": "1"})
    env = Client.api.created["environment"]
    assert isinstance(env, dict)
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_TOKEN"] == "hf_x" and "UNRELATED" not in env


def test_logs_with_no_server_says_so(cli, tmp_path):
    """`m31ctl logs` with nothing launched printed nothing and exited 0 (issue 51): it now says
    there is no log to print, exit 6, as `logs --name` of a server that runs nowhere does."""
    env = {"M31CTL_STATE_DIR": str(tmp_path / "state")}
    done = cli("logs", "--runtime", "native", env=env)
    assert done.returncode == 6 and done.stdout == ""
    assert "no m31ctl server in the native runtime has a log to print" in done.stderr
    assert "m31ctl status" in done.stderr and "Traceback" not in done.stderr
