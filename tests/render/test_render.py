"""Rendered artifacts: golden files, real validators, a stub docker, hostile values, secrets."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from m31ctl.container import container_spec, render_spec
from m31ctl.deployment import derive
from m31ctl.docker_run import docker_run_argv
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.render import Artifact, get_target
from m31ctl.render.kubelet_expansion import expand, mapping_for
from m31ctl.render.targets import TARGETS
from tests.conftest import PINNED_COMMIT
from tests.support.render import HOSTILE, REFERENCE, shlex_split_systemd, tool


def render(plan, target: str) -> list[Artifact]:  # type: ignore[no-untyped-def]
    """Through the registry, as `m31ctl render` does (single-host refusal included)."""
    return get_target(target)(derive(plan, commit=PINNED_COMMIT))


GOLDEN_HOSTS = ["b300x4", "h200x8", "mi355xx8"]


def plan_for(hw: str, **kw):  # type: ignore[no-untyped-def]
    return resolve(PlanRequest(hardware=simulated(hw), **kw))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("hw", GOLDEN_HOSTS)
def test_golden(hw, target, monkeypatch):
    monkeypatch.setenv("HOME", "/home/operator")  # systemd names the rendering user's cache
    for artifact in render(plan_for(hw), target):  # a target may write several files (monitoring)
        golden = REFERENCE / f"{hw}" / artifact.name
        if os.environ.get("M31CTL_UPDATE_GOLDEN"):
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(artifact.content)
        assert artifact.content == golden.read_text(), (
            f"re-run with M31CTL_UPDATE_GOLDEN=1 if {golden} should change"
        )


@pytest.mark.parametrize("target", TARGETS)
def test_byte_identical_and_headed(target):
    first = render(plan_for("b300x4"), target)[0].content
    assert first == render(plan_for("b300x4"), target)[0].content
    plan = plan_for("b300x4")
    assert (
        f"recipe blackwell, variant quickstart, profile latency, plan {plan.hash}"
        in first.splitlines()[1 if target == "script" else 0]
    )


@pytest.mark.parametrize("hw", GOLDEN_HOSTS)
def test_script_passes_bash_n_and_shellcheck(hw, tmp_path):
    (artifact,) = render(plan_for(hw, sets=(f"model.served_name={HOSTILE}",)), "script")
    script = tmp_path / artifact.name
    script.write_text(artifact.content)
    subprocess.run(["bash", "-n", str(script)], check=True)
    result = subprocess.run([tool("shellcheck"), str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


STUB = """#!/usr/bin/env bash
# Records its argv, NUL-separated, and answers `container inspect` with "absent".
if [ "$1" = container ]; then exit 1; fi
printf '%s\\0' "$@" > "$STUB_ARGV"
"""


def run_with_stub(script_text: str, tmp_path: Path, env: dict[str, str]) -> list[str]:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    stub = bindir / "docker"
    stub.write_text(STUB)
    stub.chmod(0o755)
    script = tmp_path / "run.sh"
    script.write_text(script_text)
    argv_file = tmp_path / "argv"
    full_env = {
        "PATH": f"{bindir}:/usr/bin:/bin",
        "HOME": str(tmp_path / "home"),
        "STUB_ARGV": str(argv_file),
        **env,
    }
    subprocess.run(["bash", str(script)], check=True, env=full_env, capture_output=True, text=True)
    return argv_file.read_bytes().decode().split("\0")[:-1]


@pytest.mark.parametrize("hw", GOLDEN_HOSTS)
def test_script_passes_exactly_the_planned_argv(hw, tmp_path):
    plan = plan_for(hw, sets=(f"model.served_name={HOSTILE}",))
    (artifact,) = render(plan, "script")
    got = run_with_stub(artifact.content, tmp_path, {"M31CTL_ENV_FILE": str(tmp_path / "absent.env")})
    # The cache is the home of whoever runs the script (the stub's HOME), not the renderer's.
    spec = render_spec(derive(plan, commit=PINNED_COMMIT, home=str(tmp_path / "home")))
    expected = docker_run_argv(spec._replace(secret_env=()), "detached")
    assert [csv_fields(w) for w in got] == [csv_fields(w) for w in expected]
    assert HOSTILE in got


def csv_fields(word: str) -> list[str] | str:
    """A --mount word as the Docker CLI reads it (one CSV record: quoting aside); else the word."""
    import csv

    return next(csv.reader([word])) if word.startswith(("type=", '"type=')) else word


def test_script_hostile_extra_args_stay_literal(tmp_path):
    pwned = tmp_path / "pwned"
    hostile_args = [
        "--code-revision",  # --revision is owned (model.revision)
        HOSTILE,
        f"$(touch {pwned}1)",
        f"a;touch {pwned}2",
        f"`touch {pwned}3`",
        "'",
    ]
    import json

    plan = plan_for("b300x4", sets=(f"engine.extra_args={json.dumps(hostile_args)}",))
    (artifact,) = render(plan, "script")
    got = run_with_stub(artifact.content, tmp_path, {"M31CTL_ENV_FILE": str(tmp_path / "absent.env")})
    assert got[-len(hostile_args) :] == hostile_args
    assert not list(tmp_path.glob("pwned*"))  # no substitution ran while the script built its argv


CANARY = "hf_CANARY_5ecret_do_not_leak_0123456789"


def test_secret_canary_never_appears(tmp_path, cli):
    env = {"HF_TOKEN": CANARY, "VLLM_API_KEY": CANARY + "_key"}
    outputs = []
    for target in TARGETS:
        outdir = tmp_path / target
        result = cli(
            "render",
            "--target",
            target,
            "--hardware",
            "b300x4",
            "-o",
            str(outdir),
            "--set",
            "runtime.bind=0.0.0.0",
            "--set",
            "runtime.api_key=true",
            env=env,
        )
        assert result.returncode == 0, result.stderr
        outputs += [result.stdout, result.stderr]
        outputs += [p.read_text() for p in outdir.iterdir()]
    for command in (
        ["plan", "--hardware", "b300x4", "--json"],
        ["plan", "--hardware", "b300x4", "--explain"],
        ["doctor", "--hardware", "b300x4", "--json"],
    ):
        result = cli(*command, env=env)
        outputs += [result.stdout, result.stderr]
    assert all(CANARY not in text for text in outputs)
    # ...while the script hands the key to the engine by name from the environment, not in argv,
    # and the token to the download alone (tests/render/test_runtime_semantics.py)
    (artifact,) = render(plan_for("b300x4", sets=EXPOSED), "script")
    got = run_with_stub(
        artifact.content,
        tmp_path,
        {"HF_TOKEN": CANARY, "VLLM_API_KEY": CANARY, "M31CTL_ENV_FILE": str(tmp_path / "none")},
    )
    assert CANARY not in "\0".join(got) and "HF_TOKEN" not in got
    assert got[got.index("VLLM_API_KEY") - 1 : got.index("VLLM_API_KEY") + 1] == ["--env", "VLLM_API_KEY"]


def test_script_uses_private_env_file_and_refuses_open_one(tmp_path):
    (artifact,) = render(plan_for("b300x4", sets=EXPOSED), "script")
    env_file = tmp_path / "secrets.env"
    env_file.write_text(f"HF_TOKEN={CANARY}\nVLLM_API_KEY={CANARY}_key\n")
    env_file.chmod(0o600)
    got = run_with_stub(artifact.content, tmp_path, {"M31CTL_ENV_FILE": str(env_file)})
    # The engine (the stub's last call) gets the key by name from the file, never the token.
    assert CANARY not in "\0".join(got) and "HF_TOKEN" not in got and "--env-file" not in got
    assert got[got.index("VLLM_API_KEY") - 1 : got.index("VLLM_API_KEY") + 1] == ["--env", "VLLM_API_KEY"]
    env_file.chmod(0o644)
    with pytest.raises(subprocess.CalledProcessError) as info:
        run_with_stub(artifact.content, tmp_path, {"M31CTL_ENV_FILE": str(env_file)})
    assert info.value.returncode == 2 and "chmod 600" in info.value.stderr


@pytest.mark.parametrize("hw", GOLDEN_HOSTS)
def test_k8s_validates_against_kubernetes_schemas(hw, tmp_path):
    (artifact,) = render(plan_for(hw, sets=(f"model.served_name={HOSTILE}",)), "k8s")
    path = tmp_path / "k8s.yaml"
    path.write_text(artifact.content)
    result = subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    documents = list(yaml.safe_load_all(artifact.content))
    assert [d["kind"] for d in documents] == [
        "PersistentVolumeClaim",
        "Deployment",
        "Service",
        "NetworkPolicy",
    ]
    assert result.stdout.count("passed") == 4
    claim, deployment = documents[0], documents[1]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]  # one pod: one node mounts it
    assert claim["spec"]["resources"]["requests"]["storage"] == "600Gi"
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    gpu_key = "amd.com/gpu" if hw.startswith("mi") else "nvidia.com/gpu"
    assert container["resources"]["limits"][gpu_key] == (8 if hw == "h200x8" else 4)
    # Sized from the plan: the init container downloads 250.1 GB at 1 Gbit/s (2,001 s) at the
    # pinned commit; the startup probe covers the 1,200 s of load and compile and the API's 60 s.
    probe = container["startupProbe"]
    assert probe["failureThreshold"] * probe["periodSeconds"] == 1200 + 60
    assert pod["initContainers"][0]["command"][3:6] == ["MiniMaxAI/MiniMax-M3.1-Flash", PINNED_COMMIT, "2001"]
    assert container["resources"]["requests"]["cpu"] == "16"
    assert container["resources"]["requests"]["memory"] == "256Gi"
    product = {"b300x4": ("nvidia.com/gpu.product", "NVIDIA-B300-SXM6-AC"),
               "h200x8": ("nvidia.com/gpu.product", "NVIDIA-H200"),
               "mi355xx8": ("amd.com/gpu.device-id", "75a3")}[hw]  # fmt: skip
    assert pod["nodeSelector"] == dict([product])
    assert "securityContext" not in container  # Pod Security "baseline" (kubernetes.pod_security)
    assert "/v1/completions" in " ".join(container["readinessProbe"]["exec"]["command"])
    assert pod["terminationGracePeriodSeconds"] >= 30
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["volumes"]
    assert all("value" not in e or e["name"] not in ("HF_TOKEN", "VLLM_API_KEY") for e in container["env"])


@pytest.mark.parametrize("hw", GOLDEN_HOSTS)
def test_compose_validates_against_compose_spec(hw, tmp_path):
    (artifact,) = render(plan_for(hw, sets=(f"model.served_name={HOSTILE}",)), "compose")
    path = tmp_path / "compose.yaml"
    path.write_text(artifact.content)
    result = subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    service = yaml.safe_load(artifact.content)["services"]["vllm"]
    assert service["ports"] == ["127.0.0.1:8000:8000"]
    # Compose interpolates $: the hostile value is escaped so that compose hands over the literal.
    name_index = service["command"].index("--served-model-name") + 1
    assert service["command"][name_index].replace("$$", "$") == HOSTILE


def test_exposing_requires_api_key():
    from m31ctl.errors import InputError

    with pytest.raises(InputError, match="API key"):
        plan_for("b300x4", sets=("runtime.bind=0.0.0.0",))
    plan = plan_for("b300x4", sets=("runtime.bind=0.0.0.0", "runtime.api_key=true"))
    (artifact,) = render(plan, "compose")
    service = yaml.safe_load(artifact.content)["services"]["vllm"]
    assert service["ports"] == ["0.0.0.0:8000:8000"]
    # The key as Compose's secret (a file), exported by the start before the image's `vllm serve`:
    # never an environment entry (`docker compose config` would print it, `docker inspect` show it).
    assert not any("VLLM_API_KEY" in entry for entry in service["environment"])
    assert service["secrets"] == ["vllm_api_key"]
    assert service["entrypoint"][-5:] == [
        "/run/secrets/vllm_api_key", "VLLM_API_KEY", "M31CTL_API_KEY_FILE", "vllm", "serve",
    ]  # fmt: skip
    secret = yaml.safe_load(artifact.content)["secrets"]["vllm_api_key"]["file"]
    assert secret.startswith("${M31CTL_API_KEY_FILE:?the plan requires VLLM_API_KEY")
    assert "--api-key" not in service["command"]


def test_write_check_and_force(tmp_path, cli):
    out = tmp_path / "deploy"
    args = ["render", "--target", "k8s", "--hardware", "b300x4", "--revision", PINNED_COMMIT]
    first = cli(*args, "-o", str(out))
    assert first.returncode == 0 and "written" in first.stderr
    assert cli(*args, "--check", str(out)).returncode == 0
    assert cli(*args, "-o", str(out)).stderr.startswith("unchanged")
    changed = [*args, "--set", "serving.max_model_len=131072"]
    drift = cli(*changed, "--check", str(out))
    assert (
        drift.returncode == 1
        and "-        - '262144'" in drift.stdout
        and "+        - '131072'" in drift.stdout
    )
    refused = cli(*changed, "-o", str(out))
    assert refused.returncode == 4 and "--force" in refused.stderr and "Traceback" not in refused.stderr
    assert "262144" in (out / "k8s.yaml").read_text()  # untouched
    assert cli(*changed, "-o", str(out), "--force").returncode == 0
    assert "131072" in (out / "k8s.yaml").read_text()
    assert [p.name for p in out.iterdir()] == ["k8s.yaml"]  # no temporary files left
    assert cli(*args, "--check", str(tmp_path / "missing")).returncode == 2


def test_script_is_executable(tmp_path, cli):
    assert cli("render", "--target", "script", "--hardware", "h200x8", "-o", str(tmp_path)).returncode == 0
    assert (tmp_path / "m31ctl-run.sh").stat().st_mode & stat.S_IXUSR


def test_bad_target(cli):
    result = cli("render", "--target", "helm", "--hardware", "b300x4")
    assert result.returncode == 2 and "choose one of" in result.stderr


def _run_pod_script(script: str, tmp_path, env: dict[str, str]) -> list[list[str]]:  # type: ignore[no-untyped-def]
    """What a pod's `/bin/sh -c SCRIPT` runs, after the kubelet's own expansion (`$$` -> `$`,
    m31ctl/render/kubelet_expansion.py): stub `vllm` and `ray` record their argv, one call a line; `python3`
    answers the leader's Ray node count with the group size (and the port check with success),
    `getent` resolves the leader's name to LEADER_IP, `sleep` returns at once."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool_name in ("vllm", "ray"):
        stub = bin_dir / tool_name
        # argv NUL-separated, calls ended by an ASCII record separator (a value may hold newlines).
        stub.write_text(
            f'#!/bin/sh\nprintf "%s\\0" {tool_name} "$@" >> "$CALLS"\nprintf "\\036" >> "$CALLS"\n'
        )
        stub.chmod(0o755)
    (bin_dir / "python3").write_text('#!/bin/sh\necho "$LWS_GROUP_SIZE"\n')
    (bin_dir / "sleep").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "getent").write_text(f'#!/bin/sh\necho "{LEADER_IP}      $2"\n')
    for name in ("python3", "sleep", "getent"):
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / f"calls-{len(list(tmp_path.glob('calls-*')))}"
    calls.write_text("")
    subprocess.run(
        ["/bin/sh", "-c", expand(script, mapping_for(env))],
        check=True,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(calls), **env},
    )
    return [record.split("\0")[:-1] for record in calls.read_text().split("\x1e") if record]


