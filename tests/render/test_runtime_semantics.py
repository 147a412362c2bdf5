"""The rendered artifacts read by the rules of the runtime that runs them, not only its schema.

- the script against a stand-in `docker` that applies the Docker CLI's rules (tests/stub_docker.py);
- the systemd unit's own commands, as systemd splits and runs them;
- Compose files through `docker-compose config`;
- Kubernetes manifests through the kubelet's $(NAME) expansion (m31ctl/render/kubelet_expansion.py), with
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

from m31ctl.container import render_spec
from m31ctl.deployment import derive
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.render import get_target
from m31ctl.render.kubelet_expansion import expand, literal, mapping_for
from tests.conftest import PINNED_COMMIT
from tests.support.render import HOSTILE, shlex_split_systemd, tool, unit_lines

STUB_DOCKER = Path(__file__).parent.parent / "stub_docker.py"
CANARY = "hf_CANARY_5ecret_do_not_leak_0123456789"
EXPOSED = ("runtime.bind=0.0.0.0", "runtime.api_key=true")
RWX = "kubernetes.hf_cache_storage_class=nfs-rwx"


def plan_for(hw: str, *sets: str, profile: str | None = None):  # type: ignore[no-untyped-def]
    return resolve(PlanRequest(hardware=simulated(hw), sets=sets, profile=profile))


def rendered(plan, target: str) -> str:  # type: ignore[no-untyped-def]
    (artifact,) = get_target(target)(derive(plan, commit=PINNED_COMMIT))
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
    spec = render_spec(derive(plan, commit=PINNED_COMMIT))
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
    """The script takes a value verbatim (quotes, spaces and backslashes kept, as docker's
    --env-file does); systemd's EnvironmentFile= strips quotes, trims spaces, reads escapes. The
    script and the unit accept only lines both read as the text after `=`, and name a refused
    line by number, never by value. Both hand a container the plan's names only, by name: the
    engine VLLM_API_KEY, the download HF_TOKEN; the last line of a name wins, as in systemd."""
    plan = plan_for("b300x4", *EXPOSED)
    env_file = tmp_path / "secrets.env"
    env_file.write_text("VLLM_API_KEY=overridden\n" + ACCEPTED)
    env_file.chmod(0o600)
    done, (record,) = run_script(
        rendered(plan, "script"), tmp_path, {"M31CTL_ENV_FILE": str(env_file), "HF_TOKEN": "exported"}
    )
    assert done.returncode == 0, done.stderr
    written = dict(line.split("=", 1) for line in ACCEPTED.splitlines() if line and not line.startswith("#"))
    download = _all_runs(tmp_path)[0]
    assert record["env"]["VLLM_API_KEY"] == written["VLLM_API_KEY"]
    assert download["env"]["HF_TOKEN"] == written["HF_TOKEN"]  # the file is the one source
    assert not {"HF_TOKEN", "EMPTY"} & record["env"].keys() and "VLLM_API_KEY" not in download["env"]
    unit = rendered(plan, "systemd")
    check = next(line for line in unit_lines(unit) if "docker and systemd read" in line)
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
    line = next(line for line in unit_lines(unit) if line.startswith(f"{key}=/bin/sh"))
    return shlex_split_systemd(line.split("=", 1)[1])


@pytest.mark.parametrize("hw", ["b300x4", "h200x8", "mi355xx8"])
def test_systemd_exec_lines_fold_one_option_a_line_into_the_same_command(hw, tmp_path):
    """The unit's docker run lines are folded with systemd's continuation (issue 51: a 1,322-
    character ExecStart): joined as systemd joins them, they are one `docker run` through to
    vLLM's flags, the unit still verifies, and each folded line holds one option and its value."""
    unit = rendered(plan_for(hw), "systemd")
    start = next(line for line in unit_lines(unit) if line.startswith("ExecStart="))
    words = shlex_split_systemd(start.removeprefix("ExecStart="))
    assert words[:2] == ["/usr/bin/docker", "run"] and "--tensor-parallel-size" in words
    folded = [line for line in unit.splitlines() if line.endswith(" \\") or line.startswith("    ")]
    assert len(folded) > 20
    for line in folded:
        option = shlex_split_systemd(line.strip().removesuffix("\\"))
        assert len(option) <= 2 or not option[0].startswith("-"), line  # an option and its value
    path = tmp_path / "m31ctl-engine.service"
    path.write_text(unit)
    verify = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert "Failed to parse" not in verify.stderr and "Invalid" not in verify.stderr, verify.stderr


