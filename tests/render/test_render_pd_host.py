"""A prefill/decode plan rendered for one host without Compose (render/pd_host.py): the script
(bash -n, shellcheck, and run against the stand-in docker of tests/stub_docker.py, taught the
network flags) and one systemd unit per role plus the router's (systemd-analyze verify, the
order, the clocks read back from the timeline). The goldens are test_render_pd.py's test_golden,
which covers every target in PD_RENDERERS."""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from m31ctl.pair import PAIR_SUBNET, network_name, pair_upstreams, role_address
from m31ctl.render import PD_RENDERERS, Artifact
from tests.support.render import (
    HOSTILE,
    PLANS,
    REFERENCE,
    pd_deployment,
    render,
    shlex_split_systemd,
    tool,
    unit_lines,
)

STUB_DOCKER = Path(__file__).parent.parent / "stub_docker.py"
CANARY_KEY = "sk-CANARY_api_key_do_not_leak_42"
CANARY_TOKEN = "hf_CANARY_5ecret_do_not_leak_0123456789"
KEYED = ("runtime.api_key=true",)
HOST_TARGETS = ("script", "systemd")

# tests/stub_docker.py with what the P/D script adds: the network flags of `docker run` and
# `docker network`; every call is logged, and `inspect` answers STUB_RUNNING (default true).
WRAPPER = """
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("stub_docker", {stub!r})
stub = importlib.util.module_from_spec(spec)
spec.loader.exec_module(stub)
stub.VALUED |= {{"--network", "--ip", "--network-alias"}}
argv = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as log:
    log.write(json.dumps({{"argv": argv, "env": {{k: os.environ[k] for k in ("OPENAI_API_KEY",) if k in os.environ}}}}) + "\\n")
state = os.path.join(os.environ["STUB_DIR"], "network")
if argv[:1] == ["network"]:
    if argv[1] == "create":
        open(state, "w").write(argv[argv.index("--subnet") + 1])
    elif argv[1] == "rm":
        os.path.exists(state) and os.remove(state)
    elif argv[1] == "inspect":
        if not os.path.exists(state):
            sys.exit(1)
        if "--format" in argv:
            print(open(state).read() + " ")
    sys.exit(0)
if argv[:1] == ["rm"]:
    sys.exit(0)
if argv[:1] == ["inspect"]:
    print(os.environ.get("STUB_RUNNING", "true"))
    sys.exit(0)
sys.exit(stub.main(argv))
"""


def stub_path(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    docker = bin_dir / "docker"
    docker.write_text(f"#!{sys.executable}\n" + WRAPPER.format(stub=str(STUB_DOCKER)))
    docker.chmod(0o755)
    (bin_dir / "sleep").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "sleep").chmod(0o755)
    return bin_dir