def _validate_pod_templates(template, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The pod templates are plain pods: validate them against the Kubernetes schemas."""
    for role, tpl in (("leader", template["leaderTemplate"]), ("worker", template["workerTemplate"])):
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": f"x-{role}", **tpl["metadata"]},
            "spec": tpl["spec"],
        }
        path = tmp_path / f"{role}.yaml"
        path.write_text(yaml.safe_dump(pod))
        result = subprocess.run(
            [tool("kubernetes-validate"), "--strict", str(path)], capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout + result.stderr


LWS_ENV = {"LWS_LEADER_ADDRESS": "leader.lws.svc", "LWS_GROUP_SIZE": "2"}
# What the stub getent resolves the leader's name to: vLLM binds and connects to an address.
LEADER_IP = "10.0.0.7"
# A group's pods share the cache claim: ReadWriteMany, from a class that provisions it.
RWX = "kubernetes.hf_cache_storage_class=nfs-rwx"


def test_tp8_on_4_gpu_nodes_is_tp4_within_and_pp2_across(tmp_path):
    """Hopper's TP8 on nodes of four: tensor parallelism within a node, pipeline parallelism
    across (vLLM's multi-node guide; the LWS example for vLLM), one engine over Ray."""
    plan = plan_for("h100x4", sets=(f"model.served_name={HOSTILE}", "parallelism.nodes=2", RWX))
    assert (plan.settings.parallelism.tensor, plan.settings.parallelism.pipeline) == (4, 2)
    assert "TP4 within a node, PP2 across nodes" in str(plan.provenance["parallelism.pipeline"])
    (artifact,) = render(plan, "k8s")
    claim, lws, service, _policy = yaml.safe_load_all(artifact.content)
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # two nodes share the checkpoint
    assert lws["kind"] == "LeaderWorkerSet" and lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader = template["leaderTemplate"]["spec"]["containers"][0]
    worker = template["workerTemplate"]["spec"]["containers"][0]
    assert (
        leader["resources"]["limits"]["nvidia.com/gpu"]
        == 4
        == worker["resources"]["limits"]["nvidia.com/gpu"]
    )
    (ray_head, serve) = _run_pod_script(leader["command"][2], tmp_path, {**LWS_ENV, "LWS_WORKER_INDEX": "0"})
    assert ray_head[:3] == ["ray", "start", "--head"]
    assert serve[:2] == ["vllm", "serve"]
    assert serve[serve.index("--served-model-name") + 1] == HOSTILE  # one literal word, unexpanded
    assert serve[serve.index("--tensor-parallel-size") + 1] == "4"
    assert serve[serve.index("--pipeline-parallel-size") + 1] == "2"
    assert serve[-2:] == ["--distributed-executor-backend", "ray"]
    (join,) = _run_pod_script(worker["command"][2], tmp_path, {**LWS_ENV, "LWS_WORKER_INDEX": "1"})
    assert join == ["ray", "start", f"--address={LEADER_IP}:6379", "--block"]
    assert service["spec"]["selector"] == {
        "leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"],
        "role": "leader",
    }
    _validate_pod_templates(template, tmp_path)


def test_dep_over_two_nodes_renders_vllm_multi_node_data_parallelism(tmp_path):
    """DEP8 on two 4-GPU nodes: every pod runs `vllm serve` with four local ranks; the leader
    serves the API, the worker runs headless from rank 4 (vLLM's data-parallel deployment);
    without --data-parallel-size-local vLLM would start all eight ranks on the leader."""
    plan = plan_for("h100x4", profile="throughput", sets=(f"model.served_name={HOSTILE}", "parallelism.nodes=2", RWX,
                    "kubernetes.network_resources={\"rdma/ib\": 1}",
                    "kubernetes.network_env={\"NCCL_IB_HCA\": \"mlx5\"}"))  # fmt: skip
    (artifact,) = render(plan, "k8s")
    _claim, lws, _service, _policy = yaml.safe_load_all(artifact.content)
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2
    leader = template["leaderTemplate"]["spec"]["containers"][0]
    worker = template["workerTemplate"]["spec"]["containers"][0]
    for pod in (leader, worker):
        assert pod["resources"]["limits"]["rdma/ib"] == 1
        assert {"name": "NCCL_IB_HCA", "value": "mlx5"} in pod["env"]
    (lead,) = _run_pod_script(leader["command"][2], tmp_path, {**LWS_ENV, "LWS_WORKER_INDEX": "0"})
    (work,) = _run_pod_script(worker["command"][2], tmp_path, {**LWS_ENV, "LWS_WORKER_INDEX": "1"})

    def flag(argv: list[str], name: str) -> str:
        return argv[argv.index(name) + 1]

    for argv in (lead, work):
        assert flag(argv, "--data-parallel-size") == "8" and flag(argv, "--data-parallel-size-local") == "4"
        assert flag(argv, "--data-parallel-address") == LEADER_IP  # resolved: ZMQ binds an address
        assert flag(argv, "--data-parallel-rpc-port") == "29550"
        assert "--enable-expert-parallel" in argv and "--distributed-executor-backend" not in argv
    assert "--headless" not in lead and "--headless" in work
    assert flag(work, "--data-parallel-start-rank") == "4"
    assert "readinessProbe" in leader and "readinessProbe" not in worker
    _validate_pod_templates(template, tmp_path)


@pytest.mark.parametrize("target", ["script", "compose", "systemd"])
def test_single_host_targets_refuse_a_multi_node_layout(target):
    from m31ctl.errors import InputError

    with pytest.raises(InputError, match="--target k8s"):
        render(plan_for("h100x4", sets=("parallelism.nodes=2",)), target)


def test_probed_host_pins_its_visible_gpus_by_uuid(tmp_path):
    """A plan made from this host's probe hands over exactly the GPUs the probe saw (it honours
    CUDA_VISIBLE_DEVICES); Docker would otherwise take the first N of the host."""
    import json as jsonlib

    from m31ctl.probe import detect
    from m31ctl.probe.nvidia import NvmlProbe
    from tests.fakes import GPU_FIXTURES, FakeNvml

    capture = jsonlib.loads((GPU_FIXTURES / "device-h200x2" / "nvml-capture.json").read_text())
    hw = detect([NvmlProbe(FakeNvml(capture))], env={"CUDA_VISIBLE_DEVICES": "1"}).hardware
    plan = resolve(PlanRequest(hardware=hw, sets=("parallelism.tensor=1",)))
    spec = container_spec(derive(plan))
    assert spec.gpu_device_ids == (capture["gpus"][1]["uuid"],)
    argv = docker_run_argv(spec, "detached")
    assert argv[argv.index("--gpus") + 1] == f'"device={capture["gpus"][1]["uuid"]}"'
    service = yaml.safe_load(render(plan, "compose")[0].content)["services"]["vllm"]
    assert service["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == [
        capture["gpus"][1]["uuid"]
    ]
    assert container_spec(derive(plan_for("h200x8"))).gpu_device_ids == ()  # simulated: by count


def test_libyaml_and_pure_python_emitters_write_the_same_bytes(monkeypatch):
    """Renders use libyaml's emitter when PyYAML has it; a host without it must get the same files."""
    from m31ctl.render import escape

    monkeypatch.setenv("M31CTL_NO_CACHE", "1")  # both emitters must really run

    hostile = {
        "name": "x: y # not a comment",
        "multi": "line one\nline two\n",
        "unicode": "Ünïcødé — ✓",
        "dollar": "${HF_TOKEN} $(id)",
        "quoted": "'single' \"double\"",
        "values": ["yes", "no", "on", "null", "~", "0o17", "1e3", "", " lead", "trail "],
        "numbers": [0, -1, 3.5, True, None],
        "nested": [{"a": {"b": ["c"]}}],
    }
    with_c = escape.yaml_file(["# c"], [hostile], explicit_start=True)
    escape._dumper.cache_clear()
    monkeypatch.delattr(yaml, "CSafeDumper")
    try:
        pure = escape.yaml_file(["# c"], [hostile], explicit_start=True)
    finally:
        escape._dumper.cache_clear()
    assert with_c == pure
    assert list(yaml.safe_load_all(pure)) == [hostile]


def test_emitted_yaml_memo_changes_nothing(tmp_path, monkeypatch):
    """The memoized YAML equals freshly emitted YAML; documents that YAML writes differently
    (1, True, "1"; key order) never share an entry; a broken entry or an unwritable cache
    directory falls back to emitting."""
    from m31ctl.render import escape

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    documents = [{"a": 1, "b": [True, None, "1", 1.0]}, {"b": 1, "a": 1}]
    monkeypatch.setenv("M31CTL_NO_CACHE", "1")
    fresh = escape.yaml_file(["# c"], documents, explicit_start=True)
    monkeypatch.delenv("M31CTL_NO_CACHE")
    assert escape.yaml_file(["# c"], documents, explicit_start=True) == fresh  # emits, stores
    entries = list((tmp_path / "cache" / "m31ctl" / "yaml").glob("*.json"))
    assert len(entries) == 1
    assert escape.yaml_file(["# c"], documents, explicit_start=True) == fresh  # from the memo
    twins = ([{"a": 1}], [{"a": True}], [{"a": "1"}], [{"a": 1.0}], [{"a": 1, "b": 1}], [{"b": 1, "a": 1}])
    texts = [escape.yaml_file([], twin, explicit_start=True) for twin in twins]  # each stored in turn
    assert len(set(texts)) == len(twins)
    for twin, text in zip(twins, texts, strict=True):
        assert (
            list(yaml.safe_load_all(text)) == twin and escape.yaml_file([], twin, explicit_start=True) == text
        )
    entries[0].write_text("{not json", encoding="utf-8")
    assert escape.yaml_file(["# c"], documents, explicit_start=True) == fresh
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    assert escape.yaml_file(["# c"], documents, explicit_start=True) == fresh


# Issue 15: artifacts an engineer can apply as they are.

EXPOSED = ("runtime.bind=0.0.0.0", "runtime.api_key=true")


@pytest.mark.parametrize("target", ["script", "compose", "systemd", "k8s"])
def test_local_model_directory_is_mounted_by_every_target(target):
    (artifact,) = render(plan_for("b300x4", sets=("model.path=/srv/models/m31",)), target)
    text = artifact.content
    if target == "k8s":
        pod = list(yaml.safe_load_all(text))[1]["spec"]["template"]["spec"]
        assert {"name": "model-0", "hostPath": {"path": "/srv/models/m31", "type": "Directory"}} in pod[
            "volumes"
        ]
        mount = {"name": "model-0", "mountPath": "/srv/models/m31", "readOnly": True}
        assert mount in pod["containers"][0]["volumeMounts"]
    elif target == "compose":
        volume = {"type": "bind", "source": "/srv/models/m31", "target": "/srv/models/m31", "read_only": True}
        assert volume in yaml.safe_load(text)["services"]["vllm"]["volumes"]
    else:
        assert "--mount type=bind,source=/srv/models/m31,target=/srv/models/m31,readonly" in text


def test_script_fails_closed_without_the_api_key(tmp_path):
    (artifact,) = render(plan_for("b300x4", sets=EXPOSED), "script")
    env = {"M31CTL_ENV_FILE": str(tmp_path / "absent.env")}
    with pytest.raises(subprocess.CalledProcessError) as info:
        run_with_stub(artifact.content, tmp_path, env)
    assert info.value.returncode == 2 and "requires VLLM_API_KEY" in info.value.stderr
    assert not (tmp_path / "argv").exists() or (tmp_path / "argv").read_bytes() == b""  # docker never ran
    got = run_with_stub(artifact.content, tmp_path, {**env, "VLLM_API_KEY": "k"})
    assert got[got.index("VLLM_API_KEY") - 1 : got.index("VLLM_API_KEY") + 1] == ["--env", "VLLM_API_KEY"]
    env_file = tmp_path / "keys.env"
    env_file.write_text("HF_TOKEN=x\n")
    env_file.chmod(0o600)
    with pytest.raises(subprocess.CalledProcessError) as info:
        run_with_stub(artifact.content, tmp_path, {"M31CTL_ENV_FILE": str(env_file), "VLLM_API_KEY": "k"})
    assert info.value.returncode == 2 and "does not set it" in info.value.stderr


def test_systemd_fails_closed_without_the_api_key(tmp_path):
    (artifact,) = render(plan_for("b300x4", sets=EXPOSED), "systemd")
    unit = artifact.content
    assert "EnvironmentFile=/etc/m31ctl/minimax-m31-flash.env" in unit  # not optional ("-")
    check = next(line for line in unit.splitlines() if "VLLM_API_KEY is not set" in line)
    path = tmp_path / artifact.name
    path.write_text(unit)
    verify = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True)
    assert "Failed to parse" not in verify.stderr and "Invalid" not in verify.stderr, verify.stderr
    # What systemd runs for that line: unescape ($$ -> $, \" -> "), then /bin/sh -c.
    script = shlex_split_systemd(check.split("=", 1)[1])[2]
    assert subprocess.run(["/bin/sh", "-c", script], env={}, capture_output=True).returncode == 1
    assert subprocess.run(["/bin/sh", "-c", script], env={"VLLM_API_KEY": "k"}).returncode == 0
    (plain,) = render(plan_for("b300x4"), "systemd")
    assert "EnvironmentFile=-/etc/m31ctl/minimax-m31-flash.env" in plain.content  # HF_TOKEN is optional


