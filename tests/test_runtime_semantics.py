"""The rendered artifacts read by the rules of the runtime that runs them, not only its schema.

- the script against a stand-in `docker` that applies the Docker CLI's rules (tests/stub_docker.py);
- the systemd unit's own commands, as systemd splits and runs them;
- Compose files through `docker-compose config`;
- Kubernetes manifests through the kubelet's $(NAME) expansion (m31ctl/render/kube.py), with
  the environment LeaderWorkerSet injects, a NetworkPolicy evaluator and Pod Security "baseline";
- the resulting vLLM argv against vLLM 0.32's own data-parallel rank rules.
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from m31ctl.deployment import derive
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.render import get_target
from m31ctl.render.common import render_spec
from m31ctl.render.k8s import RAY_JOIN_S
from m31ctl.render.kube import expand, literal, mapping_for
from tests.test_render import HOSTILE, shlex_split_systemd, tool

STUB_DOCKER = Path(__file__).parent / "stub_docker.py"
CANARY = "hf_CANARY_5ecret_do_not_leak_0123456789"
EXPOSED = ("runtime.bind=0.0.0.0", "runtime.api_key=true")
RWX = "kubernetes.hf_cache_storage_class=nfs-rwx"


def plan_for(hw: str, *sets: str, profile: str | None = None):  # type: ignore[no-untyped-def]
    return resolve(PlanRequest(hardware=simulated(hw), sets=sets, profile=profile))


def rendered(plan, target: str) -> str:  # type: ignore[no-untyped-def]
    (artifact,) = get_target(target)(derive(plan))
    return artifact.content


def stub_bin(tmp_path: Path, *, instant_sleep: bool = False) -> Path:
    """bin/ with the stand-in docker (and a `sleep` that returns at once)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    docker = bin_dir / "docker"
    docker.write_text(f"#!{sys.executable}\n" + STUB_DOCKER.read_text())
    docker.chmod(0o755)
    if instant_sleep:
        (bin_dir / "sleep").write_text("#!/bin/sh\nexit 0\n")
        (bin_dir / "sleep").chmod(0o755)
    return bin_dir


def run_script(
    text: str, tmp_path: Path, env: dict[str, str]
) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    bin_dir = stub_bin(tmp_path)
    script = tmp_path / "run.sh"
    script.write_text(text)
    out = tmp_path / "docker-runs.jsonl"
    out.unlink(missing_ok=True)
    done = subprocess.run(
        ["bash", str(script)],
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "STUB_DOCKER_OUT": str(out), **env},
        capture_output=True,
        text=True,
    )
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    # The checkpoint download runs first, in its own container (render/download.py): the engine's
    # record is the one without an entrypoint of its own; the download's is checked on its own.
    downloads = [r for r in records if r.get("entrypoint")]
    for download in downloads:
        assert download["entrypoint"] == "python3" and "--rm" in download["flags"]
        assert download["name"].endswith("-download") and download["image"] == records[-1]["image"]
        assert download["command"][0] == "-c" and "snapshot_download" in download["command"][1]
    return done, [r for r in records if not r.get("entrypoint")]


# --- the script under the Docker CLI's rules --------------------------------------------------


@pytest.mark.parametrize(
    ("hw", "sets"),
    [
        ("b300x4", ()),
        ("h200x8", ("runtime.bind=::1",)),
        ("mi355xx8", EXPOSED),
        ("b300x4", ("runtime.bind=::", "runtime.api_key=true")),
    ],
)
def test_script_creates_what_the_plan_says_under_dockers_rules(hw, sets, tmp_path):
    plan = plan_for(hw, f"model.served_name={HOSTILE}", f"runtime.hf_cache={tmp_path}/hf", *sets)
    done, (record,) = run_script(
        rendered(plan, "script"), tmp_path, {"M31CTL_ENV_FILE": str(tmp_path / "none"), "VLLM_API_KEY": "k"}
    )
    assert done.returncode == 0, done.stderr
    spec = render_spec(derive(plan))
    (port,) = record["ports"]
    assert ipaddress.ip_address(port["ip"]) == ipaddress.ip_address(spec.bind)
    assert (port["host_port"], port["container_port"]) == ("8000", "8000")
    assert record["mounts"] == [
        {"type": "bind", "source": f"{tmp_path}/hf", "target": "/root/.cache/huggingface", "readonly": False}
    ]
    assert record["command"] == list(spec.args) and record["image"] == spec.image
    assert {k: v for k, v in record["env"].items() if k != "VLLM_API_KEY"} == dict(spec.env)


