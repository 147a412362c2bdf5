"""Doctor: each check's logic on captured inputs, the runner's isolation, and real components."""

from __future__ import annotations

import json
import socket
import time

import pytest

from m31ctl.deployment import derive
from m31ctl.doctor import diagnose
from m31ctl.doctor.base import Check, Context, Outcome, run_checks
from m31ctl.doctor.checks import all_checks
from m31ctl.errors import DockerUnreachable
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest
from m31ctl.probe import NO_GPU, ProbeReport, detect
from m31ctl.probe.nvidia import NvmlProbe
from tests.conftest import run_cli
from tests.fakes import GPU_FIXTURES, FakeNvml

DEVICE = GPU_FIXTURES / "device-h200x2"
CANARY = "hf_CANARY_doctor_0123456789"


class FakeDocker:
    """A daemon as docker-py reports it: runtimes from `docker info` on an NVIDIA host."""

    def __init__(
        self,
        runtimes: tuple[str, ...] = ("runc", "nvidia"),
        images: tuple[str, ...] = (),
        image_env: tuple[str, ...] = (),
    ) -> None:
        self.runtimes = runtimes
        self.images = self
        self.present = images
        self.image_env = image_env  # the image's Config.Env, as `docker image inspect` shows it
        self.api = self

    def version(self) -> dict[str, str]:
        return {"Version": "28.2.2", "ApiVersion": "1.50"}

    def info(self) -> dict[str, object]:
        return {"Runtimes": {r: {} for r in self.runtimes}, "CDISpecDirs": []}

    def get(self, name: str):  # type: ignore[no-untyped-def]
        from docker.errors import ImageNotFound

        if name in self.present:
            attrs = {"Config": {"Env": list(self.image_env)}}
            return type("Image", (), {"short_id": "sha256:abc", "id": "sha256:abc", "attrs": attrs})()
        raise ImageNotFound(name)

    def inspect_distribution(self, name: str) -> None:
        from docker.errors import APIError

        raise APIError(
            "Get https://registry-1.docker.io/v2/: dial tcp: lookup registry-1.docker.io: no such host"
        )


def h200_probe(**gpu_updates: object) -> ProbeReport:
    capture = json.loads((DEVICE / "nvml-capture.json").read_text())
    for gpu in capture["gpus"]:
        gpu.update(gpu_updates)
    return detect([NvmlProbe(FakeNvml(capture))], env={})


def results(
    probe: ProbeReport, sets: tuple[str, ...] = (), docker: object = None, hardware: str | None = None
):  # type: ignore[no-untyped-def]
    hw = simulated(hardware) if hardware else probe.hardware
    request = PlanRequest(hardware=hw, sets=sets)
    report = diagnose(request, probe, (lambda: docker) if docker is not None else _no_docker)
    return {r.id: r for r in report.results}, report


def _no_docker():  # type: ignore[no-untyped-def]
    raise DockerUnreachable("cannot reach the Docker Engine at unix:///nowhere: no socket")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PORT = f"runtime.port={free_port()}"
TWO_GPU_PLAN = ("parallelism.tensor=2", "serving.max_model_len=8192", PORT)


def test_real_h200_capture_passes_gpu_checks_with_a_two_gpu_plan():
    by_id, report = results(h200_probe(), TWO_GPU_PLAN, FakeDocker())
    assert report.plan is not None and report.plan.recipe.recipe == "hopper"
    for check in ("gpus", "gpu-memory", "mig", "driver", "docker", "gpu-runtime"):
        assert by_id[check].status == "ok", (check, by_id[check])
    assert by_id["rocm"].status == "skip"
    assert "150.1 GB free" in by_id["gpu-memory"].message


def test_hopper_default_plan_needs_eight_gpus():
    by_id, _ = results(h200_probe(), (PORT,), FakeDocker())
    assert by_id["gpus"].status == "fail" and "needs 8" in by_id["gpus"].message


def test_mig_enabled_fails():
    by_id, _ = results(h200_probe(mig=[1, 1]), TWO_GPU_PLAN, FakeDocker())
    assert by_id["mig"].status == "fail" and "nvidia-smi -mig 0" in by_id["mig"].remedy


def test_busy_gpus_fail_memory_check():
    by_id, _ = results(h200_probe(mem_free=50 * 10**9), TWO_GPU_PLAN, FakeDocker())
    assert by_id["gpu-memory"].status == "fail" and "125.0 GB per GPU" in by_id["gpu-memory"].message


def test_blackwell_below_cuda_13_4_warns():
    probe = h200_probe(name="NVIDIA GB300", cc=[10, 3], mem_total=284208 * 2**20, mem_free=280000 * 2**20)
    by_id, report = results(probe, (PORT,), FakeDocker())
    capture4 = json.loads((DEVICE / "nvml-capture.json").read_text())
    assert report.plan.recipe.recipe == "blackwell"
    assert capture4["cuda_driver"] == 13000
    assert by_id["driver"].status == "warn" and "CUDA 13.4" in by_id["driver"].message