def _compose_config(path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:  # type: ignore[no-untyped-def]
    return subprocess.run(
        [tool("docker-compose"), "-f", str(path), "config"],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "HOME": "/home/operator", **env},
        cwd=path.parent,
    )


def test_compose_fails_closed_and_escapes_every_value(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", "/home/operator")  # the cache path is expanded once, at render
    plan = plan_for(
        "b300x4",
        sets=(*EXPOSED, "engine.image=registry.example/vllm:${HF_TOKEN}", "runtime.env.X=$(id) ${HF_TOKEN}"),
    )
    (artifact,) = render(plan, "compose")
    path = tmp_path / "compose.yaml"
    path.write_text(artifact.content)
    # An exported key is not what Compose reads: without the key file it refuses the file.
    refused = _compose_config(path, {"HF_TOKEN": "leak", "VLLM_API_KEY": "leak-key"})
    assert refused.returncode != 0 and "the plan requires VLLM_API_KEY" in refused.stderr
    key_file = tmp_path / "api-key"
    key_file.write_text("leak-key\n")
    env = {"HF_TOKEN": "leak", "VLLM_API_KEY": "leak-key", "M31CTL_API_KEY_FILE": str(key_file)}
    resolved = _compose_config(path, env)
    assert resolved.returncode == 0, resolved.stderr
    assert "leak" not in resolved.stdout  # neither the token nor the key: the key file's name only
    document = yaml.safe_load(resolved.stdout)
    assert document["secrets"]["vllm_api_key"]["file"] == str(key_file)  # the one deliberate interpolation
    service = document["services"]["vllm"]
    # `config` prints literals re-escaped ($$): the token's value is nowhere.
    assert service["image"].replace("$$", "$") == "registry.example/vllm:${HF_TOKEN}"
    assert service["environment"]["X"].replace("$$", "$") == "$(id) ${HF_TOKEN}"
    assert "VLLM_API_KEY" not in service["environment"]
    cache = {
        "type": "bind",
        "source": "/home/operator/.cache/huggingface",
        "target": "/root/.cache/huggingface",
    }
    assert cache in service["volumes"]
    assert "leak" not in json.dumps({k: v for k, v in service.items() if k != "environment"})


def test_k8s_env_values_are_escaped_for_kubernetes_expansion():
    (artifact,) = render(plan_for("b300x4", sets=("runtime.env.X=$(SECRET_NAME)",)), "k8s")
    deployment = list(yaml.safe_load_all(artifact.content))[1]
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "X", "value": "$$(SECRET_NAME)"} in env