def run_script(
    text: str, tmp_path: Path, env: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], list[Any]]:
    bin_dir = stub_path(tmp_path)
    script = tmp_path / "run.sh"
    script.write_text(text)
    log = tmp_path / "calls.jsonl"
    log.unlink(missing_ok=True)
    (tmp_path / "cache").mkdir(exist_ok=True)
    done = subprocess.run(
        ["bash", str(script)],
        env={
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "HOME": str(tmp_path),
            "STUB_DOCKER_OUT": str(tmp_path / "runs.jsonl"),
            "STUB_LOG": str(log),
            "STUB_DIR": str(tmp_path),
            "M31CTL_ENV_FILE": str(tmp_path / "absent.env"),
            **env,
        },
        capture_output=True,
        text=True,
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return done, calls


def script_for(key: str, extra: tuple[str, ...] = ()) -> str:
    (artifact,) = render(key, "script", extra)
    return artifact.content


def runnable(key: str, tmp_path: Path, extra: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The plan with its bind sources where this test can make them (the stand-in, as the
    daemon, refuses a bind source that does not exist): the cache under HOME, set by the caller,
    and the CPU recipe's local checkpoint in tmp_path."""
    if key != "pd-cpu":
        return extra
    (tmp_path / "model").mkdir(exist_ok=True)
    return (*extra, f"model.path={tmp_path / 'model'}")


def runs(calls: list[Any]) -> list[list[str]]:
    return [c["argv"] for c in calls if c["argv"][:1] == ["run"]]


def value_of(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def names(argv_list: list[list[str]]) -> list[str]:
    return [value_of(a, "--name") for a in argv_list]


def test_both_host_targets_render_a_pair():
    assert set(HOST_TARGETS) <= set(PD_RENDERERS)
    for key in PLANS:
        for target in HOST_TARGETS:
            for artifact in render(key, target):
                assert (REFERENCE / key / artifact.name).exists(), artifact.name


@pytest.mark.parametrize("target", HOST_TARGETS)
@pytest.mark.parametrize("key", sorted(PLANS))
def test_byte_identical_on_repeat(key, target):
    assert render(key, target, KEYED) == render(key, target, KEYED)


@pytest.mark.parametrize("key", sorted(PLANS))
def test_script_passes_bash_n_and_shellcheck(key, tmp_path):
    for extra in ((), KEYED, (f"model.served_name={HOSTILE}",)):
        script = tmp_path / "run.sh"
        script.write_text(script_for(key, extra))
        subprocess.run(["bash", "-n", str(script)], check=True)
        result = subprocess.run([tool("shellcheck"), str(script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("key", sorted(PLANS))
def test_script_downloads_then_runs_the_roles_then_the_router_once_both_answer(key, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    extra = runnable(key, tmp_path, KEYED)
    deployment = pd_deployment(key, extra)
    group = deployment.disaggregated
    assert group is not None
    done, calls = run_script(
        script_for(key, extra),
        tmp_path,
        {"VLLM_API_KEY": CANARY_KEY, "HF_TOKEN": CANARY_TOKEN, "STUB_READY_AFTER": "1"},
    )
    assert done.returncode == 0, done.stderr
    started = runs(calls)
    roles = [role.name for role in group.roles]
    downloads = [a for a in started if value_of(a, "--name") == f"{deployment.name}-download"]
    front = f"{group.router.name}-front"
    assert names(started) == [
        *(f"{deployment.name}-download" for _ in downloads),
        *roles,
        front,
        group.router.name,
    ]
    assert len(downloads) == (0 if key == "pd-cpu" else 1)
    # The router starts only after both roles answered /health (their `docker exec` probes).
    order = [c["argv"][0] if c["argv"][0] != "exec" else f"exec {c['argv'][1]}" for c in calls]
    router_at = next(
        i for i, c in enumerate(calls) if c["argv"][:1] == ["run"] and group.router.name in c["argv"]
    )
    for role in roles:
        assert order.index(f"exec {role}") < router_at
    # The network is made (with the Compose target's subnet) before any role joins it.
    create = next(i for i, c in enumerate(calls) if c["argv"][:2] == ["network", "create"])
    assert value_of(calls[create]["argv"], "--subnet") == PAIR_SUBNET
    assert create < next(i for i, c in enumerate(calls) if c["argv"][:1] == ["run"] and roles[0] in c["argv"])
    # Every secret went by name: in no argv, and the router got the key as OPENAI_API_KEY.
    for call in calls:
        assert not any(CANARY_KEY in w or CANARY_TOKEN in w for w in call["argv"]), call["argv"]
    router_call = calls[router_at]
    assert router_call["env"] == {"OPENAI_API_KEY": CANARY_KEY}
    assert router_call["argv"][router_call["argv"].index("OPENAI_API_KEY") - 1 :][:2] == [
        "--env",
        "OPENAI_API_KEY",
    ]
    _fronted(calls, router_at, front, deployment.network.port)
    records = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    engines = [r for r in records if r["name"] in roles]
    assert all(r["env"].get("VLLM_API_KEY") == CANARY_KEY and "HF_TOKEN" not in r["env"] for r in engines)
    (fronts,) = [r for r in records if r["name"] == front]
    assert fronts["env"] == {"VLLM_API_KEY": CANARY_KEY}, fronts["env"]


def _fronted(calls: list[dict[str, Any]], router_at: int, front: str, port: int) -> None:
    """The router's front (issue 49) starts just before the router and holds its namespace: on
    the pair's network publishing the plan's port, with the roles' key by name; the router in
    its namespace on loopback, publishing nothing."""
    front_call, router_call = calls[router_at - 1], calls[router_at]
    front_argv, router_argv = front_call["argv"], router_call["argv"]
    assert value_of(front_argv, "--name") == front and value_of(front_argv, "--entrypoint") == "python3"
    assert values_of(front_argv, "--env") == ["VLLM_API_KEY"]
    assert front_argv[-2:] == ["--key-env", "VLLM_API_KEY"] and "--network" in front_argv
    assert value_of(front_argv, "--port") == "8000" and value_of(front_argv, "--upstream-port") == "30000"
    assert any(p.endswith(f":{port}:8000") for p in values_of(front_argv, "--publish")), front_argv
    assert value_of(router_argv, "--network") == f"container:{front}" and "--publish" not in router_argv
    assert value_of(router_argv, "--host") == "127.0.0.1" and value_of(router_argv, "--port") == "30000"


def values_of(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == flag]


@pytest.mark.parametrize("key", sorted(PLANS))
def test_side_channel_addresses_are_the_roles_addresses_on_the_network(key, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    extra = runnable(key, tmp_path)
    deployment = pd_deployment(key, extra)
    group = deployment.disaggregated
    assert group is not None
    done, calls = run_script(script_for(key, extra), tmp_path, {"STUB_READY_AFTER": "1"})
    assert done.returncode == 0, done.stderr
    by_name = {value_of(a, "--name"): a for a in runs(calls)}
    subnet = ipaddress.ip_network(PAIR_SUBNET)
    records = {r["name"]: r for r in map(json.loads, (tmp_path / "runs.jsonl").read_text().splitlines())}
    for index, role in enumerate(group.roles):
        argv = by_name[role.name]
        address = value_of(argv, "--ip")
        assert address == role_address(index) and ipaddress.ip_address(address) in subnet
        assert value_of(argv, "--network") == network_name(deployment)
        assert records[role.name]["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == address
    # The router reaches each role by the alias the role holds on the same network: its front's
    # (issue 49), whose network namespace it runs in.
    router = by_name[group.router.name]
    front = f"{group.router.name}-front"
    assert value_of(by_name[front], "--network") == network_name(deployment)
    assert value_of(router, "--network") == f"container:{front}"
    aliases = {value_of(by_name[role.name], "--network-alias") for role in group.roles}
    upstreams = [value_of(router, "--prefill"), value_of(router, "--decode")]
    assert upstreams == list(pair_upstreams(group))
    assert {re.sub(r"^http://|:\d+$", "", u) for u in upstreams} == aliases


def test_script_removes_what_it_started_when_a_role_dies(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    extra = runnable("pd-cpu", tmp_path)
    group = pd_deployment("pd-cpu", extra).disaggregated
    assert group is not None
    done, calls = run_script(script_for("pd-cpu", extra), tmp_path, {"STUB_RUNNING": "false"})
    assert done.returncode == 5, done.stderr
    assert "stopped while loading" in done.stderr
    assert group.router.name not in names(runs(calls))  # never started
    removed = [c["argv"][2] for c in calls if c["argv"][:2] == ["rm", "--force"]]
    assert removed == [group.decode.name, group.prefill.name]
    assert ["network", "rm", network_name(pd_deployment("pd-cpu", extra))] in [c["argv"] for c in calls]


def test_no_secret_value_reaches_a_rendered_file(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", CANARY_KEY)
    monkeypatch.setenv("HF_TOKEN", CANARY_TOKEN)
    for key in PLANS:
        for target in HOST_TARGETS:
            for artifact in render(key, target, KEYED):
                assert CANARY_KEY not in artifact.content and CANARY_TOKEN not in artifact.content


def units(key: str, extra: tuple[str, ...] = ()) -> dict[str, Artifact]:
    return {a.name: a for a in render(key, "systemd", extra)}


def directive(text: str, name: str) -> list[str]:
    return [line.split("=", 1)[1] for line in unit_lines(text) if line.startswith(f"{name}=")]


@pytest.mark.parametrize("key", sorted(PLANS))
def test_systemd_units_verify_and_the_router_is_ordered_after_both_roles(key, tmp_path):
    deployment = pd_deployment(key, KEYED)
    group = deployment.disaggregated
    assert group is not None
    rendered = units(key, KEYED)
    role_units = [f"{role.name}.service" for role in group.roles]
    router_unit = f"{group.router.name}.service"
    assert sorted(rendered) == sorted([*role_units, router_unit])
    for artifact in rendered.values():
        (tmp_path / artifact.name).write_text(artifact.content)
    for name in rendered:
        verify = subprocess.run(
            ["systemd-analyze", "verify", str(tmp_path / name)], capture_output=True, text=True
        )
        assert "Failed to parse" not in verify.stderr and "Invalid" not in verify.stderr, verify.stderr
    router = rendered[router_unit].content
    for name in ("After", "Requires"):
        (words,) = directive(router, name)
        assert set(role_units) <= set(words.split())
    for unit in role_units:  # the roles start side by side: neither waits for the other
        assert not any(other in rendered[unit].content for other in role_units if other != unit)


@pytest.mark.parametrize("key", sorted(PLANS))
def test_systemd_clocks_are_the_timelines(key):
    deployment = pd_deployment(key)
    group = deployment.disaggregated
    assert group is not None
    rendered = units(key)
    for role in group.roles:
        text = rendered[f"{role.name}.service"].content
        assert directive(text, "TimeoutStartSec") == [str(role.timeline.systemd_start_s)]
        assert directive(text, "TimeoutStopSec") == [str(role.timeline.systemd_stop_s)]
        assert f"--stop-timeout {role.timeline.stop_s} " in text
    clocks = group.router_timeline
    router = rendered[f"{group.router.name}.service"].content
    assert directive(router, "TimeoutStartSec") == [str(clocks.systemd_start_s)]
    assert directive(router, "TimeoutStopSec") == [str(clocks.systemd_stop_s)]
    assert directive(router, "ExecStop")[0].split()[3] == str(clocks.stop_s)
    (post,) = directive(router, "ExecStartPost")
    assert f"+ {clocks.start_s}))" in shlex_split_systemd(post)[2]


def test_role_units_create_the_network_and_join_it_at_the_side_channel_address(tmp_path):
    deployment = pd_deployment("pd-b300x8")
    group = deployment.disaggregated
    assert group is not None
    rendered = units("pd-b300x8")
    bin_dir = stub_path(tmp_path)
    for index, role in enumerate(group.roles):
        text = rendered[f"{role.name}.service"].content
        (start,) = directive(text, "ExecStart")
        argv = shlex_split_systemd(start)
        assert value_of(argv, "--ip") == role_address(index)
        assert f"VLLM_NIXL_SIDE_CHANNEL_HOST={role_address(index)}" in argv
        # The network step as systemd runs it (sh -c), against the stand-in docker: twice, as
        # the two role units do, and the second finds the first's network.
        ensure = next(
            shlex_split_systemd(line)[2]
            for line in directive(text, "ExecStartPre")
            if "network create" in line
        ).replace("/usr/bin/docker", str(bin_dir / "docker"))
        env = {"STUB_LOG": str(tmp_path / "log"), "STUB_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
        assert subprocess.run(["/bin/sh", "-c", ensure], env=env).returncode == 0
        assert (tmp_path / "network").read_text() == PAIR_SUBNET
    (tmp_path / "network").write_text("172.30.0.0/16")  # someone else's network of that name
    assert subprocess.run(["/bin/sh", "-c", ensure], env=env, capture_output=True).returncode == 1


def test_systemd_router_gets_the_key_by_name_through_sh(tmp_path):
    group = pd_deployment("pd-cpu", KEYED).disaggregated
    assert group is not None
    router = units("pd-cpu", KEYED)[f"{group.router.name}.service"].content
    assert CANARY_KEY not in router
    (start,) = directive(router, "ExecStart")
    words = shlex_split_systemd(start)
    assert words[:2] == ["/bin/sh", "-c"]
    bin_dir = stub_path(tmp_path)
    log = tmp_path / "log"
    env = {
        "STUB_LOG": str(log),
        "STUB_DIR": str(tmp_path),
        "STUB_DOCKER_OUT": str(tmp_path / "runs.jsonl"),
        "VLLM_API_KEY": CANARY_KEY,
        "PATH": "/usr/bin:/bin",
    }
    script = words[2].replace("/usr/bin/docker", str(bin_dir / "docker"))
    assert subprocess.run(["/bin/sh", "-c", script], env=env).returncode == 0
    (call,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert call["env"] == {"OPENAI_API_KEY": CANARY_KEY}
    assert not any(CANARY_KEY in w for w in call["argv"])
    (record,) = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert record["env"] == {"OPENAI_API_KEY": CANARY_KEY} and record["name"] == group.router.name


@pytest.mark.parametrize("keyed", [True, False])
def test_systemd_router_unit_runs_the_front_on_the_port_and_the_router_on_its_loopback(keyed):
    """issue 49: the unit starts the front (detached, removed when it stops: no restart policy
    of Docker's, the unit supervises it) before the router, in whose namespace the router runs
    on loopback; the front stops first and is removed after the router."""
    extra = KEYED if keyed else ()
    group = pd_deployment("pd-cpu", extra).disaggregated
    assert group is not None
    text = units("pd-cpu", extra)[f"{group.router.name}.service"].content
    front = f"{group.router.name}-front"
    assert "Not fronted" not in text and CANARY_KEY not in text
    starts = [shlex_split_systemd(line) for line in directive(text, "ExecStartPre")]
    (run,) = [w for w in starts if w[1:3] == ["run", "--detach"]]
    assert run[3] == "--rm" and value_of(run, "--name") == front and "--restart" not in run
    assert value_of(run, "--port") == "8000" and value_of(run, "--upstream-port") == "30000"
    assert values_of(run, "--env") == (["VLLM_API_KEY"] if keyed else [])
    assert (run[-2:] == ["--key-env", "VLLM_API_KEY"]) is keyed
    (start,) = directive(text, "ExecStart")
    router = shlex_split_systemd(start)
    if keyed:
        router = shlex_split_systemd(router[2].splitlines()[-1].removeprefix("exec "))
    assert value_of(router, "--network") == f"container:{front}" and "--publish" not in router
    assert value_of(router, "--host") == "127.0.0.1" and value_of(router, "--port") == "30000"
    assert [shlex_split_systemd(line)[-1] for line in directive(text, "ExecStop")] == [
        front,
        group.router.name,
    ]
    assert directive(text, "ExecStopPost") == [f"-/usr/bin/docker rm --force {front}"]


@pytest.mark.parametrize("target", HOST_TARGETS)
def test_a_pair_wider_than_one_host_is_refused(target, cli, tmp_path):
    result = cli(
        "render", "--target", target, "--hardware", "b300x4", "--set", "disaggregation.enabled=true",
        "--revision", "0123456789abcdef0123456789abcdef01234567", "-o", str(tmp_path / "out"),
    )  # fmt: skip
    assert result.returncode == 6, result.stderr
    assert f"a {target} runs on one host" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