def test_no_nvidia_runtime_fails():
    by_id, _ = results(h200_probe(), TWO_GPU_PLAN, FakeDocker(runtimes=("runc",)))
    assert by_id["gpu-runtime"].status == "fail" and "nvidia-container-toolkit" in by_id["gpu-runtime"].remedy


def test_image_absent_and_registry_unreachable_warns():
    by_id, _ = results(h200_probe(), TWO_GPU_PLAN, FakeDocker())
    assert by_id["image"].status == "warn" and "not present locally" in by_id["image"].message
    by_id, _ = results(h200_probe(), TWO_GPU_PLAN, FakeDocker(images=("vllm/vllm-openai:minimax-m31-flash",)))
    assert by_id["image"].status == "ok"


def test_capacity_warning_when_max_num_seqs_cannot_fit():
    by_id, _ = results(h200_probe(), (*TWO_GPU_PLAN, "serving.max_num_seqs=64"), FakeDocker())
    assert by_id["capacity"].status == "warn" and "max_num_seqs=64" in by_id["capacity"].message


def test_port_in_use_fails():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        by_id, _ = results(h200_probe(), ("parallelism.tensor=2", f"runtime.port={port}"), FakeDocker())
    assert by_id["port"].status == "fail" and str(port) in by_id["port"].message


def test_no_gpu_host_reports_without_crashing():
    probe = ProbeReport(NO_GPU, ())
    report = diagnose(None, probe, _no_docker)
    by_id = {r.id: r for r in report.results}
    assert report.plan is None and "no GPU" in (report.plan_error or "")
    assert by_id["gpus"].status == "fail" and by_id["docker"].status == "fail"
    assert by_id["disk"].status == "skip"


def test_a_raising_check_fails_alone_and_a_hanging_one_times_out():
    def boom(ctx: Context) -> Outcome:
        raise RuntimeError("kaput")

    def hang(ctx: Context) -> Outcome:
        time.sleep(3)
        return Outcome("ok", "late")

    def slow_ok(ctx: Context) -> Outcome:
        time.sleep(0.4)
        return Outcome("ok", "fine")

    ctx = Context(deployment=None, plan_error=None, probe=ProbeReport(NO_GPU, ()), env={})
    checks = [Check("boom", "Boom", boom), Check("hang", "Hang", hang, timeout_s=0.5)] + [
        Check(f"slow{i}", "Slow", slow_ok) for i in range(4)
    ]
    start = time.monotonic()
    out = {r.id: r for r in run_checks(checks, ctx)}
    elapsed = time.monotonic() - start
    assert out["boom"].status == "fail" and "kaput" in out["boom"].message
    assert out["hang"].status == "fail" and "no answer within 0.5 s" in out["hang"].message
    assert all(out[f"slow{i}"].status == "ok" for i in range(4))
    assert elapsed < 1.5  # concurrent: four 0.4 s checks and a 0.5 s limit, not 2.1 s in a row


def test_json_is_stable_and_secret_free(cli):
    result = cli("doctor", "--hardware", "cpu", "--json", env={"HF_TOKEN": CANARY})
    assert CANARY not in result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert set(data) == {"plan_hash", "recipe", "plan_error", "checks", "summary", "ok"}
    assert [c["id"] for c in data["checks"]] == [c.id for c in all_checks() if not c.deep]
    for check in data["checks"]:
        assert set(check) == {"id", "title", "status", "message", "remedy", "duration_s"}
    assert result.returncode == (0 if data["ok"] else 1)


@pytest.mark.docker
def test_against_this_machine(cli):
    """The real Docker Engine (.ci/run starts it), no GPU: docker passes, GPU checks say why."""
    cpu = cli("doctor", "--hardware", "cpu", "--json", "--set", PORT)
    data = {c["id"]: c for c in json.loads(cpu.stdout)["checks"]}
    assert data["docker"]["status"] == "ok" and "API" in data["docker"]["message"]
    assert data["gpus"]["status"] == "ok" and data["gpu-runtime"]["status"] == "ok"
    host = run_cli("doctor", "--json")
    checks = {c["id"]: c for c in json.loads(host.stdout)["checks"]}
    assert (
        host.returncode == 1
        and checks["gpus"]["status"] == "fail"
        and "no GPU found" in checks["gpus"]["message"]
    )
    assert checks["docker"]["status"] == "ok"
    gpu_plan = run_cli("doctor", "--hardware", "b300x4", "--json")
    checks = {c["id"]: c for c in json.loads(gpu_plan.stdout)["checks"]}
    assert checks["gpu-runtime"]["status"] == "fail" and checks["gpus"]["status"] == "fail"
    assert sum(c["duration_s"] for c in checks.values()) < 15