@pytest.mark.parametrize(
    "setting",
    [
        "runtime.env.HF_TOKEN=Canary7secret",
        "runtime.env.VLLM_API_KEY=Canary7secret",
        "runtime.env.HUGGING_FACE_HUB_TOKEN=Canary7secret",
        'engine.extra_args=["--api-key", "Canary7secret"]',
        'engine.extra_args=["--api-key=Canary7secret"]',
        'engine.extra_args=["--hf-token", "Canary7secret"]',
    ],
)
def test_secrets_by_value_are_refused(setting, cli):
    for as_json in ((), ("--json",)):
        result = cli("plan", "--hardware", "b300x4", "--set", setting, *as_json)
        assert result.returncode == 2, result.stderr
        assert "secret" in result.stderr and ("export" in result.stderr or "runtime.api_key" in result.stderr)
        assert "Canary7secret" not in result.stderr + result.stdout  # the refusal never quotes the value


def test_startup_budget_is_sized_from_the_plan():
    fast = plan_for("b300x4", sets=("runtime.download_mbps=10000",))
    slow = plan_for("b300x4", sets=("runtime.download_mbps=500",))
    assert (
        derive(slow).timeline.start_s > 3600 > derive(fast).timeline.start_s
    )  # 250.1 GB at 500 Mbit/s: 4,002 s
    # The readiness wait after the engine starts does not depend on the link: the download ran first.
    assert derive(slow).timeline.ready_s == derive(fast).timeline.ready_s == 1200 + 60
    assert derive(plan_for("b300x4", sets=("runtime.startup_timeout=99",))).timeline.ready_s == 99