def test_a_colon_comma_or_quote_in_a_host_path_reaches_docker_whole(tmp_path):
    """`-v SRC:DST` splits on every colon; --mount is one CSV record (quoted where needed)."""
    cache = tmp_path / 'cache:v1,"x"'
    model = tmp_path / "models" / "m31:fp4"
    model.mkdir(parents=True)
    plan = plan_for("b300x4", f"runtime.hf_cache={cache}", f"model.path={model}")
    done, (record,) = run_script(
        rendered(plan, "script"), tmp_path, {"M31CTL_ENV_FILE": str(tmp_path / "none")}
    )
    assert done.returncode == 0, done.stderr
    assert cache.is_dir()  # created by the script: a bind mount does not create its source
    assert record["mounts"] == [
        {"type": "bind", "source": str(cache), "target": "/root/.cache/huggingface", "readonly": False},
        {"type": "bind", "source": str(model), "target": str(model), "readonly": True},
    ]
    assert record["command"][0] == str(model)


ACCEPTED = "# keys for m31ctl\n\nHF_TOKEN=hf_abcdefghijklmnop\nVLLM_API_KEY=k+/=.-_~:@%,!*\nEMPTY=\n"
REFUSED = [
    'X="quoted"',
    "X='single'",
    "X=a b",
    "X=trail ",
    " X=lead",
    "X=back\\slash",
    "X=$HOME",
    "X",
    "export X=1",
]


def test_env_file_one_format_that_docker_and_systemd_read_alike(tmp_path):
    """Docker's --env-file keeps quotes, spaces and backslashes; systemd's EnvironmentFile=
    strips quotes, trims spaces, reads escapes. The script and the unit accept only lines both
    read as the text after `=`, and name a refused line by number, never by value."""
    plan = plan_for("b300x4", *EXPOSED)
    env_file = tmp_path / "secrets.env"
    env_file.write_text(ACCEPTED)
    env_file.chmod(0o600)
    done, (record,) = run_script(rendered(plan, "script"), tmp_path, {"M31CTL_ENV_FILE": str(env_file)})
    assert done.returncode == 0, done.stderr
    written = dict(line.split("=", 1) for line in ACCEPTED.splitlines() if line and not line.startswith("#"))
    assert {k: record["env"][k] for k in written} == written
    unit = rendered(plan, "systemd")
    check = next(line for line in unit.splitlines() if "docker and systemd read" in line)
    unit_script = shlex_split_systemd(check.split("=", 1)[1])[2]
    assert (
        subprocess.run(
            ["/bin/sh", "-c", unit_script.replace("/etc/m31ctl/minimax-m31-flash.env", str(env_file))]
        ).returncode
        == 0
    )
    for line in REFUSED:
        env_file.write_text(f"HF_TOKEN=hf_ok\n{line}\n")
        refused, records = run_script(rendered(plan, "script"), tmp_path, {"M31CTL_ENV_FILE": str(env_file)})
        assert refused.returncode == 2 and "line(s) 2:" in refused.stderr and records == [], line
        assert "quoted" not in refused.stderr and "hf_ok" not in refused.stderr  # no value echoed
        unit_run = subprocess.run(
            ["/bin/sh", "-c", unit_script.replace("/etc/m31ctl/minimax-m31-flash.env", str(env_file))],
            capture_output=True,
            text=True,
        )
        assert unit_run.returncode == 1 and "line(s) 2:" in unit_run.stderr, line


def test_amd_gets_the_plans_gpus_in_every_target(tmp_path):
    """A simulated MI355X host: every GPU of the host reaches the container as /dev/dri, so the
    visibility variables (ROCr, HIP) give vLLM the plan's four; a probed host passes exactly its
    render nodes instead."""
    plan = plan_for("mi355xx8")
    wanted = {"ROCR_VISIBLE_DEVICES": "0,1,2,3", "HIP_VISIBLE_DEVICES": "0,1,2,3"}
    done, (record,) = run_script(
        rendered(plan, "script"), tmp_path, {"M31CTL_ENV_FILE": str(tmp_path / "none")}
    )
    assert done.returncode == 0, done.stderr
    assert "/dev/dri" in record["devices"] and wanted.items() <= record["env"].items()
    assert "CUDA_VISIBLE_DEVICES" not in record["env"]  # vLLM copies HIP's; Ray refuses a different one
    service = yaml.safe_load(rendered(plan, "compose"))["services"]["vllm"]
    assert {f"{k}={v}" for k, v in wanted.items()} <= set(service["environment"])
    unit = rendered(plan, "systemd")
    assert all(f"--env {k}={v}" in unit for k, v in wanted.items())
    pod = list(yaml.safe_load_all(rendered(plan, "k8s")))[1]["spec"]["template"]["spec"]
    assert all({"name": k, "value": v} in pod["containers"][0]["env"] for k, v in wanted.items())

    from m31ctl.hardware import GPU

    hw = simulated("mi355xx8")
    gpus = tuple(
        GPU(index=i, name="AMD Instinct MI355X", arch="gfx950", memory_total_bytes=hw.memory_per_gpu_bytes,
            pci_device_id="0x75a3", render_node=f"/dev/dri/renderD{128 + 8 * i}")
        for i in range(8)
    )  # fmt: skip
    probed = resolve(PlanRequest(hardware=hw.model_copy(update={"gpus": gpus, "simulated": False})))
    done, (record,) = run_script(
        rendered(probed, "script"), tmp_path, {"M31CTL_ENV_FILE": str(tmp_path / "none")}
    )
    assert record["devices"] == ["/dev/kfd", *(f"/dev/dri/renderD{128 + 8 * i}" for i in range(4))]
    assert not wanted.keys() & record["env"].keys()