def test_systemd_reports_started_only_once_the_model_answers(tmp_path):
    unit = rendered(plan_for("b300x4", "runtime.startup_timeout=2"), "systemd")
    path = tmp_path / "m31ctl-minimax-m31-flash.service"
    path.write_text(unit)
    verify = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert "Failed to parse" not in verify.stderr and "Invalid" not in verify.stderr, verify.stderr
    # The download (2,001 s), then the readiness wait as set, and a margin: never infinity.
    assert "TimeoutStartSec=2063\n" in unit
    script = _exec_line(unit, "ExecStartPost")[2]
    bin_dir = stub_bin(tmp_path, instant_sleep=True)
    # Every line of the unit runs the same docker binary; here the stand-in takes its place.
    assert "until /usr/bin/docker exec " in script
    script = script.replace("/usr/bin/docker", str(bin_dir / "docker"))
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
    extra = json.dumps(["--code-revision", DOLLARS])  # --revision is m31ctl's (the pinned commit)
    plan = plan_for(hw, *sets, f"model.served_name={DOLLARS}", f"runtime.env.X={DOLLARS}",
                    f"engine.extra_args={extra}", profile=profile)  # fmt: skip
    documents = list(yaml.safe_load_all(rendered(plan, "k8s")))
    for role, pod, lws_env in _pods(documents):
        for env, argv in kubelet_view(pod, lws_env):
            assert all(CANARY not in w for w in argv), role
            assert env.get("X", DOLLARS) == DOLLARS, role
        _env, argv = kubelet_view(pod, lws_env)[-1]
        if role == "pod":
            assert argv == list(render_spec(derive(plan, commit=PINNED_COMMIT), in_pod=True).args)
            continue
        served = [call for call in _run_sh(argv[2], _env, tmp_path) if call[0] == "vllm"]
        for call in served:  # the pod's shell runs vllm with the literal values
            assert call[call.index("--served-model-name") + 1] == DOLLARS
            assert call[call.index("--code-revision") + 1] == DOLLARS
            assert call[call.index("--revision") + 1] == PINNED_COMMIT
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
        assert serve[serve.index("--data-parallel-address") + 1] == LEADER_IP
        ranks += owned
    assert sorted(ranks) == list(range(size))  # every rank exactly once


# What the stub getent resolves the leader's name to (the pod script binds and connects to an IP).
LEADER_IP = "10.1.2.3"