def test_systemd_uses_a_system_cache_unless_the_plan_names_one(monkeypatch):
    """A root unit installed on a server: the built-in `~/.cache/huggingface` would bake the
    renderer's home (rendered with HOME=/srv/build, the unit made /srv/build/.cache on the
    server), so the unit uses /var/lib/m31ctl/huggingface; a cache the plan names is kept."""
    monkeypatch.setenv("HOME", "/srv/build")
    (artifact,) = render(plan_for("b300x4"), "systemd")
    assert "source=/var/lib/m31ctl/huggingface,target=/root/.cache/huggingface" in artifact.content
    assert "/srv/build" not in artifact.content and "%h" not in artifact.content
    (named,) = render(plan_for("b300x4", sets=("runtime.hf_cache=/data/hf",)), "systemd")
    assert "source=/data/hf,target=/root/.cache/huggingface" in named.content


def test_amd_containers_get_exactly_the_probed_gpus_and_a_video_group():
    from m31ctl.hardware import GPU

    hw = simulated("mi355xx8")
    gpus = tuple(
        GPU(index=i, name="AMD Instinct MI355X", arch="gfx950", memory_total_bytes=hw.memory_per_gpu_bytes,
            pci_device_id="0x75a3", render_node=f"/dev/dri/renderD{128 + 8 * i}")
        for i in range(8)
    )  # fmt: skip
    probed = hw.model_copy(update={"gpus": gpus, "source": "kfd-sysfs", "simulated": False})
    spec = container_spec(derive(resolve(PlanRequest(hardware=probed))))
    assert spec.devices == ("/dev/kfd", "/dev/dri/renderD128", "/dev/dri/renderD136",
                            "/dev/dri/renderD144", "/dev/dri/renderD152")  # fmt: skip
    assert spec.group_add == ("video",)
    argv = docker_run_argv(container_spec(derive(plan_for("mi355xx8"))), "detached")
    assert "render" not in argv and argv[argv.index("/dev/dri") - 1 : argv.index("/dev/dri") + 1] == [
        "--device",
        "/dev/dri",
    ]