# --- systemd -----------------------------------------------------------------------------------


def _exec_line(unit: str, key: str) -> list[str]:
    line = next(line for line in unit.splitlines() if line.startswith(f"{key}=/bin/sh"))
    return shlex_split_systemd(line.split("=", 1)[1])


def test_systemd_reports_started_only_once_the_model_answers(tmp_path):
    unit = rendered(plan_for("b300x4", "runtime.startup_timeout=2"), "systemd")
    path = tmp_path / "m31ctl-minimax-m31-flash.service"
    path.write_text(unit)
    verify = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert "Failed to parse" not in verify.stderr and "Invalid" not in verify.stderr, verify.stderr
    assert "TimeoutStartSec=62\n" in unit  # the budget and a margin: never infinity
    script = _exec_line(unit, "ExecStartPost")[2]
    bin_dir = stub_bin(tmp_path, instant_sleep=True)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "STUB_DIR": str(tmp_path)}
    ready = subprocess.run(
        ["/bin/sh", "-c", script], env={**env, "STUB_READY_AFTER": "3"}, capture_output=True, text=True
    )
    assert ready.returncode == 0, ready.stderr
    assert (tmp_path / "exec-count").read_text() == "3"  # it asked until the third answer
    dead = subprocess.Popen(["true"])
    dead.wait()
    died = subprocess.run(
        ["/bin/sh", "-c", script], env={**env, "MAINPID": str(dead.pid)}, capture_output=True, text=True
    )
    assert died.returncode == 1 and "exited while loading" in died.stderr
    late = subprocess.run(["/bin/sh", "-c", script], env=env, capture_output=True, text=True, timeout=30)
    assert late.returncode == 1 and "not ready after 2 s" in late.stderr


# --- Compose -----------------------------------------------------------------------------------


def test_compose_config_reads_paths_ports_and_values_literally(tmp_path):
    cache = tmp_path / "hf:cache"
    plan = plan_for("b300x4", f"runtime.hf_cache={cache}", "runtime.bind=::1", f"model.served_name={HOSTILE}")
    path = tmp_path / "compose.yaml"
    path.write_text(rendered(plan, "compose"))
    resolved = subprocess.run(
        [tool("docker-compose"), "-f", str(path), "config"],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "HOME": str(tmp_path)},
        cwd=tmp_path,
    )
    assert resolved.returncode == 0, resolved.stderr
    service = yaml.safe_load(resolved.stdout)["services"]["vllm"]
    assert {"type": "bind", "source": str(cache), "target": "/root/.cache/huggingface"} in service["volumes"]
    assert service["ports"] == ["::1:8000:8000/tcp"]
    name = service["command"][service["command"].index("--served-model-name") + 1]
    assert name.replace("$$", "$") == HOSTILE  # `config` prints literals re-escaped


# --- Kubernetes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("$(VAR_A)", "A"),
        ("___$(VAR_A)___", "___A___"),
        ("$(VAR_A)-$(VAR_B)", "A-B"),
        ("$$(VAR_A)", "$(VAR_A)"),
        ("$$$(VAR_A)", "$A"),
        ("$$$$(VAR_A)", "$$(VAR_A)"),
        ("$(UNDEFINED)", "$(UNDEFINED)"),
        ("$(VAR_A", "$(VAR_A"),
        ("$VAR_A", "$VAR_A"),
        ("${VAR_A}", "${VAR_A}"),
        ("$", "$"),
        ("$$", "$"),
        ("a$", "a$"),
        ("$()", ""),
        ("$(VAR_EMPTY)", ""),
        ("$(VAR_REF)", "$(VAR_A)"),  # values are not expanded again
        ("$é$(VAR_A)", "$éA"),
    ],
)
def test_kubelet_expansion(text, want):
    """Cases from kubernetes/kubernetes third_party/forked/golang/expansion/expand_test.go."""
    context = {"VAR_A": "A", "VAR_B": "B", "VAR_EMPTY": "", "VAR_REF": "$(VAR_A)", "": ""}
    assert expand(text, mapping_for(context)) == want
    assert expand(literal(text), mapping_for(context)) == text


NAMESPACE = "serving"
SECRETS = {"HF_TOKEN": CANARY, "VLLM_API_KEY": CANARY + "_key"}
DOLLARS = "$(HF_TOKEN) $$(VLLM_API_KEY) $$ $ ${HF_TOKEN} $(LWS_LEADER_ADDRESS)"


def _lws_env(lws: str, size: int, index: int) -> list[dict[str, str]]:
    """What the LWS pod webhook puts first in every container's env (pkg/utils/pod AddLWSVariables):
    the leader's address <lws>-<group>.<subdomain>.<namespace>, the subdomain being the headless
    Service that carries the LWS's name, the group size, this pod's index."""
    return [
        {"name": "LWS_LEADER_ADDRESS", "value": f"{lws}-0.{lws}.{NAMESPACE}"},
        {"name": "LWS_GROUP_SIZE", "value": str(size)},
        {"name": "LWS_WORKER_INDEX", "value": str(index)},
    ]