# Issue 16: checks that passed hosts vLLM or Docker would reject.

IMAGE = "vllm/vllm-openai:minimax-m31-flash"


def test_gpu_memory_held_by_another_process_fails():
    """Weights fit, but free memory is below utilization x total: vLLM 0.32 raises at start."""
    by_id, _ = results(
        h200_probe(mem_free=130 * 10**9), (*TWO_GPU_PLAN, "serving.gpu_memory_utilization=0.95"), FakeDocker()
    )
    check = by_id["gpu-memory"]
    assert check.status == "fail" and "vLLM refuses to start" in check.message


@pytest.mark.parametrize(
    ("driver_cuda", "image_cuda", "status"),
    [(12020, "12.8.1", "fail"), (13000, "13.1.0", "fail"), (13000, "12.9.1", "ok")],
)
def test_driver_floor_comes_from_the_image_cuda(driver_cuda, image_cuda, status):
    capture = json.loads((DEVICE / "nvml-capture.json").read_text())
    capture["cuda_driver"] = driver_cuda
    probe = detect([NvmlProbe(FakeNvml(capture))], env={})
    docker = FakeDocker(images=(IMAGE,), image_env=(f"CUDA_VERSION={image_cuda}", "PATH=/usr/bin"))
    by_id, _ = results(probe, TWO_GPU_PLAN, docker)
    assert by_id["driver"].status == status, by_id["driver"]
    if status == "fail":
        assert f"built on CUDA {image_cuda[:4]}" in by_id["driver"].message


def test_partial_download_is_not_a_cached_checkpoint(tmp_path):
    snapshot = tmp_path / "hub" / "models--MiniMaxAI--MiniMax-M3.1-Flash" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    by_id, _ = results(h200_probe(), (*TWO_GPU_PLAN, f"runtime.hf_cache={tmp_path}"), FakeDocker())
    assert by_id["checkpoint"].status == "fail" and "no weights" in by_id["checkpoint"].message
    assert "already" not in by_id["disk"].message
    assert by_id["hf-token"].status == "warn"
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (snapshot / "model.safetensors.index.json").write_text(json.dumps(index))
    (snapshot / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 4096)
    by_id, _ = results(h200_probe(), (*TWO_GPU_PLAN, f"runtime.hf_cache={tmp_path}"), FakeDocker())
    assert by_id["checkpoint"].status == "fail" and "1 of 2 shards" in by_id["checkpoint"].message
    (snapshot / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 4096)
    by_id, _ = results(h200_probe(), (*TWO_GPU_PLAN, f"runtime.hf_cache={tmp_path}"), FakeDocker())
    assert by_id["checkpoint"].status == "ok" and by_id["disk"].status == "ok"
    assert "no token needed" in by_id["hf-token"].message


def test_shared_memory_too_small_for_nccl_fails():
    by_id, _ = results(h200_probe(), (*TWO_GPU_PLAN, "runtime.shm_size=64m"), FakeDocker())
    assert by_id["shm"].status == "fail" and "NCCL" in by_id["shm"].message


@pytest.mark.docker
def test_ulimits_are_tried_for_real_with_the_engine(tmp_path):
    """doctor starts a throwaway container with the plan's ulimits: its verdict is the Docker
    Engine's own (this machine's engine refuses memlock=-1; a permissive one accepts it)."""
    import subprocess

    from m31ctl.runtime.engine_api import connect
    from tests.dockerlib import build_engine_images

    image = build_engine_images(connect())["ready"]
    truth = subprocess.run(
        ["docker", "run", "--rm", "--ulimit", "memlock=-1:-1", "--entrypoint", "/bin/true", image],
        capture_output=True,
        text=True,
    )
    result = run_cli(
        "doctor", "--hardware", "cpu", "--set", f"engine.image={image}", "--set", f"model.path={tmp_path}",
        "--set", 'runtime.ulimits={"memlock": -1}', "--json",
    )  # fmt: skip
    check = next(c for c in json.loads(result.stdout)["checks"] if c["id"] == "memlock")
    if truth.returncode == 0:
        assert check["status"] == "ok", check
    else:
        assert check["status"] == "fail" and "refuses the plan's ulimits" in check["message"], check
        assert "rlimit" in check["message"]


# doctor --deep: the engine and an all-reduce on the plan's GPUs.