def test_script_wait_returns_when_ready_and_fails_when_the_container_dies(tmp_path):
    (artifact,) = render(plan_for("b300x4", sets=("runtime.startup_timeout=30",)), "script")
    script = tmp_path / "run.sh"
    script.write_text(artifact.content.replace("sleep 10", "sleep 0.1"))
    script.chmod(0o755)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A stub docker: `container inspect` finds nothing, `run` succeeds, `exec` answers on its
    # third call (or never, with STUB_DEAD), `inspect` reports the container running or not.
    (bin_dir / "docker").write_text(
        "#!/bin/bash\n"
        'case "$1" in\n'
        "  container) exit 1 ;;\n"
        "  run) exit 0 ;;\n"
        '  exec) n=$(cat "$STUB_DIR/n" 2>/dev/null || echo 0); echo $((n+1)) > "$STUB_DIR/n"; '
        '[ -z "$STUB_DEAD" ] && [ "$n" -ge 2 ] ;;\n'
        '  inspect) [ -n "$STUB_DEAD" ] && echo false || echo true ;;\n'
        "esac\n"
    )
    (bin_dir / "docker").chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "STUB_DIR": str(tmp_path),
        "M31CTL_ENV_FILE": str(tmp_path / "none"),
    }
    ready = subprocess.run([str(script), "--wait"], env=env, capture_output=True, text=True, timeout=60)
    assert ready.returncode == 0 and "is ready" in ready.stderr + ready.stdout, ready.stderr
    (tmp_path / "n").unlink()
    dead = subprocess.run(
        [str(script), "--wait"], env={**env, "STUB_DEAD": "1"}, capture_output=True, text=True, timeout=60
    )
    assert dead.returncode == 5 and "stopped while loading" in dead.stderr
    assert subprocess.run([str(script), "--bogus"], env=env, capture_output=True).returncode == 2