def _container_env(entries: list[dict[str, Any]]) -> dict[str, str]:
    """The kubelet's makeEnvironmentVariables: each value expanded against the variables before
    it (service links off, so no others), secrets resolved from the Secret."""
    env: dict[str, str] = {}
    for entry in entries:
        if "valueFrom" in entry:
            env[entry["name"]] = SECRETS[entry["valueFrom"]["secretKeyRef"]["key"]]
        else:
            env[entry["name"]] = expand(entry["value"], mapping_for(dict(env)))
    return env


def _pods(documents: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], list[dict[str, str]]]]:
    """(role, pod spec, env the LWS controller adds) for each pod the manifest makes."""
    pods = []
    for doc in documents:
        if doc["kind"] == "Deployment":
            pods.append(("pod", doc["spec"]["template"]["spec"], []))
        if doc["kind"] == "LeaderWorkerSet":
            template, name = doc["spec"]["leaderWorkerTemplate"], doc["metadata"]["name"]
            size = template["size"]
            pods.append(("leader", template["leaderTemplate"]["spec"], _lws_env(name, size, 0)))
            for index in range(1, size):
                pods.append(
                    (f"worker-{index}", template["workerTemplate"]["spec"], _lws_env(name, size, index))
                )
    return pods


def kubelet_view(
    pod: dict[str, Any], lws_env: list[dict[str, str]]
) -> list[tuple[dict[str, str], list[str]]]:
    """(environment, command line) of each container as the kubelet starts it."""
    assert pod["enableServiceLinks"] is False  # else every Service adds <NAME>_PORT=tcp://...
    started = []
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        env = _container_env([*lws_env, *container.get("env", [])])
        argv = [
            expand(w, mapping_for(env)) for w in [*container.get("command", []), *container.get("args", [])]
        ]
        started.append((env, argv))
    return started