def _run_sh(
    script: str, env: dict[str, str], tmp_path: Path, *, port_fails: int = 0, alive: str = ""
) -> list[list[str]]:
    """Run a pod's /bin/sh -c script with stubs: vllm and ray record their argv; getent resolves
    the leader to LEADER_IP; python3 answers the leader's port check (refused for its first
    `port_fails` calls) and the Ray node count (`alive`, else the group size); sleep returns."""
    bin_dir = tmp_path / "podbin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "calls"
    calls.write_text("")
    Path(f"{calls}.n").write_text("")  # the port checks so far
    for name in ("vllm", "ray"):
        (bin_dir / name).write_text(
            f'#!/bin/sh\nprintf "%s\\0" {name} "$@" >> "$CALLS"\nprintf "\\036" >> "$CALLS"\n'
        )
    (bin_dir / "python3").write_text(
        "#!/bin/sh\n"
        'case "$2" in *create_connection*)\n'
        '  n=$(wc -l < "$CALLS.n"); echo x >> "$CALLS.n"; [ "$n" -ge "$PORT_FAILS" ]; exit ;;\n'
        "esac\n"
        'echo "${RAY_ALIVE:-$LWS_GROUP_SIZE}"\n'
    )
    (bin_dir / "getent").write_text(f'#!/bin/sh\necho "{LEADER_IP}  $2"\n')
    (bin_dir / "sleep").write_text("#!/bin/sh\nexit 0\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    done = subprocess.run(
        ["/bin/sh", "-c", script],
        env={**env, "PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(calls), "PORT_FAILS": str(port_fails),
             **({"RAY_ALIVE": alive} if alive else {})},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    _run_sh.last = done  # type: ignore[attr-defined]
    return [record.split("\0")[:-1] for record in calls.read_text().split("\x1e") if record]


def test_ray_nodes_wait_for_each_other_like_multi_node_serving(tmp_path):
    """vLLM's examples/online_serving/multi-node-serving.sh: a worker waits for the Ray head; the
    leader waits until every node is alive before the engine starts. The worker waits for the
    head's port (resolved to an IP first) and then execs `ray start --block`: PID 1 is Ray, which
    stops its node on SIGTERM, not a shell loop that ignores it."""
    plan = plan_for("h100x4", "parallelism.nodes=2", RWX)
    timeline = derive(plan).timeline
    lws = next(d for d in yaml.safe_load_all(rendered(plan, "k8s")) if d["kind"] == "LeaderWorkerSet")
    (_l, leader, leader_lws), (_w, worker, worker_lws) = _pods([lws])
    worker_env, worker_argv = kubelet_view(worker, worker_lws)[-1]
    joined = _run_sh(worker_argv[2], worker_env, tmp_path, port_fails=3)
    assert _run_sh.last.returncode == 0, _run_sh.last.stderr  # type: ignore[attr-defined]
    assert joined == [["ray", "start", f"--address={LEADER_IP}:6379", "--block"]]  # once, after the port
    assert "waiting for the leader" in _run_sh.last.stderr  # type: ignore[attr-defined]
    never = _run_sh(worker_argv[2], worker_env, tmp_path, port_fails=10**6)
    assert _run_sh.last.returncode == 1 and never == []  # type: ignore[attr-defined]
    assert f"did not answer within {timeline.leader_wait_s} s" in _run_sh.last.stderr  # type: ignore[attr-defined]
    leader_env, leader_argv = kubelet_view(leader, leader_lws)[-1]
    head, serve = _run_sh(leader_argv[2], leader_env, tmp_path)
    assert head[:3] == ["ray", "start", "--head"] and serve[:2] == ["vllm", "serve"]
    alone = _run_sh(leader_argv[2], leader_env, tmp_path, alive="1")
    assert _run_sh.last.returncode == 1 and [c[0] for c in alone] == ["ray"]  # type: ignore[attr-defined]
    assert f"joined within {timeline.join.seconds} s" in _run_sh.last.stderr  # type: ignore[attr-defined]
    for script in (leader_argv[2], worker_argv[2]):
        checked = subprocess.run(
            [tool("shellcheck"), "-s", "sh", "-"], input=script, capture_output=True, text=True
        )
        assert checked.returncode == 0, checked.stdout


def test_a_headless_worker_starts_vllm_only_once_the_leader_listens(tmp_path):
    """vLLM's headless data-parallel worker gives up five minutes after it starts when the
    leader's front-end has not answered (HANDSHAKE_TIMEOUT_MINS): the pod script starts it only
    once the leader's DP RPC port accepts, bounded by the timeline, with a log line."""
    plan = plan_for("h100x4", "parallelism.nodes=2", RWX, profile="throughput")
    timeline = derive(plan).timeline
    lws = next(d for d in yaml.safe_load_all(rendered(plan, "k8s")) if d["kind"] == "LeaderWorkerSet")
    _leader, (_w, worker, worker_lws) = _pods([lws])
    worker_env, worker_argv = kubelet_view(worker, worker_lws)[-1]
    (serve,) = _run_sh(worker_argv[2], worker_env, tmp_path, port_fails=5)
    assert serve[:2] == ["vllm", "serve"] and "--headless" in serve
    assert serve[serve.index("--data-parallel-address") + 1] == LEADER_IP
    assert Path(f"{tmp_path / 'calls'}.n").read_text().count("x") == 6  # five refusals, then it started
    assert "starting the headless worker" in _run_sh.last.stderr  # type: ignore[attr-defined]
    late = _run_sh(worker_argv[2], worker_env, tmp_path, port_fails=10**6)
    assert late == [] and _run_sh.last.returncode == 1  # type: ignore[attr-defined]
    assert f":29550 did not answer within {timeline.leader_wait_s} s" in _run_sh.last.stderr  # type: ignore[attr-defined]
    assert timeline.leader_wait_s > 300  # longer than vLLM's handshake: the leader may still be pulling


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
    client = {"labels": {"app": "gateway", "m31ctl.io/api-client": "true"}, "namespace": NAMESPACE}
    # The API key guards /v1 only: a pod without the client label reaches no path of the API port.
    unlabelled = {"labels": {"app": "gateway"}, "namespace": NAMESPACE}
    elsewhere = {**client, "namespace": "other"}
    outside = {"ip": "203.0.113.7"}
    torch_store = 41234  # vLLM picks free ports for torch.distributed's store
    for port in (6379, 29550, torch_store, 8000):
        assert _admits(policy, leader, peer, port), port
    assert _admits(policy, leader, client, 8000)
    assert not any(_admits(policy, leader, client, port) for port in (6379, 29550, torch_store))
    assert not any(_admits(policy, leader, who, 8000) for who in (elsewhere, outside, unlabelled))
    narrowed = plan_for(
        "b300x4", 'kubernetes.api_clients=[{"podSelector": {"matchLabels": {"app": "gateway"}}}]'
    )
    single = next(d for d in yaml.safe_load_all(rendered(narrowed, "k8s")) if d["kind"] == "NetworkPolicy")
    pod = {"app.kubernetes.io/name": "m31ctl-minimax-m31-flash"}
    assert _admits(single, pod, unlabelled, 8000)
    assert not _admits(single, pod, {"labels": {"app": "other"}, "namespace": NAMESPACE}, 8000)


def test_the_pods_need_the_api_key_unless_a_setting_says_otherwise():
    def engine_env(plan) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
        return list(yaml.safe_load_all(rendered(plan, "k8s")))[1]["spec"]["template"]["spec"]["containers"][
            0
        ]["env"]

    key = {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": "m31ctl-minimax-m31-flash-secrets", "key": "VLLM_API_KEY", "optional": False}}}  # fmt: skip
    assert key in engine_env(plan_for("b300x4"))  # runtime.api_key=false: the cluster still needs it
    assert all(
        e["name"] != "VLLM_API_KEY"
        for e in engine_env(plan_for("b300x4", "kubernetes.require_api_key=false"))
    )


def test_the_download_has_its_own_budget_and_the_probe_covers_load_and_compile(tmp_path):
    plan = plan_for("h200x8", "runtime.download_mbps=2000000")  # a checkpoint of 250 GB: 1-2 s
    budget = derive(plan).timeline.download_s
    assert budget <= 2
    pod = list(yaml.safe_load_all(rendered(plan, "k8s")))[1]["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    probe = pod["containers"][0]["startupProbe"]
    assert probe["failureThreshold"] * probe["periodSeconds"] == derive(plan).timeline.ready_s
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "m31ctl-minimax-m31-flash-secrets", "key": "HF_TOKEN", "optional": True}}} in init["env"]  # fmt: skip
    _env, argv = kubelet_view(pod, [])[0]
    hub = tmp_path / "stub_hub"
    hub.mkdir()
    (hub / "huggingface_hub.py").write_text(
        "import json, os, time\n"
        "def snapshot_download(repo_id, revision=None, ignore_patterns=None):\n"
        "    print(json.dumps([repo_id, revision, ignore_patterns]))\n"
        "    time.sleep(float(os.environ.get('STUB_HUB_SECONDS', '0')))\n"
        # as huggingface_hub does: the snapshot's folder, named after its commit
        "    return os.path.join('/stub/snapshots', revision)\n"
    )
    run = [sys.executable, *argv[1:]]
    fetched = subprocess.run(run, env={"PYTHONPATH": str(hub)}, capture_output=True, text=True, timeout=30)
    assert fetched.returncode == 0, fetched.stderr
    # Hopper does not draft: the DSpark folder stays on the hub, as `m31ctl pull` leaves it.
    assert json.loads(fetched.stdout.splitlines()[0]) == [
        "MiniMaxAI/MiniMax-M3.1-Flash",
        PINNED_COMMIT,
        ["dspark/*"],
    ]
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
    assert "fetches model.path at commit" in k8s
    init = list(yaml.safe_load_all(k8s))[1]["spec"]["template"]["spec"]["initContainers"][0]
    assert expand(init["command"][3], mapping_for({})) == HOSTILE


