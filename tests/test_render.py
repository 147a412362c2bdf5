"""Rendered artifacts: golden files, real validators, a stub docker, hostile values, secrets."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from m31ctl.container import container_spec
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.render import Artifact, get_target
from m31ctl.render.dockercli import docker_run_argv
from m31ctl.render.targets import TARGETS


def render(plan, target: str) -> list[Artifact]:  # type: ignore[no-untyped-def]
    """Through the registry, as `m31ctl render` does (single-host refusal included)."""
    return get_target(target)(plan)


REFERENCE = Path(__file__).parent / "reference_files" / "render"
GOLDEN_HOSTS = ["b300x4", "h200x8", "mi355xx8"]
HOSTILE = 'x\'; rm -rf / $(touch /tmp/pwned) `id` "q" \\ \nnext line'
VENV_BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if path is None:
        pytest.fail(f"{name} is not installed; scripts/bootstrap installs it")
    return path


def plan_for(hw: str, **kw):  # type: ignore[no-untyped-def]
    return resolve(PlanRequest(hardware=simulated(hw), **kw))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("hw", GOLDEN_HOSTS)
def test_golden(hw, target):
    (artifact,) = render(plan_for(hw), target)
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
    spec = container_spec(plan, expand_home=False)

    expected = docker_run_argv(spec._replace(secret_env=()), "detached")
    expected = [
        a.replace("~/", str(tmp_path / "home") + "/", 1) if a.startswith("~/") else a for a in expected
    ]
    assert got == expected
    assert HOSTILE in got


def test_script_hostile_extra_args_stay_literal(tmp_path):
    hostile_args = ["--served-model-name", HOSTILE, "$(id)", "a;b", "'"]
    import json

    plan = plan_for("b300x4", sets=(f"engine.extra_args={json.dumps(hostile_args)}",))
    (artifact,) = render(plan, "script")
    got = run_with_stub(artifact.content, tmp_path, {"M31CTL_ENV_FILE": str(tmp_path / "absent.env")})
    assert got[-len(hostile_args) :] == hostile_args
    assert not Path("/tmp/pwned").exists()


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
    # ...while the script hands the token to docker by name from the environment, not in argv
    (artifact,) = render(plan_for("b300x4"), "script")
    got = run_with_stub(
        artifact.content, tmp_path, {"HF_TOKEN": CANARY, "M31CTL_ENV_FILE": str(tmp_path / "none")}
    )
    assert CANARY not in "\0".join(got) and got[got.index("HF_TOKEN") - 1 : got.index("HF_TOKEN") + 1] == [
        "--env",
        "HF_TOKEN",
    ]


def test_script_uses_private_env_file_and_refuses_open_one(tmp_path):
    (artifact,) = render(plan_for("b300x4"), "script")
    env_file = tmp_path / "secrets.env"
    env_file.write_text(f"HF_TOKEN={CANARY}\n")
    env_file.chmod(0o600)
    got = run_with_stub(artifact.content, tmp_path, {"M31CTL_ENV_FILE": str(env_file)})
    assert ["--env-file", str(env_file)] == got[got.index("--env-file") : got.index("--env-file") + 2]
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
    kinds = [d["kind"] for d in yaml.safe_load_all(artifact.content)]
    assert kinds == ["Deployment", "Service"]
    assert result.stdout.count("passed") == 2
    deployment = next(yaml.safe_load_all(artifact.content))
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    gpu_key = "amd.com/gpu" if hw.startswith("mi") else "nvidia.com/gpu"
    assert container["resources"]["limits"][gpu_key] == (8 if hw == "h200x8" else 4)
    assert container["startupProbe"]["failureThreshold"] * container["startupProbe"]["periodSeconds"] >= 3600
    assert "/v1/models" in " ".join(container["readinessProbe"]["exec"]["command"])
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
    assert service["ports"] == ["0.0.0.0:8000:8000"] and "VLLM_API_KEY" in service["environment"]
    assert "--api-key" not in service["command"]


def test_write_check_and_force(tmp_path, cli):
    out = tmp_path / "deploy"
    args = ["render", "--target", "k8s", "--hardware", "b300x4"]
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


def test_multi_node_layout_renders_a_leader_worker_set(tmp_path):
    import shlex

    plan = plan_for("h100x4", sets=(f"model.served_name={HOSTILE}",))  # hopper TP8 on 4-GPU nodes
    (artifact,) = render(plan, "k8s")
    lws, service = yaml.safe_load_all(artifact.content)
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
    assert "$(LWS_LEADER_ADDRESS):6379" in worker["command"][2]
    script = leader["command"][2]
    assert script.startswith("ray start --head --port=6379 && exec vllm serve ")
    # Kubernetes unescapes $$( to $(; the shell then sees the hostile name as one quoted word
    words = shlex.split(script.replace("$$(", "$(").split("&& exec ", 1)[1])
    assert words[words.index("--served-model-name") + 1] == HOSTILE
    assert words[-2:] == ["--distributed-executor-backend", "ray"]
    assert service["spec"]["selector"] == {
        "leaderworkerset.sigs.k8s.io/name": lws["metadata"]["name"],
        "role": "leader",
    }
    # The pod templates are plain pods: validate them against the Kubernetes schemas.
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


@pytest.mark.parametrize("target", ["script", "compose", "systemd"])
def test_single_host_targets_refuse_a_multi_node_layout(target):
    from m31ctl.errors import InputError

    with pytest.raises(InputError, match="--target k8s"):
        render(plan_for("h100x4"), target)


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
    spec = container_spec(plan)
    assert spec.gpu_device_ids == (capture["gpus"][1]["uuid"],)
    argv = docker_run_argv(spec, "detached")
    assert argv[argv.index("--gpus") + 1] == f'"device={capture["gpus"][1]["uuid"]}"'
    service = yaml.safe_load(render(plan, "compose")[0].content)["services"]["vllm"]
    assert service["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] == [
        capture["gpus"][1]["uuid"]
    ]
    assert container_spec(plan_for("h200x8")).gpu_device_ids == ()  # simulated: by count


def test_libyaml_and_pure_python_emitters_write_the_same_bytes(monkeypatch):
    """Renders use libyaml's emitter when PyYAML has it; a host without it must get the same files."""
    from m31ctl.render import escape

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