LAYOUTS = {
    "one node": ("b300x4", (), None),
    "DP over nodes": ("h100x4", ("parallelism.nodes=2", RWX), "throughput"),
    "PP over nodes (Ray)": ("h100x4", ("parallelism.nodes=2", RWX), None),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kubelet_hands_every_plan_value_over_literally(layout, tmp_path):
    """Every string of every container, expanded as the kubelet does with the secrets defined,
    reaches the process as the plan wrote it: nothing expands into a secret."""
    hw, sets, profile = LAYOUTS[layout]
    extra = json.dumps(["--revision", DOLLARS])
    plan = plan_for(hw, *sets, f"model.served_name={DOLLARS}", f"runtime.env.X={DOLLARS}",
                    f"engine.extra_args={extra}", profile=profile)  # fmt: skip
    documents = list(yaml.safe_load_all(rendered(plan, "k8s")))
    for role, pod, lws_env in _pods(documents):
        for env, argv in kubelet_view(pod, lws_env):
            assert all(CANARY not in w for w in argv), role
            assert env.get("X", DOLLARS) == DOLLARS, role
        _env, argv = kubelet_view(pod, lws_env)[-1]
        if role == "pod":
            assert argv == list(render_spec(derive(plan), in_pod=True).args)
            continue
        served = [call for call in _run_sh(argv[2], _env, tmp_path) if call[0] == "vllm"]
        for call in served:  # the pod's shell runs vllm with the literal values
            assert call[call.index("--served-model-name") + 1] == DOLLARS
            assert call[call.index("--revision") + 1] == DOLLARS
        assert served or role != "leader"


def test_the_api_service_leaves_the_lws_name_to_its_headless_service():
    """LeaderWorkerSet creates the headless Service named after the LWS only when no Service has
    that name (pkg/controller CreateHeadlessServiceIfNotExists); the pods' DNS names, and so
    LWS_LEADER_ADDRESS, come from it."""
    documents = list(yaml.safe_load_all(rendered(plan_for("h100x4", "parallelism.nodes=2", RWX), "k8s")))
    lws = next(d for d in documents if d["kind"] == "LeaderWorkerSet")["metadata"]["name"]
    services = [d for d in documents if d["kind"] == "Service"]
    assert [s["metadata"]["name"] for s in services] == [f"{lws}-api"]
    assert services[0]["spec"]["selector"] == {"leaderworkerset.sigs.k8s.io/name": lws, "role": "leader"}
    leader_labels = next(d for d in documents if d["kind"] == "LeaderWorkerSet")["spec"][
        "leaderWorkerTemplate"
    ]["leaderTemplate"]["metadata"]["labels"]
    assert leader_labels["role"] == "leader"


def vllm_dp_ranks(argv: list[str]) -> range:
    """The data-parallel ranks one `vllm serve` process runs, by vLLM 0.32's own rules
    (engine/arg_utils.py create_engine_config, entrypoints/cli/serve.py, config/parallel.py)."""
    assert argv[:2] == ["vllm", "serve"]

    def value(flag: str) -> str | None:
        return argv[argv.index(flag) + 1] if flag in argv else None

    size = int(value("--data-parallel-size") or 1)
    local = value("--data-parallel-size-local")
    start = value("--data-parallel-start-rank")
    headless = "--headless" in argv
    assert value("--data-parallel-rank") is None  # external LB: one rank a process
    if start is not None and not headless:
        pytest.fail("--data-parallel-start-rank without --headless infers hybrid LB mode")
    local_n = int(local) if local is not None else size  # without it: every rank on this node
    rank = int(start) if start is not None else 0
    assert 0 < local_n <= size, "data_parallel_size_local must be > 0 and <= data_parallel_size"
    assert 0 <= rank < size, "data_parallel_rank must be in [0, data_parallel_size)"
    assert rank + local_n <= size
    return range(rank, rank + local_n)


@pytest.mark.parametrize(("hw", "sets"), [("h100x4", ("parallelism.nodes=2",)),
                                          ("b300x4", ("parallelism.nodes=4", "parallelism.data=16", "parallelism.tensor=1"))])  # fmt: skip
def test_every_dp_rank_runs_once_across_the_pods(hw, sets, tmp_path):
    plan = plan_for(hw, *sets, RWX, profile="throughput")
    lws = next(d for d in yaml.safe_load_all(rendered(plan, "k8s")) if d["kind"] == "LeaderWorkerSet")
    ranks: list[int] = []
    size = plan.settings.parallelism.data
    for role, pod, lws_env in _pods([lws]):
        env, argv = kubelet_view(pod, lws_env)[-1]
        (serve,) = _run_sh(argv[2], env, tmp_path)
        owned = vllm_dp_ranks(serve)
        assert ("--headless" in serve) == (role != "leader")
        assert serve[serve.index("--data-parallel-address") + 1] == env["LWS_LEADER_ADDRESS"]
        ranks += owned
    assert sorted(ranks) == list(range(size))  # every rank exactly once


def _run_sh(
    script: str, env: dict[str, str], tmp_path: Path, *, ray_fails: int = 0, alive: str = ""
) -> list[list[str]]:
    """Run a pod's /bin/sh -c script with stub vllm, ray (failing its first `ray_fails` calls),
    python3 (the Ray node count: `alive`, else the group size) and sleep."""
    bin_dir = tmp_path / "podbin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "calls"
    calls.write_text("")
    Path(f"{calls}.n").write_text("")  # ray's call count
    for name in ("vllm", "ray"):
        (bin_dir / name).write_text(
            f'#!/bin/sh\nprintf "%s\\0" {name} "$@" >> "$CALLS"\nprintf "\\036" >> "$CALLS"\n'
            + ('n=$(wc -l < "$CALLS.n"); echo x >> "$CALLS.n"; [ "$n" -ge "$RAY_FAILS" ]\n'
               if name == "ray" else "")
        )  # fmt: skip
    (bin_dir / "python3").write_text('#!/bin/sh\necho "${RAY_ALIVE:-$LWS_GROUP_SIZE}"\n')
    (bin_dir / "sleep").write_text("#!/bin/sh\nexit 0\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    done = subprocess.run(
        ["/bin/sh", "-c", script],
        env={**env, "PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(calls), "RAY_FAILS": str(ray_fails),
             **({"RAY_ALIVE": alive} if alive else {})},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    _run_sh.last = done  # type: ignore[attr-defined]
    return [record.split("\0")[:-1] for record in calls.read_text().split("\x1e") if record]


def test_ray_nodes_wait_for_each_other_like_multi_node_serving(tmp_path):
    """vLLM's examples/online_serving/multi-node-serving.sh: a worker retries `ray start` every
    5 s for 300 s; the leader waits until every node is alive before the engine starts."""
    plan = plan_for("h100x4", "parallelism.nodes=2", RWX)
    lws = next(d for d in yaml.safe_load_all(rendered(plan, "k8s")) if d["kind"] == "LeaderWorkerSet")
    (_l, leader, leader_lws), (_w, worker, worker_lws) = _pods([lws])
    worker_env, worker_argv = kubelet_view(worker, worker_lws)[-1]
    joined = _run_sh(worker_argv[2], worker_env, tmp_path, ray_fails=3)
    assert _run_sh.last.returncode == 0 and len(joined) == 4  # type: ignore[attr-defined]
    assert joined[-1] == ["ray", "start", f"--address={worker_env['LWS_LEADER_ADDRESS']}:6379", "--block"]
    never = _run_sh(worker_argv[2], worker_env, tmp_path, ray_fails=10**6)
    assert _run_sh.last.returncode == 1 and len(never) == RAY_JOIN_S // 5 + 1  # type: ignore[attr-defined]
    assert "no Ray head" in _run_sh.last.stderr  # type: ignore[attr-defined]
    leader_env, leader_argv = kubelet_view(leader, leader_lws)[-1]
    head, serve = _run_sh(leader_argv[2], leader_env, tmp_path)
    assert head[:3] == ["ray", "start", "--head"] and serve[:2] == ["vllm", "serve"]
    alone = _run_sh(leader_argv[2], leader_env, tmp_path, alive="1")
    assert _run_sh.last.returncode == 1 and [c[0] for c in alone] == ["ray"]  # type: ignore[attr-defined]
    for script in (leader_argv[2], worker_argv[2]):
        checked = subprocess.run(
            [tool("shellcheck"), "-s", "sh", "-"], input=script, capture_output=True, text=True
        )
        assert checked.returncode == 0, checked.stdout


def _admits(policy: dict[str, Any], pod_labels: dict[str, str], source: dict[str, Any], port: int) -> bool:
    """Whether a NetworkPolicy lets `source` (labels and namespace of a pod, or an IP) reach
    `port` of a pod (networking.k8s.io/v1 semantics; one policy selecting the pod)."""
    selector = policy["spec"]["podSelector"].get("matchLabels", {})
    if not selector.items() <= pod_labels.items():
        return True  # the policy does not select this pod
    for rule in policy["spec"].get("ingress", []):
        ports = rule.get("ports")
        if ports and not any(p["port"] == port for p in ports):
            continue
        peers = rule.get("from")
        if not peers or any(_peer_matches(peer, source) for peer in peers):
            return True
    return False


def _peer_matches(peer: dict[str, Any], source: dict[str, Any]) -> bool:
    if "ipBlock" in peer:
        return "ip" in source and ipaddress.ip_address(source["ip"]) in ipaddress.ip_network(
            peer["ipBlock"]["cidr"]
        )
    if "labels" not in source:
        return False
    if "namespaceSelector" not in peer and source["namespace"] != NAMESPACE:
        return False
    wanted = peer.get("podSelector", {}).get("matchLabels", {})
    return wanted.items() <= source["labels"].items()


def test_network_policy_admits_the_group_and_the_api_clients_only():
    plan = plan_for("h100x4", "parallelism.nodes=2", RWX, profile="throughput")
    documents = list(yaml.safe_load_all(rendered(plan, "k8s")))
    policy = next(d for d in documents if d["kind"] == "NetworkPolicy")
    lws = next(d for d in documents if d["kind"] == "LeaderWorkerSet")
    name = lws["metadata"]["name"]
    # LWS adds its name label to every pod of the group (the API reference).
    leader = {**lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["metadata"]["labels"],
              "leaderworkerset.sigs.k8s.io/name": name}  # fmt: skip
    peer = {"labels": {"leaderworkerset.sigs.k8s.io/name": name}, "namespace": NAMESPACE}
    client = {"labels": {"app": "gateway"}, "namespace": NAMESPACE}
    elsewhere = {"labels": {"app": "gateway"}, "namespace": "other"}
    outside = {"ip": "203.0.113.7"}
    torch_store = 41234  # vLLM picks free ports for torch.distributed's store
    for port in (6379, 29550, torch_store, 8000):
        assert _admits(policy, leader, peer, port), port
    assert _admits(policy, leader, client, 8000)
    assert not any(_admits(policy, leader, client, port) for port in (6379, 29550, torch_store))
    assert not any(_admits(policy, leader, who, 8000) for who in (elsewhere, outside))
    narrowed = plan_for(
        "b300x4", 'kubernetes.api_clients=[{"podSelector": {"matchLabels": {"app": "gateway"}}}]'
    )
    single = next(d for d in yaml.safe_load_all(rendered(narrowed, "k8s")) if d["kind"] == "NetworkPolicy")
    pod = {"app.kubernetes.io/name": "m31ctl-minimax-m31-flash"}
    assert _admits(single, pod, client, 8000)
    assert not _admits(single, pod, {"labels": {"app": "other"}, "namespace": NAMESPACE}, 8000)


def test_the_pods_need_the_api_key_unless_a_setting_says_otherwise():
    def engine_env(plan) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
        return list(yaml.safe_load_all(rendered(plan, "k8s")))[1]["spec"]["template"]["spec"]["containers"][
            0
        ]["env"]

    key = {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": "minimax-m31-flash-secrets", "key": "VLLM_API_KEY", "optional": False}}}  # fmt: skip
    assert key in engine_env(plan_for("b300x4"))  # runtime.api_key=false: the cluster still needs it
    assert all(
        e["name"] != "VLLM_API_KEY"
        for e in engine_env(plan_for("b300x4", "kubernetes.require_api_key=false"))
    )


def test_the_download_has_its_own_budget_and_the_probe_covers_load_and_compile(tmp_path):
    plan = plan_for("h200x8", "runtime.download_mbps=2000000")  # a checkpoint of 250 GB: 1-2 s
    budget = derive(plan).budgets.download_s
    assert budget <= 2
    pod = list(yaml.safe_load_all(rendered(plan, "k8s")))[1]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    probe = pod["containers"][0]["startupProbe"]
    assert probe["failureThreshold"] * probe["periodSeconds"] == plan.settings.runtime.load_and_compile_s
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "minimax-m31-flash-secrets", "key": "HF_TOKEN", "optional": True}}} in init["env"]  # fmt: skip
    _env, argv = kubelet_view(pod, [])[0]
    hub = tmp_path / "stub_hub"
    hub.mkdir()
    (hub / "huggingface_hub.py").write_text(
        "import json, os, time\n"
        "def snapshot_download(repo_id, ignore_patterns=None):\n"
        "    print(json.dumps([repo_id, ignore_patterns]))\n"
        "    time.sleep(float(os.environ.get('STUB_HUB_SECONDS', '0')))\n"
    )
    run = [sys.executable, *argv[1:]]
    fetched = subprocess.run(run, env={"PYTHONPATH": str(hub)}, capture_output=True, text=True, timeout=30)
    assert fetched.returncode == 0, fetched.stderr
    # Hopper does not draft: the DSpark folder stays on the hub, as `m31ctl pull` leaves it.
    assert json.loads(fetched.stdout) == ["MiniMaxAI/MiniMax-M3.1-Flash", ["dspark/*"]]
    slow = subprocess.run(run, env={"PYTHONPATH": str(hub), "STUB_HUB_SECONDS": "30"},
                          capture_output=True, text=True, timeout=30)  # fmt: skip
    assert slow.returncode == 124 and f"not downloaded within {budget} s" in slow.stderr
    local = plan_for("b300x4", f"model.path={tmp_path}")
    local_pod = list(yaml.safe_load_all(rendered(local, "k8s")))[1]["spec"]["template"]["spec"]
    assert "initContainers" not in local_pod  # a hostPath checkpoint: nothing to download