# --- the checkpoint download before the engine (script and systemd, as Kubernetes' init container)


def test_script_downloads_the_checkpoint_first_in_its_own_container(tmp_path):
    plan = plan_for("b300x4", f"runtime.hf_cache={tmp_path}/hf")
    out = tmp_path / "docker-runs.jsonl"
    done, engine = run_script(
        rendered(plan, "script"),
        tmp_path,
        {"M31CTL_ENV_FILE": str(tmp_path / "none"), "HF_TOKEN": "hf_dl_canary"},
    )
    assert done.returncode == 0, done.stderr
    download, last = (json.loads(line) for line in out.read_text().splitlines())
    assert last == {**engine[0]} and "entrypoint" not in last  # the engine runs after the download
    assert download["command"][2:5] == [
        "MiniMaxAI/MiniMax-M3.1-Flash", PINNED_COMMIT, str(derive(plan).timeline.download_s)
    ]  # fmt: skip
    assert download["env"]["HF_TOKEN"] == "hf_dl_canary"  # by name, from the environment: never in the file
    assert "HF_TOKEN" not in engine[0]["env"]  # the engine serves offline: it never gets the token
    assert download["mounts"] == engine[0]["mounts"] and not download["devices"]
    assert "hf_dl_canary" not in rendered(plan, "script")