def test_kubernetes_scheduling_settings_reach_the_pod(tmp_path):
    toleration = '{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}'
    plan = plan_for(
        "b300x4",
        sets=(f"kubernetes.tolerations=[{toleration}]", 'kubernetes.node_selector={"pool": "gpu-b300"}',
              "kubernetes.hf_cache_storage_class=fast-rwx", "kubernetes.memory=512g"),
    )  # fmt: skip
    (artifact,) = render(plan, "k8s")
    path = tmp_path / "k8s.yaml"
    path.write_text(artifact.content)
    checked = subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(path)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    claim, deployment, _service, _policy = yaml.safe_load_all(artifact.content)
    pod = deployment["spec"]["template"]["spec"]
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-B300-SXM6-AC", "pool": "gpu-b300"}
    assert pod["containers"][0]["resources"]["requests"]["memory"] == "512Gi"
    assert claim["spec"]["storageClassName"] == "fast-rwx"


@pytest.mark.parametrize(
    ("target", "restart"),
    [
        ("script", "`docker restart` it"),
        ("systemd", "`systemctl restart m31ctl-minimax-m31-flash.service`"),
        ("compose", "`docker compose restart vllm`"),
    ],
)
def test_every_docker_target_says_what_to_run_for_a_hung_engine(target, restart):
    """Docker restarts a container that exits, never one its healthcheck calls unhealthy (only
    Swarm acts on health), and systemd has no probe of a docker run: each file says so, and what
    to run instead; the Kubernetes liveness probe restarts a hung engine by itself."""
    (artifact,) = render(plan_for("b300x4"), target)
    comments = " ".join(
        line.removeprefix("#").strip() for line in artifact.content.splitlines() if line.startswith("#")
    )
    assert "Liveness:" in comments and restart in comments
    assert (
        "not when it hangs" in comments
        or "not one that hangs" in comments
        or "do not restart an unhealthy" in comments
    )