def test_a_group_needs_a_storage_class_that_provisions_readwritemany():
    from m31ctl.errors import InputError

    with pytest.raises(InputError, match=r"kubernetes\.hf_cache_storage_class"):
        rendered(plan_for("h100x4", "parallelism.nodes=2"), "k8s")


# Pod Security Standards, "baseline" (kubernetes.io/docs/concepts/security/pod-security-standards).
_BASELINE_CAPS = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                  "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}  # fmt: skip


def baseline_violations(pod: dict[str, Any]) -> list[str]:
    found = [f"host namespace {k}" for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]
    found += [f"hostPath {v['name']}" for v in pod.get("volumes", []) if "hostPath" in v]
    if pod.get("securityContext", {}).get("seccompProfile", {}).get("type") == "Unconfined":
        found.append("pod seccomp Unconfined")
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        security = container.get("securityContext", {})
        found += [
            f"capability {c}"
            for c in security.get("capabilities", {}).get("add", [])
            if c not in _BASELINE_CAPS
        ]
        if security.get("privileged"):
            found.append("privileged")
        if security.get("seccompProfile", {}).get("type") == "Unconfined":
            found.append("seccomp Unconfined")
        found += ["hostPort" for p in container.get("ports", []) if p.get("hostPort")]
    return found


def test_amd_pods_pass_pod_security_baseline_unless_privileged_is_asked_for():
    text = rendered(plan_for("mi355xx8"), "k8s")
    pod = list(yaml.safe_load_all(text))[1]["spec"]["template"]["spec"]
    assert baseline_violations(pod) == []
    assert 'Pod Security: left out, as Pod Security "baseline" rejects them: capability SYS_PTRACE' in text
    privileged = plan_for("mi355xx8", "kubernetes.pod_security=privileged")
    text = rendered(privileged, "k8s")
    pod = list(yaml.safe_load_all(text))[1]["spec"]["template"]["spec"]
    assert baseline_violations(pod) == ["capability SYS_PTRACE", "seccomp Unconfined"]
    assert 'which Pod Security "baseline" rejects: the namespace must allow privileged pods' in " ".join(
        line.removeprefix("# ") for line in text.splitlines() if line.startswith("#")
    )
    assert any("Pod Security" in w and "SYS_PTRACE" in w for w in privileged.warnings)
    assert not any("Pod Security" in w for w in plan_for("mi355xx8").warnings)


