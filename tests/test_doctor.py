"""Doctor: each check's logic on captured inputs, the runner's isolation, and real components."""

from __future__ import annotations

import json
import socket
import time

import pytest

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

    def __init__(self, runtimes: tuple[str, ...] = ("runc", "nvidia"), images: tuple[str, ...] = ()) -> None:
        self.runtimes = runtimes
        self.images = self
        self.present = images
        self.api = self

    def version(self) -> dict[str, str]:
        return {"Version": "28.2.2", "ApiVersion": "1.50"}

    def info(self) -> dict[str, object]:
        return {"Runtimes": {r: {} for r in self.runtimes}, "CDISpecDirs": []}

    def get(self, name: str):  # type: ignore[no-untyped-def]
        from docker.errors import ImageNotFound

        if name in self.present:
            return type("Image", (), {"short_id": "sha256:abc"})()
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

    ctx = Context(plan=None, plan_error=None, probe=ProbeReport(NO_GPU, ()), env={})
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
    assert [c["id"] for c in data["checks"]] == [c.id for c in all_checks()]
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
