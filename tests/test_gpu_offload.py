"""The KV offload tier on the lent H200 with MiniMax-M3's own code path (issue 50), replayed from
tests/fixtures/gpu/h200-m3-offload-vllm026/ (its README says how it was taken): the Hopper recipe's
CPU tier (cache.cpu_offload_gib) on a small GPU cache against the same cache without it and the
whole GPU cache, one agentic workload, greedy. No GPU and no vLLM here: every figure is the
capture's, and m31ctl's own derivation and capacity model are held against it."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import pytest

CAPTURE = Path(__file__).parent / "fixtures" / "gpu" / "h200-m3-offload-vllm026"
CASES = ("tier", "small", "gpu")
SESSIONS = 6  # the workload's sessions: requests 0-5 are every session's first turn
DEVICE_MODEL = "/tmp/m31ctl-gpu-offload/model"
# scripts/device-gpu-offload's plan options, as run there
PLAN_SETS = (
    "engine.image=vllm/vllm-openai:v0.32.0",
    "parallelism.tensor=1",
    "cache.indexer_dtype=bf16",
    "serving.max_model_len=6144",
    "serving.gpu_memory_utilization=0.5",
    "cache.cpu_offload_gib=4",
)


def _replay(case: str) -> dict:
    return json.loads((CAPTURE / f"replay-{case}.json").read_text())


def _log(case: str) -> str:
    return (CAPTURE / f"engine-{case}.log").read_text()


def _by_source(case: str) -> dict[str, float]:
    counters = _replay(case)["counters"]
    prefix = "vllm:prompt_tokens_by_source_total:"
    return {k.removeprefix(prefix): v for k, v in counters.items() if k.startswith(prefix)}


def _answers(case: str) -> list[list[int]]:
    return [a["token_ids"] for a in _replay(case)["answers"]]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """The capture's plan derived here, on the capture's checkpoint config (no weights)."""
    from m31ctl.deployment import derive
    from m31ctl.hardware import simulated
    from m31ctl.plan import PlanRequest, resolve

    model = tmp_path_factory.mktemp("tiny-m3")
    (model / "config.json").write_text((CAPTURE / "model-config.json").read_text())
    sets = (*PLAN_SETS, f"model.path={model}")
    return derive(resolve(PlanRequest(hardware=simulated("h200x1"), recipe="hopper", sets=sets))), model


def test_the_capture_ran_m3s_own_code_on_vllm_026_on_an_h200():
    versions = (CAPTURE / "versions.txt").read_text()
    assert "NVIDIA H200" in versions and "2.11.0+cu130 0.26.0" in versions
    for case in CASES:
        log = _log(case)
        assert "MiniMax M3 indexer: selected Triton" in log and "indexer_kv_dtype=bf16" in log
        assert "Traceback" not in log
    assert all("with num_gpu_blocks_override=48" in _log(case) for case in ("tier", "small"))
    assert "GPU KV cache size: 8,286,080 tokens" in _log("gpu")
    assert "Creating offloading spec with name: CPUOffloadingSpec" in _log("tier")
    assert all("OffloadingConnector" not in _log(case) for case in ("small", "gpu"))


def test_the_tier_case_ran_m31ctls_own_argv_for_the_plan(deployment):
    """device_offload.py's argv is the adapter's for the plan (the native runtime's command), with
    only what the README names changed: the main cache's dtype and the GPU blocks."""
    from m31ctl.runtime.native import command

    derived, model = deployment
    ours = [DEVICE_MODEL if word == str(model) else word for word in command(derived)[1:]]
    ran = json.loads((CAPTURE / "argv-tier.json").read_text())[1:]
    ours[ours.index("--kv-cache-dtype") + 1] = "auto"
    assert ran == [*ours, "--num-gpu-blocks-override", "48"]
    at = ran.index("--kv-offloading-backend")
    assert ran[at : at + 4] == ["--kv-offloading-backend", "native", "--kv-offloading-size", "4"]


def test_the_tier_serves_from_host_memory_what_the_small_gpu_cache_evicted():
    tier, small, gpu = (_by_source(case) for case in CASES)
    # With the tier, exactly the tokens the whole GPU cache computes are computed: every prefix
    # the 48 blocks evicted came back from the CPU ...
    assert tier["local_compute"] == gpu["local_compute"] == 14_580
    assert tier["local_cache_hit"] + tier["external_kv_transfer"] == gpu["local_cache_hit"] == 118_144
    # ... and without it those same tokens are computed again.
    assert small["external_kv_transfer"] == 0
    assert small["local_compute"] == tier["local_compute"] + tier["external_kv_transfer"] == 32_372


def test_the_hit_rate_and_ttft_with_the_tier_and_without():
    def hit_rate(case: str) -> float:
        c = _replay(case)["counters"]
        hits = c["vllm:prefix_cache_hits_total"] + c["vllm:external_prefix_cache_hits_total"]
        return hits / c["vllm:prefix_cache_queries_total"]

    def later_ttft_ms(case: str) -> float:  # turns 2-6: the requests a session's prefix serves
        return statistics.median(a["ttft_s"] for a in _replay(case)["answers"][SESSIONS:]) * 1000

    assert round(hit_rate("tier"), 3) == round(hit_rate("gpu"), 3) == 0.890
    assert round(hit_rate("small"), 3) == 0.756
    assert later_ttft_ms("tier") < 0.7 * later_ttft_ms("small")  # 26.2 ms against 43.5 ms
    assert abs(later_ttft_ms("tier") - later_ttft_ms("gpu")) < 2  # 26.2 ms against 27.0 ms


def test_prefixes_restored_from_the_tier_give_the_whole_gpu_caches_answers():
    """Greedy answers of random weights are a fingerprint of the KV attended to. Past the sparse
    window (16 blocks of 128 tokens: every prompt here is 3,000-4,500 tokens) a restored block whose
    index keys were lost or stale would change the blocks the indexer selects, and so the answer."""
    tier, small, gpu = (_answers(case) for case in CASES)
    later = range(SESSIONS, len(gpu))
    assert len(gpu) == 36 and all(len(a) == 16 for a in gpu)
    assert all(tier[i] == gpu[i] for i in later)
    assert sum(small[i] != gpu[i] for i in later) == 20  # computed again: not the same KV bytes
    # The first turns' differences come with the 48-block cache, with or without the tier.
    assert [i for i in range(SESSIONS) if tier[i] != gpu[i]] == [1, 2, 3]
    assert tier[1] == small[1] and tier[2] == small[2]


def test_the_tier_stores_the_index_cache_with_the_main_cache_as_capacity_counts_it(deployment):
    """vLLM's own counters: bytes stored per block over the block's tokens is the GPU pool's cost of a
    token, main plus indexer, which capacity's host tier counts (m31ctl/capacity/host_tier.py)."""
    from m31ctl.capacity.fit import memory_inputs, plan_layout
    from m31ctl.capacity.memory import token_bytes

    metrics = re.search(r"KV Transfer metrics: (.*)", _log("tier"))
    assert metrics is not None
    values = dict(pair.split("=") for pair in metrics.group(1).split(", "))
    blocks = int(values["vllm:kv_offload_cpu_allocation_size_sum"])
    per_token = int(values["vllm:kv_offload_store_bytes"]) / blocks / 128
    assert (blocks, per_token) == (27, 8_960)
    derived, _ = deployment
    ours = token_bytes(memory_inputs(derived, kv_dtype="bf16"), plan_layout(derived))
    assert (ours.main_attention, ours.indexer) == (4 * 2 * 4 * 128 * 2, 3 * 128 * 2)
    assert ours.total == per_token