def test_the_header_names_the_ulimits_the_nodes_must_give():
    text = " ".join(
        line.removeprefix("# ")
        for line in rendered(plan_for("b300x4"), "k8s").splitlines()
        if line.startswith("#")
    )
    assert "Kubernetes sets no ulimits" in text and "memlock=unlimited, stack=67108864" in text
    assert "LimitMEMLOCK=infinity" in text and "default_ulimits" in text


# --- plan time ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "setting"),
    [
        (["--port", "9000"], "runtime.port"),
        (["--port=9000"], "runtime.port"),
        (["--host", "0.0.0.0"], "runtime.bind"),
        (["--served_model_name", "x"], "model.served_name"),
        (["--serv", "x"], "model.served_name"),  # vLLM takes an unambiguous prefix
        (["-tp", "8"], "parallelism.tensor"),
        (["--tensor_parallel_size=8"], "parallelism.tensor"),
        (["--data-parallel-size-local", "2"], "parallelism.nodes"),
        (["--kv-cache-dtype", "fp8"], "cache.kv_dtype"),
    ],
)
def test_flags_m31ctl_owns_are_refused_in_extra_args(args, setting, cli):
    result = cli(
        "plan", "--hardware", "b300x4", "--no-validate", "--set", f"engine.extra_args={json.dumps(args)}"
    )
    assert result.returncode == 2, result.stderr
    assert setting in result.stderr and "--set #1" in result.stderr


