"""Doctor: each check's logic on captured inputs, the runner's isolation, and real components."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket

import pytest

from m31ctl.doctor import diagnose
from m31ctl.doctor.base import Check, CheckContext, Outcome, run_checks
from m31ctl.doctor.checks import all_checks
from m31ctl.errors import DockerUnreachable
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest
from m31ctl.probe import NO_GPU, ProbeReport, detect
from m31ctl.probe.nvidia import NvmlProbe
from m31ctl.runtime.gates import CheckId
from tests.conftest import run_cli
from tests.fakes import GPU_FIXTURES, FakeNvml
from tests.ports import free_port
from tests.support import cli_json

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
    assert report.plan.recipe.recipe == "blackwell"
    assert probe.hardware.cuda_driver_version == "13.0"  # NVML's 13000, as the capture holds it
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


# --- issue 51: doctor's messages ------------------------------------------------------------------


def test_the_plans_own_max_num_seqs_is_what_the_engine_does_not_a_warning(tmp_path):
    """b300x4's 512 comes from the plan (a runtime rule over the defaults), not from the user: the
    finding says what vLLM does with more than fit, and warns only where the user set it."""
    by_id, report = results(h200_probe(), (PORT,), FakeDocker(), hardware="b300x4")
    assert report.plan is not None and report.plan.settings.serving.max_num_seqs == 512
    capacity = by_id["capacity"]
    assert capacity.status == "ok" and capacity.remedy == "", capacity
    assert "vLLM admits up to 512 sequences" in capacity.message and "preempts or queues" in capacity.message
    assert "the plan's default" in capacity.message and " but only " not in capacity.message
    by_id, _ = results(h200_probe(), (PORT, "serving.max_num_seqs=512"), FakeDocker(), hardware="b300x4")
    warned = by_id["capacity"]
    assert warned.status == "warn" and warned.message.startswith(
        "serving.max_num_seqs=512 (--set #2) but only"
    )
    assert "--set serving.max_num_seqs=" in warned.remedy
    mine = tmp_path / "mine.yaml"
    mine.write_text("serving:\n  max_num_seqs: 200\n")
    request = PlanRequest(hardware=simulated("b300x4"), files=(mine,), sets=(PORT,))
    report = diagnose(request, h200_probe(), lambda: FakeDocker())
    (from_file,) = [r for r in report.results if r.id == "capacity"]
    assert from_file.status == "warn" and f"({mine}:2)" in from_file.message


def _no_gpu_probe() -> ProbeReport:
    return detect([], env={})


def test_a_host_without_gpus_is_not_told_to_pass_the_hardware_it_passed():
    by_id, _ = results(_no_gpu_probe(), (PORT,), FakeDocker(), hardware="b300x4")
    remedy = by_id["gpus"].remedy
    assert by_id["gpus"].status == "fail" and "--hardware" not in remedy, remedy
    assert "not the b300x4 it was given" in remedy and "nvidia-smi" in remedy
    # A --hardware no recipe serves: no plan, and neither the first line nor a skipped check
    # says to pass --hardware again.
    by_id, report = results(_no_gpu_probe(), (PORT,), FakeDocker(), hardware="rtxpro6000x4")
    assert report.plan is None and report.plan_error is not None
    assert "pass --hardware" not in report.plan_error and "--hardware names one" in report.plan_error
    assert not any("pass --hardware" in r.remedy for r in report.results), [r.remedy for r in report.results]
    # Probed (no --hardware), the flag is still the way to plan for another host.
    by_id, _ = results(_no_gpu_probe(), (PORT,), FakeDocker())
    assert "pass --hardware" in by_id["gpus"].remedy


def test_shm_over_half_the_hosts_memory_says_the_memory_and_the_limit(monkeypatch):
    from m31ctl.doctor.checks import host

    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 24 * 2**30 // 4096}  # a 24 GiB host
    real = os.sysconf
    monkeypatch.setattr(host.os, "sysconf", lambda name: pages.get(name) or real(name))
    by_id, _ = results(h200_probe(), (*TWO_GPU_PLAN, "runtime.shm_size=64g"), FakeDocker())
    shm = by_id["shm"]
    assert shm.status == "warn" and shm.message == (
        "runtime.shm_size=64g is over half of this host's memory: the host has 24.0 GiB, so the limit "
        "is 12.0 GiB"
    ), shm.message
    assert shm.remedy == "lower it to the limit: --set runtime.shm_size=12g"


class UnreachableRegistry(FakeDocker):
    """docker-py's own error for a registry look-up the Engine could not make, as it reads on a
    host without DNS (500 from /distribution, the Engine's words in parentheses)."""

    def inspect_distribution(self, name: str) -> None:
        import requests
        from docker.errors import APIError

        response = requests.Response()
        response.status_code, response.reason = 500, "Internal Server Error"
        response.url = f"http+docker://localhost/v1.41/distribution/{name}/json"
        said = 'Get "https://registry-1.docker.io/v2/": dial tcp: lookup registry-1.docker.io on 10.0.0.53:53: no such host'
        raise APIError("500 Server Error", response=response, explanation=said)


def test_an_unreachable_registry_is_one_line_in_m31ctls_words():
    by_id, _ = results(h200_probe(), TWO_GPU_PLAN, UnreachableRegistry())
    image = by_id["image"]
    assert (
        image.status == "warn" and "http+docker" not in image.message and "Server Error" not in image.message
    )
    assert image.message == (
        "vllm/vllm-openai:minimax-m31-flash is not present locally, and its registry could not be asked: "
        "registry-1.docker.io does not resolve here (no DNS or network)"
    )
    assert "\n" not in image.message and "`docker load`" in image.remedy


@pytest.mark.parametrize(
    ("engine_said", "meaning", "remedy"),
    [
        ("manifest unknown: manifest unknown", "has no such image or tag", "engine.image's name and tag"),
        ("unauthorized: authentication required", "refused to say without credentials", "docker login"),
        (
            'Get "https://quay.io/v2/": net/http: TLS handshake timeout',
            "quay.io did not answer in time",
            "reachable",
        ),
        (
            "something new: the registry is on fire",
            "could not be asked: its registry: the registry is on fire",
            "reachable",
        ),
    ],
)
def test_a_registrys_refusal_is_said_by_what_it_means(engine_said, meaning, remedy):
    from m31ctl.doctor.checks.image import registry_said

    said, how = registry_said(
        f'500 Server Error for http+docker://localhost/x/json: Internal ("{engine_said}")'
    )
    assert meaning in said and remedy in how and "http+docker" not in said, (said, how)


def test_port_in_use_fails():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        by_id, _ = results(h200_probe(), ("parallelism.tensor=2", f"runtime.port={port}"), FakeDocker())
    assert by_id["port"].status == "fail" and str(port) in by_id["port"].message


def test_a_pd_groups_ports_are_all_checked():
    """A P/D group listens on more than its endpoint: a busy decode side channel fails the port
    check, naming the setting that moves it."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", free_port()))
        busy.listen()
        taken = busy.getsockname()[1]
        sets = ("disaggregation.enabled=true", f"disaggregation.decode.side_channel_port={taken}", PORT)
        by_id, _ = results(ProbeReport(NO_GPU, ()), sets, FakeDocker(), hardware="cpu")
    port = by_id["port"]
    assert port.status == "fail" and f"{taken} (disaggregation.decode.side_channel_port)" in port.message, (
        port
    )
    assert "--set disaggregation.decode.side_channel_port=" in port.remedy


def test_no_gpu_host_reports_without_crashing():
    probe = ProbeReport(NO_GPU, ())
    report = diagnose(None, probe, _no_docker)
    by_id = {r.id: r for r in report.results}
    assert report.plan is None and "no GPU" in (report.plan_error or "")
    assert by_id["gpus"].status == "fail" and by_id["docker"].status == "fail"
    assert by_id["disk"].status == "skip"


def test_a_raising_check_fails_alone_and_a_hanging_one_times_out():
    """No wall-clock bound (the machine may be loaded): the four checks meet at a barrier, which
    they pass only if they run at the same time, and the hanging check is still hanging (it waits
    for the test) when the runner returns its timeout."""
    import threading

    together = threading.Barrier(4)
    release = threading.Event()
    hang_finished = threading.Event()

    def boom(ctx: CheckContext) -> Outcome:
        raise RuntimeError("kaput")

    def hang(ctx: CheckContext) -> Outcome:
        release.wait(60)
        hang_finished.set()
        return Outcome("ok", "late")

    def meet(ctx: CheckContext) -> Outcome:
        together.wait(30)  # BrokenBarrierError (a fail) if the others never come
        return Outcome("ok", "fine")

    ctx = CheckContext(deployment=None, plan_error=None, probe=ProbeReport(NO_GPU, ()), env={})
    # Check ids are CheckId members: any six distinct ones stand for these.
    boom_id, hang_id, *meet_ids = (
        CheckId.DOCKER,
        CheckId.GPUS,
        CheckId.MIG,
        CheckId.DRIVER,
        CheckId.ROCM,
        CheckId.DISK,
    )
    checks = [Check(boom_id, "Boom", boom), Check(hang_id, "Hang", hang, timeout_s=0.5)] + [
        Check(meet_id, "Meet", meet, timeout_s=40) for meet_id in meet_ids
    ]
    try:
        out = {r.id: r for r in run_checks(checks, ctx)}
        assert not hang_finished.is_set()  # the runner did not wait for it
    finally:
        release.set()
    assert out["docker"].status == "fail" and "kaput" in out["docker"].message
    assert out["gpus"].status == "fail" and "no answer within 0.5 s" in out["gpus"].message
    assert all(out[meet_id.value].status == "ok" for meet_id in meet_ids), out


def test_json_is_stable_and_secret_free(cli):
    result = cli("doctor", "--hardware", "cpu", "--json", env={"HF_TOKEN": CANARY})
    assert CANARY not in result.stdout + result.stderr
    data = cli_json.data(result.stdout)
    assert set(data) == {"plan_hash", "recipe", "plan_error", "checks", "summary", "ok"}
    assert [c["id"] for c in data["checks"]] == [c.id for c in all_checks() if not c.deep and not c.locked]
    for check in data["checks"]:
        assert set(check) == {"id", "title", "status", "message", "remedy", "duration_s"}
    assert result.returncode == (0 if data["ok"] else 1)


@pytest.mark.docker
def test_against_this_machine(cli):
    """The real Docker Engine (.ci/run starts it), no GPU: docker passes, GPU checks say why."""
    cpu = cli("doctor", "--hardware", "cpu", "--json", "--set", PORT)
    data = {c["id"]: c for c in cli_json.data(cpu.stdout)["checks"]}
    assert data["docker"]["status"] == "ok" and "API" in data["docker"]["message"]
    assert data["gpus"]["status"] == "ok" and data["gpu-runtime"]["status"] == "ok"
    host = run_cli("doctor", "--json")
    checks = {c["id"]: c for c in cli_json.data(host.stdout)["checks"]}
    assert (
        host.returncode == 1
        and checks["gpus"]["status"] == "fail"
        and "no GPU found" in checks["gpus"]["message"]
    )
    assert checks["docker"]["status"] == "ok"
    gpu_plan = run_cli("doctor", "--hardware", "b300x4", "--json")
    checks = {c["id"]: c for c in cli_json.data(gpu_plan.stdout)["checks"]}
    assert checks["gpu-runtime"]["status"] == "fail" and checks["gpus"]["status"] == "fail"
    # Without GPUs the GPU checks answer at once rather than waiting out a probe (a hung one is
    # given 300 s): a bound far above a loaded host's few seconds, so speed decides nothing.
    assert sum(c["duration_s"] for c in checks.values()) < 120


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
    check = next(c for c in cli_json.data(result.stdout)["checks"] if c["id"] == "memlock")
    if truth.returncode == 0:
        assert check["status"] == "ok", check
    else:
        assert check["status"] == "fail" and "refuses the plan's ulimits" in check["message"], check
        assert "rlimit" in check["message"]


# doctor --deep: the engine and an all-reduce on the plan's GPUs.


class Replay:
    """A runtime whose engine scripts answer with what a real run printed (a capture): the deep
    checks read and judge it exactly as they would a live run's."""

    def __init__(
        self,
        stdout: str | dict[str, str],
        exit_code: int | None = 0,
        stderr: str = "",
        raises: Exception | None = None,
    ) -> None:
        # One output for every script, or one per script name (collective_check.py, config_check.py).
        self.stdout, self.exit_code, self.stderr, self.raises = stdout, exit_code, stderr, raises
        self.calls: list[tuple[str, list[str], dict[str, str]]] = []

    def run_engine_script(self, deployment, script, args, timeout, env=None):  # type: ignore[no-untyped-def]
        from m31ctl.runtime.protocol import ScriptRun

        self.calls.append((script.name, list(args), dict(env or {})))
        if self.raises is not None:
            raise self.raises
        out = self.stdout if isinstance(self.stdout, str) else self.stdout.get(script.name, "")
        return ScriptRun(self.exit_code, out, self.stderr, 6.6, "natively")


H200_COLLECTIVE = (DEVICE / "collective-h200x2.json").read_text()


def _with_vllm(capture: str, **engine: object) -> str:
    """The H200 capture as an engine image would print it (that host had torch, not vLLM)."""
    lines = [json.loads(line) for line in capture.splitlines() if line.strip()]
    lines[0]["engine"].update({"vllm": "0.32.0", **engine})
    return "\n".join(json.dumps(line) for line in lines) + "\n"


def deep_results(replay: Replay, sets: tuple[str, ...] = TWO_GPU_PLAN):  # type: ignore[no-untyped-def]
    report = diagnose(
        PlanRequest(hardware=h200_probe().hardware, sets=sets), h200_probe(), _no_docker, "native", replay
    )
    return {r.id: r for r in report.results}, report


def test_deep_checks_on_the_real_h200_capture():
    """What collective_check.py printed on the lent 2x H200 host (NCCL, 256 MiB), read and
    judged as a live run is; the probe is asked for the plan's TP group from the vendor row."""
    replay = Replay(H200_COLLECTIVE)
    by_id, _ = deep_results(replay)
    # engine-config never asks: the checkpoint is not cached here, and doctor never downloads.
    assert replay.calls == [
        ("collective_check.py", ["--world", "2", "--backend", "nccl", "--mib", "256", "--bound", "180"], {})
    ]
    assert by_id["engine-config"].status == "skip" and "never downloads" in by_id["engine-config"].message
    no_vllm = by_id["engine-image"]
    assert (
        no_vllm.status == "fail"
        and "cannot serve (ModuleNotFoundError: No module named 'vllm')" in no_vllm.message
    )
    collective = by_id["collective"]
    assert collective.status == "ok", collective
    assert collective.message == (
        "nccl all-reduce over 2 ranks natively: 293.8 GB/s bus bandwidth (256 MiB, init 0.607 s)"
    )
    by_id, _ = deep_results(Replay(_with_vllm(H200_COLLECTIVE)))
    engine = by_id["engine-image"]
    assert engine.status == "ok", engine
    assert engine.message == (
        "torch 2.11.0+cu130, vLLM 0.32.0, CUDA 13.0; 2 GPUs (sm_90) initialise with kernels"
    )


def test_doctor_deep_json_matches_the_report_recorded_on_the_h200(tmp_path):
    """`doctor --deep --runtime native --json` as recorded on the lent 2x H200, against this
    code on that host's captures (NVML, the collective's output): the same keys, the same
    checks, and the same findings for every check that depends only on what was captured."""
    recorded = cli_json.captured((DEVICE / "doctor-deep-h200x2.json").read_text())
    sets = ("parallelism.tensor=2", "serving.max_model_len=8192", f"runtime.hf_cache={tmp_path}", PORT)
    _by_id, report = deep_results(Replay(H200_COLLECTIVE), sets)
    from m31ctl.doctor import report_json

    now = json.loads(json.dumps(report_json(report)))
    assert set(now) == set(recorded)
    # The same checks in the same order; engine-config (the engine's dry run) came after the recording.
    assert [c["id"] for c in now["checks"] if c["id"] != "engine-config"] == [
        c["id"] for c in recorded["checks"]
    ]
    assert all(set(c) == set(recorded["checks"][0]) for c in now["checks"])
    then = {c["id"]: c for c in recorded["checks"]}
    ours = {c["id"]: c for c in now["checks"]}
    captured_only = ("gpus", "gpu-memory", "mig", "driver", "rocm", "checkpoint", "api-key")
    # The capacity verdict was captured; its KV token count moved with M3.1's own geometry (issue 35).
    assert ours["capacity"]["status"] == then["capacity"]["status"]
    assert ours["capacity"]["message"].split(" (")[0] == then["capacity"]["message"].split(" (")[0]
    for check in captured_only:
        assert (ours[check]["status"], ours[check]["message"], ours[check]["remedy"]) == (
            then[check]["status"],
            then[check]["message"],
            then[check]["remedy"],
        ), check
    for check in ("gpu-runtime", "memlock", "image", "engine"):  # no Docker Engine there
        assert ours[check]["status"] == then[check]["status"], check
    # The native runtime needs no Docker Engine: the docker check no longer fails it (issue 37).
    assert (then["docker"]["status"], ours["docker"]["status"]) == ("fail", "skip")
    # Its own run measured 288.3 GB/s; the replayed capture is another run of the same check.
    shape = r"nccl all-reduce over 2 ranks natively: [\d.]+ GB/s bus bandwidth \(256 MiB, init [\d.]+ s\)"
    assert re.fullmatch(shape, then["collective"]["message"])
    assert re.fullmatch(shape, ours["collective"]["message"])
    # Recorded before engine-image failed a Python without vLLM (that host had none): now it does.
    assert then["engine-image"]["status"] == "ok" and ours["engine-image"]["status"] == "fail"


REHEARSAL = GPU_FIXTURES / "h200-vllm026"
NOT_FOR_NATIVE = "the native runtime runs the engine as a process of this host, without Docker"


def _rehearsal_doctor(model_dir, docker):  # type: ignore[no-untyped-def]
    """`doctor --deep --runtime native` as run on the lent H200 (tests/fixtures/gpu/h200-vllm026):
    its NVML capture, the bf16-u0.1 plan, and the deep scripts' answers replayed."""
    probe = detect([NvmlProbe(FakeNvml(json.loads((REHEARSAL / "nvml.json").read_text())))], env={})
    sets = (
        f"model.path={model_dir}", "engine.image=vllm/vllm-openai:v0.26.0", "serving.max_model_len=1024",
        "serving.max_num_seqs=16", "serving.gpu_memory_utilization=0.1", PORT,
    )  # fmt: skip
    replay = Replay(
        {
            "collective_check.py": _with_vllm((DEVICE / "collective-h200x1.json").read_text(), vllm="0.26.0"),
            "config_check.py": (ENGINE_CONFIG / "ok-tp1.json").read_text(),
        }
    )
    request = PlanRequest(hardware=probe.hardware, recipe="cpu", sets=sets)
    report = diagnose(request, probe, docker, "native", replay)
    assert report.plan is not None, report.plan_error
    return {r.id: r for r in report.results}, report


@pytest.fixture
def rehearsal_model(tmp_path):  # type: ignore[no-untyped-def]
    """The tiny model as the H200 had it: its config.json (kept in the capture) and one shard
    (its 3 MB of weights are not kept; the checkpoint check reads only that it is there and not near-empty)."""
    (tmp_path / "config.json").write_text((REHEARSAL / "model-config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(bytes(4096))
    return tmp_path


def test_a_native_doctor_needs_no_docker_engine(rehearsal_model):
    """On the H200 `doctor --deep --runtime native` exited 1 with the docker check its one failure
    (the host has no Docker Engine; exits.txt, doctor-deep-bf16-u0.1.json). The native runtime
    runs vLLM as a process: the checks only a container needs skip, saying why, and nothing fails."""
    recorded = cli_json.captured((REHEARSAL / "doctor-deep-bf16-u0.1.json").read_text())
    assert [c["id"] for c in recorded["checks"] if c["status"] == "fail"] == ["docker"]
    by_id, report = _rehearsal_doctor(rehearsal_model, _no_docker)
    assert not report.failed, [(r.id, r.message) for r in report.results if r.failed]
    assert by_id["docker"].status == "skip" and by_id["docker"].message == NOT_FOR_NATIVE
    assert by_id["gpu-runtime"].status == "skip" and by_id["gpu-runtime"].message.startswith(NOT_FOR_NATIVE)
    assert by_id["shm"].message.startswith("the host's /dev/shm (no container)")
    assert [c["id"] for c in recorded["checks"]] == list(by_id)  # the same checks, in the same order
    for check in ("gpus", "mig", "driver", "rocm"):  # from the NVML capture alone: as recorded there
        then = next(c for c in recorded["checks"] if c["id"] == check)
        assert (by_id[check].status, by_id[check].message) == (then["status"], then["message"])
    # A daemon that is there but has no NVIDIA runtime does not fail a native plan either.
    by_id, report = _rehearsal_doctor(rehearsal_model, lambda: FakeDocker(runtimes=("runc",)))
    assert not report.failed and by_id["gpu-runtime"].status == "skip"
    # Without a runtime named, doctor checks for docker's (the docker runtime's preflight) ...
    request = PlanRequest(hardware=simulated("h200x2"), sets=TWO_GPU_PLAN)
    plain = diagnose(request, h200_probe(), _no_docker)
    assert {r.id: r for r in plain.results}["docker"].status == "fail"
    # ... and `doctor --runtime native` without --deep checks for the native runtime: no Docker.
    native = {r.id: r for r in diagnose(request, h200_probe(), _no_docker, runtime="native").results}
    assert native["docker"].status == "skip" and native["docker"].message == NOT_FOR_NATIVE


def test_a_native_doctor_skips_the_container_ulimits_trial():
    """runtime.ulimits are a container's (memlock tries them in one); a native process inherits
    this shell's limits, so the trial is skipped rather than run on a Docker Engine it never uses."""
    docker = FakeDocker(runtimes=("runc",))
    by_id, _ = deep_results(Replay(_with_vllm(H200_COLLECTIVE)))
    assert by_id["memlock"].status == "skip" and by_id["memlock"].message.startswith(NOT_FOR_NATIVE)
    assert "locked memory" in by_id["memlock"].message
    by_id, _ = results(h200_probe(), TWO_GPU_PLAN, docker)  # the docker runtime goes on to the trial
    assert "is not here to try the ulimits with" in by_id["memlock"].message


def test_deep_checks_fail_on_missing_kernels_a_hang_and_garbage():
    """The capture changed as an image without Hopper kernels, a rank that never joined, and
    output that is not the probe's (wrong types, no report): each fails with its reason."""
    lines = [json.loads(line) for line in _with_vllm(H200_COLLECTIVE).splitlines()]
    lines[0]["engine"]["arch_list"] = ["sm_80", "sm_100"]  # an image built without Hopper kernels
    for device in lines[0]["engine"]["devices"]:
        device["kernels"] = False
    by_id, _ = deep_results(Replay("\n".join(json.dumps(line) for line in lines)))
    assert by_id["engine-image"].status == "fail" and "no kernels for sm_90" in by_id["engine-image"].message
    engine_line = _with_vllm(H200_COLLECTIVE).splitlines()[0] + "\n"
    # What collective_check.py prints when it kills a collective at its bound (rank 1 never joined).
    killed = {"backend": "nccl", "world": 2, "exit_codes": [-9, -9], "ranks_started": 2, "timed_out": True}
    killed_line = json.dumps({"collective": {**killed, "hung_ranks": [0, 1], "bound_s": 180.0}})
    hung = Replay(engine_line + killed_line, exit_code=0, stderr="NCCL WARN Call to ibv_reg_mr failed\n")
    by_id, _ = deep_results(hung)
    assert by_id["engine-image"].status == "ok"  # the engine reported before the collective hung
    result = by_id["collective"]
    assert result.status == "fail" and "natively hung past 180 s" in result.message
    assert "NCCL WARN" in result.remedy
    # Killed from outside (its start-up never ended): not called a hang of the all-reduce.
    by_id, _ = deep_results(Replay(engine_line, exit_code=None))
    result = by_id["collective"]
    assert result.status == "fail" and "hung" not in result.message, result
    assert "did not finish in 7 s: the engine's Python or a rank never finished starting" in result.message
    garbage = (
        '{"engine": {"torch": 2, "device_count": "two", "devices": [5]}}\n{"collective": []}\nnot json\n'
    )
    by_id, _ = deep_results(Replay(garbage, exit_code=1, stderr="Traceback ...\nRuntimeError: boom\n"))
    assert by_id["engine-image"].status == "fail" and "vLLM None" in by_id["engine-image"].message
    assert by_id["collective"].status == "fail" and "failed (exit 1)" in by_id["collective"].message


def test_deep_checks_skip_when_the_runtime_has_no_engine_to_ask():
    from m31ctl.runtime.protocol import ScriptUnavailable

    absent = ScriptUnavailable(
        "m31ctl/vllm-cpu:0.32.0 is not here to run collective_check.py in", hint="pull it"
    )
    by_id, _ = deep_results(Replay("", raises=absent))
    for check in ("engine-image", "collective"):
        assert by_id[check].status == "skip" and "is not here" in by_id[check].message
        assert by_id[check].remedy == "pull it"
    by_id, _ = deep_results(Replay("", raises=DockerUnreachable("cannot reach the Docker Engine")))
    assert by_id["collective"].status == "skip" and "needs the Docker Engine" in by_id["collective"].message


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["native", pytest.param("docker", marks=pytest.mark.docker)])
def test_doctor_deep_runs_the_collective_for_real(runtime, vllm_py, tiny_model):
    """gloo over two processes with the rehearsal's own torch, and vLLM's own configuration built
    from the plan's argv (TP 2, a good layout: vLLM resolves it and says so): natively, and in the
    rehearsal image with the container settings launch uses. One deep run per runtime proves both
    (each costs an import of vLLM and of torch twice over)."""
    result = run_cli(
        "doctor", "--hardware", "cpu", "--deep", "--runtime", runtime, "--set", f"model.path={tiny_model}",
        "--set", f"runtime.native_python={vllm_py}", *TP2_ON_TWO_CORES, "--json",
    )  # fmt: skip
    checks = {c["id"]: c for c in cli_json.data(result.stdout)["checks"]}
    assert checks["engine-image"]["status"] == "ok" and "vLLM 0.32.0" in checks["engine-image"]["message"]
    config = checks["engine-config"]
    assert config["status"] == "ok", config
    assert "vLLM 0.32.0 (cpu) builds the plan's configuration" in config["message"]
    assert "TP 2, DCP 1" in config["message"] and "max_model_len 2048" in config["message"]
    assert checks["collective"]["status"] == "ok", checks["collective"]
    assert (
        "gloo all-reduce over 2 ranks" in checks["collective"]["message"]
        and "GB/s" in checks["collective"]["message"]
    )
    print(checks["collective"]["message"])


# TP 2 on the CPU build: vLLM binds one core to each rank (it refuses two ranks on one NUMA node
# without it).
TP2_ON_TWO_CORES = ("--set", "parallelism.tensor=2", "--set", "runtime.env.VLLM_CPU_OMP_THREADS_BIND=0|1")


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["native", pytest.param("docker", marks=pytest.mark.docker)])
def test_doctor_deep_reports_a_real_hung_collective(runtime, vllm_py, tmp_path):
    """A rank that never joins (collective_check.py's fault hook) hangs gloo's group setup for
    real; the check gives up at its bound, says so, and leaves no process or container behind.
    What it started is found by a marker in its environment, which only this run's processes
    (and the ranks they spawn) carry: other jobs on this machine may run the same script.

    The outcome may not depend on this machine's speed: in Docker, every container start and
    removal is held 8 s by a slow engine in front of the real one (a fresh, busy daemon took
    that long once and the check read it as an unreachable engine: skip), and the bound counts
    from the ranks' start, not the engine's imports (22 s on an idle 2-core host). The dropped
    rank never joins, so the bound is waited out in full, whatever it is: 5 s proves what the
    180 s a user gets would (its 30 s dates from when the bound still counted the imports)."""
    import uuid

    from tests.slow_docker import SlowDocker

    marker = f"doctor-hang-{uuid.uuid4().hex}"
    env = {"M31CTL_DEEP_TIMEOUT_S": "5"}
    slow = SlowDocker(rb"POST /v[\d.]+/containers/\w+/start|DELETE /v[\d.]+/containers/\w+", 8)
    with slow if runtime == "docker" else contextlib.nullcontext():
        if runtime == "docker":
            env["DOCKER_HOST"] = slow.url
        result = run_cli(
            "doctor", "--hardware", "cpu", "--deep", "--runtime", runtime, "--set", f"model.path={tmp_path}",
            "--set", f"runtime.native_python={vllm_py}", "--set", "runtime.env.M31CTL_FAULT_DROP_RANK=1",
            "--set", f"runtime.env.M31CTL_TEST_MARKER={marker}", "--json",
            env=env,
        )  # fmt: skip
    if runtime == "docker":
        assert any(line.endswith("/start") for line in slow.held), slow.held  # the slow engine held them
    assert result.returncode == 1, result.stderr
    checks = {c["id"]: c for c in cli_json.data(result.stdout)["checks"]}
    assert checks["collective"]["status"] == "fail" and "hung past 5 s" in checks["collective"]["message"]
    assert checks["engine-image"]["status"] == "ok"  # the engine answered before the collective hung
    assert _processes_with(marker) == []
    if runtime == "docker":
        from m31ctl.runtime.engine_api import connect

        containers = connect().containers.list(all=True)
        assert [
            c.name for c in containers if f"M31CTL_TEST_MARKER={marker}" in (c.attrs["Config"]["Env"] or [])
        ] == []


@pytest.mark.vllm
@pytest.mark.slow
def test_the_collective_bound_counts_from_the_ranks_start_not_the_machines_speed(vllm_py):
    """Every rank starts 15 s late (the fault hook: a slow, busy machine importing torch) and the
    bound is 10 s: gloo's group and all-reduce still finish and are reported, because the bound
    counts from the moment every rank has started. Before, one timeout covered the imports too."""
    import subprocess

    from tests.conftest import ROOT

    script = ROOT / "m31ctl" / "engine" / "collective_check.py"
    call = f"import sys; sys.path.insert(0, {str(script.parent)!r}); import collective_check as c, json; "
    call += "print(json.dumps(c.collective(2, 'gloo', 1, 10.0)))"
    done = subprocess.run(
        [vllm_py, "-c", call],
        env={"PATH": "/usr/bin:/bin", "M31CTL_FAULT_SLOW_START_S": "15"},
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["timed_out"] is False and found["exit_codes"] == [0, 0] and found["correct"] is True, found
    assert found["ranks_started"] == 2 and found["total_s"] > 15


def _processes_with(marker: str) -> list[int]:
    """Live processes whose environment holds `marker` (a container's processes are host
    processes too, so this sees inside the engine image as well)."""
    from pathlib import Path

    found = []
    needle = marker.encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if needle in environ:
            found.append(int(proc.name))
    return found


# doctor --deep engine-config: vLLM builds its configuration from the plan's argv.

ENGINE_CONFIG = GPU_FIXTURES.parent / "engine-config"


def _cpu_config_results(model_dir, replay: Replay, *sets: str):  # type: ignore[no-untyped-def]
    request = PlanRequest(hardware=simulated("cpu"), sets=(f"model.path={model_dir}", PORT, *sets))
    report = diagnose(request, ProbeReport(NO_GPU, ()), _no_docker, "native", replay)
    assert report.plan is not None, report.plan_error
    return {r.id: r for r in report.results}, report


@pytest.fixture
def model_config_dir(tmp_path):  # type: ignore[no-untyped-def]
    """The tiny rehearsal model's config.json (the only file vLLM reads to build its configuration)."""
    from m31ctl.rehearsal.make_tiny_model import CONFIG

    (tmp_path / "config.json").write_text(
        json.dumps({**CONFIG, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    return tmp_path


def test_engine_config_quotes_vllms_refusal_captured_from_real_vllm():
    """vLLM 0.32's own refusal of DCP 2 with TP 2 over 4 KV heads (captured from config_check.py,
    a pydantic ValidationError around vLLM's sentence): quoted verbatim, with the setting to fix."""
    from m31ctl.doctor.checks.engine_config import judge_engine_config, likely_fix
    from m31ctl.runtime.protocol import ScriptRun

    refusal = (ENGINE_CONFIG / "refused-tp2-dcp2.json").read_text()
    outcome = judge_engine_config(ScriptRun(1, "INFO ...\n" + refusal, "", 12.0, "natively"), 300)
    words = (
        "Decode context parallelism for GQA/MQA requires `--tensor-parallel-size` (2) to be greater than "
        "the model's total number of KV heads (4). Increase `--tensor-parallel-size` or set "
        "`--decode-context-parallel-size 1`."
    )
    assert outcome.status == "fail"
    assert outcome.message == f"vLLM 0.32.0 refuses the plan's configuration natively: {words}"
    assert outcome.remedy.startswith("change parallelism.decode_context (or parallelism.tensor)")
    seqs = "max_num_batched_tokens (2048) must be greater than or equal to max_num_seqs (4096)."
    assert likely_fix(seqs).startswith("change serving.max_num_seqs")
    assert likely_fix(seqs, ("-O0", "--max-num-batched-tokens", "2048")) == (
        "engine.extra_args passes --max-num-batched-tokens: change or drop it"
    )


def test_engine_config_asks_with_the_plans_argv_offline(model_config_dir):
    replay = Replay({"config_check.py": (ENGINE_CONFIG / "ok-tp1.json").read_text()})
    _by_id, report = _cpu_config_results(model_config_dir, replay)
    from m31ctl.deployment import derive
    from m31ctl.engine.adapter import build_invocation

    (call,) = [c for c in replay.calls if c[0] == "config_check.py"]
    assert call[1] == ["--", *build_invocation(derive(report.plan)).args]
    assert call[2] == {"HF_HUB_OFFLINE": "1"}


def test_engine_config_reports_what_vllm_resolved_and_a_likely_fix(model_config_dir):
    ok = (ENGINE_CONFIG / "ok-tp1.json").read_text()
    by_id, _ = _cpu_config_results(model_config_dir, Replay({"config_check.py": ok}))
    assert by_id["engine-config"].status == "ok"
    assert by_id["engine-config"].message == (
        "vLLM 0.32.0 (cpu) builds the plan's configuration natively: TP 1, DCP 1, max_model_len 2048, "
        "dtype bfloat16, KV cache auto, block size 128, attention CPU_ATTN"
    )
    from m31ctl.doctor.checks.engine_config import judge_engine_config
    from m31ctl.runtime.protocol import ScriptRun

    too_long = (ENGINE_CONFIG / "refused-max-model-len.json").read_text()
    outcome = judge_engine_config(ScriptRun(1, too_long, "", 9.0, "in the engine image"), 300)
    assert outcome.status == "fail" and "User-specified max_model_len (4096) is greater" in outcome.message
    assert outcome.remedy.startswith("lower serving.max_model_len")
    hung = judge_engine_config(ScriptRun(None, "", "", 300.0, "natively"), 300)
    assert hung.status == "fail" and "within 300 s" in hung.message
    crashed = judge_engine_config(ScriptRun(-9, "INFO loading\n", "Killed\n", 3.0, "natively"), 300)
    assert crashed.status == "fail" and "gave no answer natively (exit -9): Killed" in crashed.message


def test_engine_config_skips_a_model_it_cannot_read_offline(tmp_path):
    """A hub model not in the plan's cache: vLLM would have to download its config.json."""
    replay = Replay({})
    by_id, _ = deep_results(replay, (*TWO_GPU_PLAN, f"runtime.hf_cache={tmp_path}"))
    check = by_id["engine-config"]
    assert check.status == "skip" and f"MiniMaxAI/MiniMax-M3.1-Flash in {tmp_path}" in check.message
    assert "config_check.py" not in [c[0] for c in replay.calls]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["native", pytest.param("docker", marks=pytest.mark.docker)])
def test_engine_config_reports_a_real_vllm_refusal(runtime, vllm_py, tiny_model):
    """Real vLLM 0.32 (the CPU build) builds its configuration from the plan's argv: TP 2 passes
    (test_doctor_deep_runs_the_collective_for_real),
    and more sequences than the batch holds tokens are refused in vLLM's own words. (DCP 2 on the
    model's 4 KV heads, vLLM's refusal in the unit test above, no longer reaches doctor: the plan
    refuses it first, by its mirror of that rule, and engine.extra_args may not set a flag that
    m31ctl owns. vLLM's batch-size rule has no mirror: this check is what catches it.)"""
    base = (
        "doctor", "--hardware", "cpu", "--deep", "--runtime", runtime, "--set", f"model.path={tiny_model}",
        "--set", f"runtime.native_python={vllm_py}", *TP2_ON_TWO_CORES, "--json",
    )  # fmt: skip
    refused = run_cli(*base, "--set", "serving.max_num_seqs=4096")
    checks = {c["id"]: c for c in cli_json.data(refused.stdout)["checks"]}
    check = checks["engine-config"]
    assert refused.returncode == 1 and check["status"] == "fail", check
    assert check["message"].startswith("vLLM 0.32.0 refuses the plan's configuration")
    assert (
        "max_num_batched_tokens (2048) must be greater than or equal to max_num_seqs (4096)"
        in check["message"]
    )
    assert check["remedy"].startswith("change serving.max_num_seqs")
    # The same layout without the refused value passes: test_doctor_deep_runs_the_collective_for_real.
