"""The prefix cache's host tier (cache.cpu_offload_gib, issue 50): what vLLM 0.32's native KV
offloading holds (tokens and prefixes, main + indexer bytes a token, per engine), where its memory
lives (CUDA: one /dev/shm region per engine; ROCm: each rank's share), the plan-time refusals
(the host memory a --hardware spec declares: exit 6; a private /dev/shm smaller than the CUDA
tier: exit 2) and doctor's finding on a host read from a fake /proc/meminfo."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from m31ctl.capacity.host_tier import host_memory_need, host_tier, largest_tier_gib, size_text
from m31ctl.checks import CheckStatus
from m31ctl.commands import deployment
from m31ctl.deployment import Deployment, derive
from m31ctl.doctor.base import CheckContext, run_checks
from m31ctl.doctor.checks import get_check
from m31ctl.doctor.checks import model as model_checks
from m31ctl.errors import ExitCode, HostPreconditionError, InputError
from m31ctl.hardware import hardware_spec, simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.probe import NO_GPU, ProbeReport
from m31ctl.runtime.gates import CheckId
from tests.support import cli_json

GIB = 1024**3
TIB = 1024 * GIB
CTX_256K = 262144
DEP8 = ("parallelism.tensor=1", "parallelism.data=8")


def derived(hw: str, *sets: str) -> Deployment:
    return derive(resolve(PlanRequest(hardware=simulated(hw), sets=sets)))


def test_the_tier_is_per_engine_split_over_its_ranks_and_holds_main_and_indexer_bytes():
    """b300x8's TP4 plan, 512 GiB: vLLM's chunk is 4 ranks x 128 tokens x 12,960 bytes (a page
    multiple), 82,850 of them in 512 GiB: 10,604,800 tokens, 40 prefixes of 256K; 128 GiB a rank,
    the engine's one /dev/shm region of 512 GiB on the host."""
    tier = host_tier(derived("b300x8", "cache.cpu_offload_gib=512"), CTX_256K)
    assert tier is not None
    assert (tier.bytes_per_token.main_attention, tier.bytes_per_token.indexer) == (8640, 4320)
    chunk = 4 * 128 * 12960
    assert chunk % 4096 == 0 and tier.tokens_per_engine == 512 * GIB // chunk * 128 == 10_604_800
    assert tier.prefixes_per_engine == 40 and tier.engine_ranks == 4 and tier.engines == 1
    assert (tier.bytes_per_rank, tier.bytes_per_host, tier.in_shm) == (128 * GIB, 512 * GIB, True)
    assert host_tier(derived("b300x8")) is None


def test_each_data_parallel_engine_has_its_own_tier_on_the_host():
    tier = host_tier(derived("b300x8", "cache.cpu_offload_gib=512", "parallelism.fill_host=true"))
    assert tier is not None and (tier.engines, tier.engines_per_host, tier.engine_ranks) == (2, 2, 4)
    assert tier.bytes_per_host == 1 * TIB
    assert tier.spelled() == "cache.cpu_offload_gib=512 x 2 engines = 1 TiB"


def test_rocm_pins_each_ranks_share_beside_the_private_shm():
    need = host_memory_need(derived("mi355xx8", "cache.cpu_offload_gib=1024", "parallelism.fill_host=true"))
    assert need is not None and not need.tier.in_shm
    assert need.tier.bytes_per_rank == 256 * GIB and need.tier.bytes_per_host == 2 * TIB
    assert need.total == 2 * TIB + 64 * GIB  # runtime.shm_size=64g beside the tier
    assert largest_tier_gib(need, 1 * TIB) == (1024 - 64) * 4 // 8


def test_a_declared_host_memory_refuses_a_tier_it_cannot_hold_in_one_line():
    request = PlanRequest(
        hardware=simulated("b300x8,host-memory=2t"),
        sets=(*DEP8, "cache.cpu_offload_gib=512", "runtime.ipc_host=true"),
    )
    with pytest.raises(HostPreconditionError) as refused:
        deployment(request, validate=False)
    line = refused.value.one_line()
    assert refused.value.exit_code == ExitCode.HOST_PRECONDITION == 6
    assert line.startswith("cache.cpu_offload_gib=512 x 8 engines = 4 TiB of host memory, the NVIDIA B300")
    assert "has 2 TiB" in line and "at most 256" in line and "\n" not in line
    fits = request._replace(sets=(*DEP8, "cache.cpu_offload_gib=256", "runtime.ipc_host=true"))
    assert deployment(fits, validate=False).plan.settings.cache.cpu_offload_gib == 256


def test_a_cuda_tier_larger_than_the_private_shm_is_refused_with_the_size_that_holds_it():
    """vLLM 0.32 keeps the CUDA tier in /dev/shm and refuses to start when /dev/shm has less free
    (check_shm_free_space), after the weights have loaded: the plan says so first."""
    request = PlanRequest(hardware=simulated("b300x8"), sets=("cache.cpu_offload_gib=512",))
    with pytest.raises(InputError) as refused:
        deployment(request, validate=False)
    assert refused.value.exit_code == ExitCode.BAD_INPUT
    assert "runtime.shm_size=576g" in refused.value.one_line()
    for fix in ("runtime.shm_size=576g", "runtime.ipc_host=true"):
        deployment(request._replace(sets=(*request.sets, fix)), validate=False)
    deployment(PlanRequest(hardware=simulated("mi355xx8"), sets=request.sets), validate=False)