def test_plan_warns_about_a_movable_image_and_routes_outside_the_key():
    plan = plan_for("b300x4", *EXPOSED)
    assert any("is a tag" in w and "--locked" in w for w in plan.warnings)
    assert any("/invocations" in w and "/v1" in w for w in plan.warnings)
    digest = "vllm/vllm-openai@sha256:" + "a" * 64
    pinned = plan_for("b300x4", f"engine.image={digest}")
    assert not any("is a tag" in w for w in pinned.warnings)
    assert not any("/invocations" in w for w in pinned.warnings)  # loopback: nothing exposed


def test_shellcheck_and_bash_accept_the_script_with_every_option(tmp_path):
    script = tmp_path / "run.sh"
    script.write_text(rendered(plan_for("mi355xx8", *EXPOSED, f"model.served_name={HOSTILE}"), "script"))
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    checked = subprocess.run([tool("shellcheck"), str(script)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout
    assert shutil.which("paste") and shutil.which("cut")  # what the env-file check runs


def test_k8s_names_and_comments_stay_valid():
    """The API Service's name is a DNS-1035 label (a letter first, at most 63 characters); a
    value with a line break never reaches a comment line, where it would end the comment."""
    from m31ctl.errors import InputError

    for name in ("1abc", "a" * 60):
        with pytest.raises(InputError, match="DNS-1035"):
            rendered(plan_for("b300x4", f"runtime.container_name={name}"), "k8s")
    assert "a" * 59 + "-api" in rendered(plan_for("b300x4", f"runtime.container_name={'a' * 59}"), "k8s")
    broken = "/srv/a\nservices: {}\u2028#x"
    compose = rendered(plan_for("b300x4", f"runtime.hf_cache={broken}"), "compose")
    assert "mkdir -p <runtime.hf_cache>" in compose
    assert yaml.safe_load(compose)["services"]["vllm"]["volumes"][0]["source"] == broken
    k8s = rendered(plan_for("b300x4", f"model.path={HOSTILE}"), "k8s")
    assert "fetches model.path into the claim" in k8s
    init = list(yaml.safe_load_all(k8s))[1]["spec"]["template"]["spec"]["initContainers"][0]
    assert expand(init["command"][3], mapping_for({})) == HOSTILE


# --- the checkpoint download before the engine (script and systemd, as Kubernetes' init container)


def test_script_downloads_the_checkpoint_first_in_its_own_container(tmp_path):
    plan = plan_for("b300x4", f"runtime.hf_cache={tmp_path}/hf")
    out = tmp_path / "docker-runs.jsonl"
    done, engine = run_script(
        rendered(plan, "script"), tmp_path, {"M31CTL_ENV_FILE": str(tmp_path / "none"), "HF_TOKEN": "hf_tok"}
    )
    assert done.returncode == 0, done.stderr
    download, last = (json.loads(line) for line in out.read_text().splitlines())
    assert last == {**engine[0]} and "entrypoint" not in last  # the engine runs after the download
    assert download["command"][2:] == ["MiniMaxAI/MiniMax-M3.1-Flash", str(derive(plan).budgets.download_s)]
    assert download["env"]["HF_TOKEN"] == "hf_tok"  # by name, from the environment: never in the file
    assert download["mounts"] == engine[0]["mounts"] and not download["devices"]
    assert "hf_tok" not in rendered(plan, "script")


def test_systemd_downloads_first_and_a_local_checkpoint_downloads_nothing(tmp_path):
    unit = rendered(plan_for("b300x4"), "systemd")
    pre = [line for line in unit.splitlines() if line.startswith("ExecStartPre=/usr/bin/docker run")]
    (download,) = pre
    words = shlex_split_systemd(download.removeprefix("ExecStartPre="))
    assert words[:6] == [
        "/usr/bin/docker",
        "run",
        "--rm",
        "--name",
        "m31ctl-minimax-m31-flash-download",
        "--entrypoint",
    ]
    assert "snapshot_download" in words[words.index("-c") + 1] and words[
        words.index("HF_TOKEN") - 1 : words.index("HF_TOKEN") + 1
    ] == ["--env", "HF_TOKEN"]
    assert unit.index("ExecStartPre=/usr/bin/docker run") < unit.index("ExecStart=/usr/bin/docker")
    model = tmp_path / "model"
    model.mkdir()
    local = plan_for("b300x4", f"model.path={model}")
    for target in ("script", "systemd"):
        assert "snapshot_download" not in rendered(local, target)