def test_systemd_downloads_first_and_a_local_checkpoint_downloads_nothing(tmp_path):
    unit = rendered(plan_for("b300x4"), "systemd")
    pre = [line for line in unit_lines(unit) if line.startswith("ExecStartPre=/usr/bin/docker run")]
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


# --- secrets as files, names that collide, pods that schedule (issue 39) ------------------------

TOKEN_IN_CONTAINER = "/run/secrets/hf_token"


def _hub_token(env: dict[str, str]) -> str | None:
    """The token huggingface_hub itself finds in `env` (HF_TOKEN first, then HF_TOKEN_PATH's file)."""
    code = "from huggingface_hub import get_token; print(get_token())"
    done = subprocess.run(
        [sys.executable, "-c", code], env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return None if done.stdout.strip() == "None" else done.stdout.strip()


def test_compose_hands_the_hf_token_over_as_a_file_that_config_never_prints(tmp_path):
    """`docker compose config` printed an exported HF_TOKEN (bare names are resolved); the
    download now reads a Compose secret, a file mounted at /run/secrets/hf_token, through
    HF_TOKEN_PATH, and neither service has HF_TOKEN in its environment."""
    token = tmp_path / "hf-token"
    token.write_text(CANARY + "\n")
    token.chmod(0o600)
    path = tmp_path / "compose.yaml"
    path.write_text(rendered(plan_for("b300x4", *EXPOSED), "compose"))
    key = tmp_path / "api-key"
    key.write_text("k\n")
    base = {
        "PATH": os.environ["PATH"], "HOME": str(tmp_path), "HF_TOKEN": CANARY, "VLLM_API_KEY": CANARY,
        "M31CTL_API_KEY_FILE": str(key),
    }  # fmt: skip
    for env, source in (({}, "/dev/null"), ({"M31CTL_HF_TOKEN_FILE": str(token)}, str(token))):
        resolved = subprocess.run(
            [tool("docker-compose"), "-f", str(path), "config"],
            capture_output=True, text=True, env={**base, **env}, cwd=tmp_path,
        )  # fmt: skip
        assert resolved.returncode == 0, resolved.stderr
        assert CANARY not in resolved.stdout
        document = yaml.safe_load(resolved.stdout)
        assert document["secrets"] == {"hf_token": {"file": source}, "vllm_api_key": {"file": str(key)}}
        download, engine = document["services"]["download"], document["services"]["vllm"]
        assert download["secrets"] == [{"source": "hf_token"}]  # mounted at /run/secrets/hf_token
        assert download["environment"]["HF_TOKEN_PATH"] == TOKEN_IN_CONTAINER
        assert "HF_TOKEN" not in download["environment"] and "HF_TOKEN" not in engine["environment"]
        # The API key too is a file (issue 53), exported by the engine's start: no environment entry.
        assert "VLLM_API_KEY" not in engine["environment"] and engine["secrets"] == [
            {"source": "vllm_api_key"}
        ]
    # What the download's huggingface_hub makes of the mounted file; /dev/null is no token.
    assert _hub_token({"HF_TOKEN_PATH": str(token)}) == CANARY
    assert _hub_token({"HF_TOKEN_PATH": "/dev/null"}) is None


def _all_runs(tmp_path: Path) -> list[dict[str, Any]]:
    out = tmp_path / "docker-runs.jsonl"
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_script_mounts_the_hf_token_file_and_the_engine_never_gets_the_token(tmp_path):
    plan = plan_for("b300x4", *EXPOSED, f"runtime.hf_cache={tmp_path}/hf")
    token = tmp_path / 'tokens,"x"' / "hf-token"  # a comma and a quote: one CSV field all the same
    token.parent.mkdir()
    token.write_text(CANARY)
    token.chmod(0o600)
    env = {"M31CTL_ENV_FILE": str(tmp_path / "none"), "M31CTL_HF_TOKEN_FILE": str(token),
           "HF_TOKEN": CANARY, "VLLM_API_KEY": "k"}  # fmt: skip
    done, (engine,) = run_script(rendered(plan, "script"), tmp_path, env)
    assert done.returncode == 0, done.stderr
    download = _all_runs(tmp_path)[0]
    assert {"type": "bind", "source": str(token), "target": TOKEN_IN_CONTAINER, "readonly": True} in download[
        "mounts"
    ]
    assert download["env"]["HF_TOKEN_PATH"] == TOKEN_IN_CONTAINER and "HF_TOKEN" not in download["env"]
    assert "HF_TOKEN" not in engine["env"] and engine["env"]["VLLM_API_KEY"] == "k"
    token.chmod(0o644)
    refused, records = run_script(rendered(plan, "script"), tmp_path, env)
    assert refused.returncode == 2 and "chmod 600" in refused.stderr and records == []


def test_the_systemd_engine_never_gets_the_hf_token():
    unit = rendered(plan_for("b300x4", *EXPOSED), "systemd")
    start = shlex_split_systemd(next(line for line in unit_lines(unit) if line.startswith("ExecStart=")))
    assert "HF_TOKEN" not in start and start[start.index("VLLM_API_KEY") - 1] == "--env"
    download = next(line for line in unit_lines(unit) if line.startswith("ExecStartPre=/usr/bin/docker run"))
    assert "--env HF_TOKEN " in download  # the download's own container, by name, while it runs


# A docker that also keeps the daemon's one rule on names: `run --name N` fails while a container
# N exists ("Conflict"), `rm --force` removes it; the rest is the stand-in's (tests/stub_docker.py).
NAMED_DOCKER = """
import os, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
import stub_docker
held_file = Path(os.environ["STUB_DIR"]) / "containers"
held = held_file.read_text().split() if held_file.exists() else []
argv = sys.argv[1:]
if argv[:2] == ["rm", "--force"]:
    held_file.write_text("\\n".join(n for n in held if n not in argv[2:]))
    sys.exit(0)
if argv[:1] == ["run"] and "--name" in argv and argv[argv.index("--name") + 1] in held:
    name = argv[argv.index("--name") + 1]
    print(f'docker: Error response from daemon: Conflict. The container name "/{{name}}" is already in use.',
          file=sys.stderr)
    sys.exit(125)
sys.exit(stub_docker.main(argv))
"""


def _named_docker(tmp_path: Path, leftover: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    docker = bin_dir / "docker"
    docker.write_text(f"#!{sys.executable}\n" + NAMED_DOCKER.format(tests=str(STUB_DOCKER.parent)))
    docker.chmod(0o755)
    (tmp_path / "containers").write_text(leftover + "\n")
    return docker


def test_a_leftover_download_container_never_blocks_the_next_start(tmp_path):
    """A killed run leaves `<name>-download` behind: the script and the unit remove it before
    their download; Compose names its own download container after the project, so a script's
    leftover cannot collide with it."""
    plan = plan_for("b300x4", f"runtime.hf_cache={tmp_path}/hf")
    leftover = "m31ctl-minimax-m31-flash-download"
    docker = _named_docker(tmp_path, leftover)
    out = tmp_path / "docker-runs.jsonl"
    env = {"PATH": f"{docker.parent}:/usr/bin:/bin", "HOME": str(tmp_path), "STUB_DIR": str(tmp_path),
           "STUB_DOCKER_OUT": str(out), "M31CTL_ENV_FILE": str(tmp_path / "none")}  # fmt: skip
    script = tmp_path / "run.sh"
    script.write_text(rendered(plan, "script"))
    done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert [r["name"] for r in _all_runs(tmp_path)] == [leftover, "m31ctl-minimax-m31-flash"]
    # The unit's ExecStartPre lines, in order, as systemd runs them ("-": a failure is ignored).
    _named_docker(tmp_path, leftover)
    out.unlink()
    unit = rendered(plan, "systemd")
    for line in unit_lines(unit):
        if line.startswith("ExecStartPre=") and "/bin/sh" not in line:
            command = line.removeprefix("ExecStartPre=")
            words = shlex_split_systemd(command.removeprefix("-"))
            words[0] = str(docker) if words[0] == "/usr/bin/docker" else words[0]
            ran = subprocess.run(words, env=env, capture_output=True, text=True)
            assert ran.returncode == 0 or command.startswith("-"), ran.stderr
    assert [r["name"] for r in _all_runs(tmp_path)] == [leftover]
    # Compose: the containers it names are the engine's alone (<project>_download_1 otherwise).
    services = yaml.safe_load(rendered(plan, "compose"))["services"]
    assert {s.get("container_name") for s in services.values()} == {"m31ctl-minimax-m31-flash", None}


def _k8s(plan) -> tuple[str, list[dict[str, Any]]]:  # type: ignore[no-untyped-def]
    text = rendered(plan, "k8s")
    return text, list(yaml.safe_load_all(text))


def test_two_deployments_in_one_namespace_share_no_claim_or_secret():
    """Every object is named after runtime.container_name, and each workload references its own
    claim, its own Secret (the one the header's `kubectl create secret` names) and its own pods."""
    names: dict[str, set[tuple[str, str]]] = {}
    for name in ("alpha", "beta"):
        text, (claim, deployment, service, policy) = _k8s(
            plan_for("b300x4", f"runtime.container_name={name}")
        )
        pod = deployment["spec"]["template"]["spec"]
        claims = {
            v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v
        }
        refs = {
            e["valueFrom"]["secretKeyRef"]["name"]
            for c in [*pod["initContainers"], *pod["containers"]]
            for e in c["env"]
            if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
        }
        assert claims == {claim["metadata"]["name"]} == {f"{name}-hf-cache"}
        assert refs == {f"{name}-secrets"} and f"kubectl create secret generic {name}-secrets " in text
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        assert policy["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": name}
        names[name] = {(d["kind"], d["metadata"]["name"]) for d in (claim, deployment, service, policy)}
        names[name] |= {("Secret", ref) for ref in refs}
    assert names["alpha"].isdisjoint(names["beta"])


def test_the_cpu_rehearsal_schedules_on_a_cpu_cluster(tmp_path):
    """--hardware cpu: 2 CPUs and 8 GiB, no GPU resource or GPU node label, and a cache claim
    sized for what is downloaded into it (nothing: the tiny model is a hostPath)."""
    text, (claim, deployment, _service, _policy) = _k8s(plan_for("cpu"))
    path = tmp_path / "k8s.yaml"
    path.write_text(text)
    checked = subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(path)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    wanted = {"cpu": "2", "memory": "8Gi"}
    assert container["resources"] == {"limits": wanted, "requests": wanted}
    assert "nodeSelector" not in pod and "gpu.product" not in text and "gpu.device-id" not in text
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    _, (sized, *_rest) = _k8s(plan_for("cpu", "kubernetes.hf_cache_size=50g"))
    assert sized["spec"]["resources"]["requests"]["storage"] == "50Gi"  # the plan's size, when it names one


def qos_class(pod: dict[str, Any]) -> str:
    """The pod's QoS class as the kubelet computes it (pkg/apis/core/helper/qos GetPodQOS): every
    container, init containers included, counts; a request left out defaults to its limit."""
    containers = [*pod.get("initContainers", []), *pod["containers"]]
    resources = [c.get("resources", {}) for c in containers]
    if not any(
        r.get(k, {}).get(n) for r in resources for k in ("requests", "limits") for n in ("cpu", "memory")
    ):
        return "BestEffort"
    for r in resources:
        limits, requests = r.get("limits", {}), r.get("requests", {})
        for name in ("cpu", "memory"):
            if name not in limits or requests.get(name, limits[name]) != limits[name]:
                return "Burstable"
    return "Guaranteed"


def _pods_of(documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    pods = []
    for d in documents:
        if d["kind"] == "Deployment":
            pods.append(d["spec"]["template"]["spec"])
        elif d["kind"] == "LeaderWorkerSet":
            template = d["spec"]["leaderWorkerTemplate"]
            pods += [template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]]
    return pods


@pytest.mark.parametrize(
    ("hw", "sets", "profile"),
    [
        ("b300x4", (), None),
        ("mi355xx8", (), None),
        ("cpu", (), None),
        ("h100x4", ("parallelism.nodes=2", RWX), None),  # PP over nodes, Ray
        (
            "h100x4",
            ("parallelism.nodes=2", RWX),
            "throughput",
        ),  # DP over nodes; workers wait for the checkpoint
    ],
)
def test_every_pod_is_guaranteed(hw, sets, profile):
    """Requests equal to limits in every container, the download's and the checkpoint wait's
    init containers included: one container without them made the pod Burstable."""
    _, documents = _k8s(plan_for(hw, *sets, profile=profile))
    pods = _pods_of(documents)
    assert pods and all(qos_class(pod) == "Guaranteed" for pod in pods)
    assert any(pod.get("initContainers") for pod in pods) or hw == "cpu"


def test_the_header_says_rays_ports_have_no_authentication_where_the_policy_guards_them():
    text, documents = _k8s(plan_for("h100x4", "parallelism.nodes=2", RWX))
    comments = " ".join(line.removeprefix("# ") for line in text.splitlines() if line.startswith("#"))
    assert "Ray's ports (6379, 10001) have no authentication" in comments
    lws = next(d for d in documents if d["kind"] == "LeaderWorkerSet")
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
    assert "ray start --head --port=6379" in leader["spec"]["containers"][0]["command"][2]
    policy = next(d for d in documents if d["kind"] == "NetworkPolicy")
    name = lws["metadata"]["name"]
    labels = {**leader["metadata"]["labels"], "leaderworkerset.sigs.k8s.io/name": name}
    peer = {"labels": {"leaderworkerset.sigs.k8s.io/name": name}, "namespace": NAMESPACE}
    client = {"labels": {"m31ctl.io/api-client": "true"}, "namespace": NAMESPACE}
    other = {"labels": {"app": "other"}, "namespace": NAMESPACE}
    for port in (6379, 10001):
        assert _admits(policy, labels, peer, port)
        assert not _admits(policy, labels, client, port) and not _admits(policy, labels, other, port)
    dp_text, _ = _k8s(plan_for("h100x4", "parallelism.nodes=2", RWX, profile="throughput"))
    assert "Ray's ports" not in dp_text  # no Ray in vLLM's multi-node data parallelism