def _deep_context(capture: dict, exit_code: int | None = 0):  # type: ignore[no-untyped-def,type-arg]
    from m31ctl.doctor.base import Context
    from m31ctl.plan import resolve

    probe = h200_probe()
    plan = resolve(PlanRequest(hardware=probe.hardware, sets=TWO_GPU_PLAN))
    ctx = Context(deployment=derive(plan), plan_error=None, probe=probe, env={}, deep="native")
    ctx.once("deep", lambda: {"exit_code": exit_code, "stderr": capture.pop("stderr", ""), **capture})
    return ctx


def test_doctor_deep_on_the_h200_host_recorded():
    """What `m31ctl doctor --deep --runtime native` printed on the lent 2x H200 (TP2 plan)."""
    report = json.loads((DEVICE / "doctor-deep-h200x2.json").read_text())
    checks = {c["id"]: c for c in report["checks"]}
    assert (
        checks["collective"]["status"] == "ok"
        and "nccl all-reduce over 2 ranks" in checks["collective"]["message"]
    )
    assert "288.3 GB/s" in checks["collective"]["message"]


def test_deep_checks_on_the_real_h200_capture():
    """What collective_check.py printed on the lent 2x H200 host (NCCL, 256 MiB): replayed
    through the checks that judge it."""
    from m31ctl.doctor.checks import collective, engine_image

    capture = json.loads((DEVICE / "collective-h200x2.json").read_text())
    no_vllm = engine_image(_deep_context(json.loads(json.dumps(capture))))
    assert no_vllm.status == "fail" and "cannot serve" in no_vllm.message  # that host has no vLLM
    capture["engine"]["vllm"] = "0.32.0"  # as in an engine image
    ctx = _deep_context(capture)
    engine = engine_image(ctx)
    assert engine.status == "ok" and "CUDA 13.0" in engine.message and "sm_90" in engine.message
    result = collective(ctx)
    assert result.status == "ok" and "nccl all-reduce over 2 ranks natively: 293.8 GB/s" in result.message


def test_deep_checks_fail_on_missing_kernels_and_a_hang():
    from m31ctl.doctor.checks import collective, engine_image

    capture = json.loads((DEVICE / "collective-h200x2.json").read_text())
    capture["engine"]["vllm"] = "0.32.0"
    capture["engine"]["arch_list"] = ["sm_80", "sm_100"]  # an image built without Hopper kernels
    for device in capture["engine"]["devices"]:
        device["kernels"] = False
    assert "no kernels for sm_90" in engine_image(_deep_context(capture)).message
    hung = _deep_context({"stderr": "NCCL WARN Call to ibv_reg_mr failed\n"}, exit_code=None)
    result = collective(hung)
    assert result.status == "fail" and "hung" in result.message and "NCCL WARN" in result.remedy


@pytest.mark.vllm
@pytest.mark.parametrize("runtime", ["native", pytest.param("docker", marks=pytest.mark.docker)])
def test_doctor_deep_runs_the_collective_for_real(runtime, vllm_py, tmp_path):
    """gloo over two processes with the rehearsal's own torch: natively, and in the rehearsal image
    with the container settings launch uses."""
    result = run_cli(
        "doctor", "--hardware", "cpu", "--deep", "--runtime", runtime, "--set", f"model.path={tmp_path}",
        "--set", f"runtime.native_python={vllm_py}", "--json",
    )  # fmt: skip
    checks = {c["id"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["engine-image"]["status"] == "ok" and "vLLM 0.32.0" in checks["engine-image"]["message"]
    assert checks["collective"]["status"] == "ok", checks["collective"]
    assert (
        "gloo all-reduce over 2 ranks" in checks["collective"]["message"]
        and "GB/s" in checks["collective"]["message"]
    )
    print(checks["collective"]["message"])


@pytest.mark.vllm
@pytest.mark.parametrize("runtime", ["native", pytest.param("docker", marks=pytest.mark.docker)])
def test_doctor_deep_reports_a_real_hung_collective(runtime, vllm_py, tmp_path):
    """A rank that never joins (collective_check.py's fault hook) hangs gloo's group setup for
    real; the check gives up at its bound, says so, and leaves no process or container behind."""
    import subprocess

    start = time.monotonic()
    result = run_cli(
        "doctor", "--hardware", "cpu", "--deep", "--runtime", runtime, "--set", f"model.path={tmp_path}",
        "--set", f"runtime.native_python={vllm_py}", "--set", "runtime.env.M31CTL_FAULT_DROP_RANK=1", "--json",
        env={"M31CTL_DEEP_TIMEOUT_S": "10"},
    )  # fmt: skip
    assert result.returncode == 1 and time.monotonic() - start < 60
    checks = {c["id"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["collective"]["status"] == "fail" and "hung past 10 s" in checks["collective"]["message"]
    assert checks["engine-image"]["status"] == "ok"  # the engine answered before the collective hung
    leftovers = subprocess.run(["pgrep", "-f", "collective_check.py"], capture_output=True, text=True).stdout
    assert leftovers.strip() == ""