def test_the_hardware_spec_declares_host_memory_and_says_it_again():
    hw = simulated("b300x8,host-memory=2t")
    assert hw.host_memory_bytes == 2 * TIB and hardware_spec(hw) == "b300x8,host-memory=2t"
    assert simulated("b300x8").host_memory_bytes is None and hardware_spec(simulated("b300x8")) == "b300x8"
    with pytest.raises(InputError, match="host-memory"):
        simulated("b300x8,host-memory=lots")
    assert size_text(1.5 * TIB) == "1.5 TiB" and size_text(576 * GIB) == "576 GiB"


def test_capacity_shows_the_tier_beside_the_gpus(cli):
    sets = ["--set", "cache.cpu_offload_gib=512", "--set", "runtime.shm_size=576g"]
    shown = cli("capacity", "--hardware", "b300x8", *sets, "--json")
    tier = cli_json.data(shown.stdout)["host_tier"]
    assert tier["tokens_per_engine"] == 10_604_800 and tier["prefixes_per_engine"] == 40
    assert tier["kv_bytes_per_token"] == {
        "per_gpu": True,
        "main_attention": 8640,
        "indexer": 4320,
        "total": 12960,
    }
    assert (tier["host_memory_per_rank_gib"], tier["host_memory_per_host_gib"], tier["in_dev_shm"]) == (
        128,
        512,
        True,
    )
    assert tier["gpu_kv_cache_tokens_per_engine"] == cli_json.data(shown.stdout)["fit"]["kv_cache_tokens"]
    text = cli("capacity", "--hardware", "b300x8", *sets).stdout
    assert (
        "host tier (cache.cpu_offload_gib=512 per engine" in text and "10,604,800 tokens per engine" in text
    )
    assert cli_json.data(cli("capacity", "--hardware", "b300x8", "--json").stdout)["host_tier"] is None


def fake_meminfo(root: Path, total_gib: int, available_gib: int) -> Path:
    (root / "proc").mkdir(parents=True)
    (root / "proc/meminfo").write_text(
        f"MemTotal:       {total_gib * 1024 * 1024} kB\nMemFree:        1024 kB\n"
        f"MemAvailable:   {available_gib * 1024 * 1024} kB\nShmem:          0 kB\n"
    )
    return root


def capacity_check(d: Deployment, root: Path, runtime: str | None = None):  # type: ignore[no-untyped-def]
    ctx = CheckContext(
        deployment=d, plan_error=None, probe=ProbeReport(NO_GPU, ()), env={}, host_root=root, runtime=runtime
    )
    (result,) = run_checks([get_check(CheckId.CAPACITY)], ctx)
    return result


# serving.max_num_seqs within what the GPUs hold: the check's capacity warning stays out of it.
FITS = "serving.max_num_seqs=32"
TIER_2X512 = ("cache.cpu_offload_gib=512", "parallelism.fill_host=true", "runtime.shm_size=1088g", FITS)


def test_doctor_fails_a_tier_beyond_the_hosts_memory(tmp_path):
    result = capacity_check(derived("b300x8", *TIER_2X512), fake_meminfo(tmp_path, 1000, 900))
    assert result.status == CheckStatus.FAIL
    assert "cache.cpu_offload_gib=512 x 2 engines = 1 TiB of host memory" in result.message
    assert "runtime.shm_size=1088g" in result.message and "1,000 GiB (MemTotal)" in result.message
    # 1,000 GiB less the 64 GiB /dev/shm beside the tier, over 2 engines
    assert result.remedy == "lower cache.cpu_offload_gib to at most 468 and runtime.shm_size with it"
    tiny = capacity_check(derived("b300x8", *TIER_2X512), fake_meminfo(tmp_path / "tiny", 24, 20))
    assert tiny.status == CheckStatus.FAIL and tiny.remedy == "lower runtime.shm_size"


def test_doctor_warns_when_other_processes_hold_the_memory_and_passes_otherwise(tmp_path):
    d = derived("b300x8", *TIER_2X512)
    warned = capacity_check(d, fake_meminfo(tmp_path / "busy", 2048, 1024))
    assert warned.status == CheckStatus.WARN and "MemAvailable" in warned.message
    ok = capacity_check(d, fake_meminfo(tmp_path / "idle", 2048, 2000))
    assert ok.status == CheckStatus.OK and "host tier: cache.cpu_offload_gib=512 x 2 engines" in ok.message
    assert "this host has 2 TiB" in ok.message


def test_doctor_checks_the_hosts_shm_when_the_tier_goes_there(tmp_path, monkeypatch):
    """Run natively, the CUDA tier goes to the host's own /dev/shm, whose free space vLLM checks."""
    root = fake_meminfo(tmp_path, 2048, 2000)
    (root / "dev/shm").mkdir(parents=True)
    d = derived("b300x8", "cache.cpu_offload_gib=512", "runtime.shm_size=576g", FITS)
    usage = shutil.disk_usage(root)
    monkeypatch.setattr(model_checks.shutil, "disk_usage", lambda _p: usage._replace(free=256 * GIB))
    result = capacity_check(d, root, runtime="native")
    assert result.status == CheckStatus.FAIL and "256 GiB free" in result.message
    monkeypatch.setattr(model_checks.shutil, "disk_usage", lambda _p: usage._replace(free=1 * TIB))
    assert capacity_check(d, root, runtime="native").status == CheckStatus.OK


def test_doctor_says_nothing_new_without_a_tier(tmp_path):
    result = capacity_check(derived("b300x8", FITS), fake_meminfo(tmp_path, 1, 1))
    assert result.status == CheckStatus.OK and "host tier" not in result.message
