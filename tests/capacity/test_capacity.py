"""The memory model: what each rank allocates (as vLLM 0.32 does), and the launch post's
published-basis figures, which it still reproduces (76 and 28 on 4x B300, DEP4, 256K)."""

from __future__ import annotations

import json

import pytest

from m31ctl.capacity.fit import memory_inputs, plan_fit
from m31ctl.capacity.memory import Sharding, parse_context, resident_sequences, token_bytes
from m31ctl.deployment import derive
from m31ctl.errors import InputError
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.plan.catalog import get_model
from tests.support import cli_json

CTX_256K = 262144
DEP4 = Sharding(tensor=1, data=4, expert=True)


def plan_for(hw: str, **kw):  # type: ignore[no-untyped-def]
    return resolve(PlanRequest(hardware=simulated(hw), **kw))


def test_published_figures_on_4x_b300_dep4():
    plan = plan_for("b300x4", profile="throughput")
    fit = plan_fit(derive(plan), CTX_256K)
    assert fit.sequences_published_basis == 76
    m3 = resident_sequences(memory_inputs(derive(plan), get_model("minimax-m3-mxfp8"), "fp8"), DEP4, CTX_256K)
    assert m3.sequences_published_basis == 28
    # What the engine holds is at or below the published basis: the indexer cache comes on top.
    assert fit.sequences <= 76 and m3.sequences <= 28
    assert fit.kv_bytes_per_token.main_attention == 34560  # DEP: every rank holds all 4 KV heads
    # NVFP4 indexer keys on every layer: M3.1's sparse layer count is unpublished, 60 the bound
    assert fit.kv_bytes_per_token.indexer == 60 * 128 * 0.5625
    assert fit.sequences == 4 * int(fit.kv_budget_per_gpu_bytes // (CTX_256K * (34560 + 4320)))
    assert "unpublished for MiniMax-M3.1-Flash: sparse_layers=60" in fit.geometry.label()
    assert fit.geometry.unpublished == ("sparse_layers=60", "indexer_dim=128") and not fit.geometry.published
    assert m3.kv_bytes_per_token.indexer == 57 * 128 * 1  # M3-preview's own 57 sparse layers
    assert m3.geometry.name.startswith("MiniMax-M3-preview's") and m3.geometry.published
    assert (m3.geometry.model, m3.geometry.source) == ("MiniMax-M3 (MXFP8)", "recipes/models.yaml")


@pytest.mark.parametrize("reserve", [8, 10, 14])
def test_published_figures_hold_across_the_documented_reserve_band(reserve):
    plan = plan_for("b300x4", profile="throughput", sets=(f"capacity.runtime_reserve_gib={reserve}",))
    assert plan_fit(derive(plan), CTX_256K).sequences_published_basis == 76
    m3 = memory_inputs(derive(plan), get_model("minimax-m3-mxfp8"), "fp8")
    assert resident_sequences(m3, DEP4, CTX_256K).sequences_published_basis == 28


def test_sensitivity_band_brackets_the_answer():
    plan = plan_for("b300x4", profile="throughput")
    fit = plan_fit(derive(plan), CTX_256K)
    band = fit.sensitivity_published_basis.utilization
    assert band.low < 0.92 < band.high  # the recipe's 0.92
    for util, expected in [
        (band.low + 1e-4, 76),
        (band.high - 1e-4, 76),
        (band.low - 1e-3, 72),
        (band.high + 1e-3, 80),
    ]:
        moved = plan_for("b300x4", profile="throughput", sets=(f"serving.gpu_memory_utilization={util}",))
        assert plan_fit(derive(moved), CTX_256K).sequences_published_basis == expected, util
    engine = fit.sensitivity
    for reserve, expected in [
        (engine.reserve_gib.low + 0.01, fit.sequences),
        (engine.reserve_gib.high + 0.01, engine.reserve_gib.above),
    ]:
        moved = plan_for("b300x4", profile="throughput", sets=(f"capacity.runtime_reserve_gib={reserve}",))
        assert plan_fit(derive(moved), CTX_256K).sequences == expected, reserve


def test_tp8_replicates_kv_heads_on_hopper():
    """4 KV heads over 8 ranks: vLLM keeps max(1, 4 // 8) = 1 head per rank, so every head lives
    on two ranks; the indexer's single key vector lives on all eight."""
    fit = plan_fit(derive(plan_for("h200x8")), CTX_256K)
    assert fit.layout == "TP8"
    assert fit.kv_bytes_per_token.main_attention == 60 * 2 * 1 * 128 * 1  # FP8, one head a rank
    assert fit.kv_bytes_per_token.indexer == 60 * 128 * 1
    assert fit.sequences <= 0.6 * fit.sequences_published_basis


def test_aiter_requantization_weighs_more():
    """The AITER variant loads MXFP8 experts (seed 000: its recipe re-quantizes NVFP4 experts at
    load), so it is sized with them: 48 sequences of 256K on mi355xx8 where NVFP4 counted 62. A
    plan that knows its image keeps NVFP4 says so and gets the quickstart's count."""
    quick = plan_fit(derive(plan_for("mi355xx8")), CTX_256K)
    aiter = plan_fit(derive(plan_for("mi355xx8", variant="aiter")), CTX_256K)
    assert aiter.weights_per_gpu_bytes >= 1.3 * quick.weights_per_gpu_bytes
    assert (aiter.sequences, quick.sequences) == (48, 62)
    kept = derive(plan_for("mi355xx8", variant="aiter", sets=("moe.expert_requantization=none",)))
    assert plan_fit(kept, CTX_256K) == quick


def test_decode_context_parallelism_splits_only_replicated_caches():
    plan = plan_for("b300x4", profile="long-context")
    inputs = memory_inputs(derive(plan))
    tp4 = token_bytes(inputs, Sharding(tensor=4))
    dcp4 = token_bytes(inputs, Sharding(tensor=4, decode_context=4))
    assert dcp4.main_attention == tp4.main_attention  # one distinct head a rank: nothing to split
    assert dcp4.indexer == tp4.indexer / 4  # four copies of the indexer keys become four quarters


def test_published_kv_bytes_are_main_attention_only():
    facts = get_model("minimax-m3.1-flash")
    assert facts.published_kv_bytes_per_token == {"nvfp4": 34560, "fp8": 61440}
    g = facts.geometry
    assert (
        60 * 2 * 4 * 128
        == facts.published_kv_bytes_per_token["fp8"]
        == (g.layers.value * 2 * g.kv_heads.value * g.head_dim.value)
    )
    assert pytest.approx(1 - 0.4375) == 34560 / 61440


def test_every_geometry_number_has_a_source():
    for model_id in ("minimax-m3.1-flash", "minimax-m3-mxfp8", "rehearsal-tiny"):
        geometry = get_model(model_id).geometry
        for name, fact in geometry:
            if fact is not None and name != "name":
                assert len(fact.source) >= 8, (model_id, name)
    unpublished = get_model("minimax-m3.1-flash").geometry.unpublished()
    assert unpublished == ["sparse_layers=60", "indexer_dim=128"]
    assert get_model("minimax-m3-mxfp8").geometry.unpublished() == []


def test_local_model_is_sized_from_its_config(tmp_path):
    """model.path holding a config.json: the geometry vLLM will see, not models.yaml's."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 3,
                "num_attention_heads": 8,
                "num_key_value_heads": 2,
                "hidden_size": 512,
                "torch_dtype": "float16",
            }
        )
    )
    plan = plan_for("cpu", sets=(f"model.path={tmp_path}",))
    fit = plan_fit(derive(plan), 2048)
    assert fit.kv_bytes_per_token.main_attention == 3 * 2 * 2 * 64 * 2
    # VLLM_CPU_KVCACHE_SPACE=1 (the rehearsal recipe): 1 GiB / 1,536 bytes, in 128-token blocks.
    assert fit.kv_cache_tokens == (2**30 // (128 * 1536)) * 128
    assert fit.sequences_published_basis is None and fit.sensitivity is None
    assert fit.geometry.name == "the checkpoint's own"
    assert fit.geometry.source == str(tmp_path / "config.json")


def test_rehearsal_prediction_matches_what_vllm_printed():
    """vLLM 0.32's CPU build printed "CPU KV cache size: 524,288 tokens, Maximum concurrency for
    2,048 tokens per request: 256.00x" for the rehearsal model with 1 GiB (vllm-engine-facts.md);
    tests/rehearsal/test_rehearsal.py checks the same against a live engine."""
    fit = plan_fit(derive(plan_for("cpu")))
    assert (fit.kv_cache_tokens, fit.sequences, fit.context) == (524288, 256, 2048)


def test_bad_cpu_kv_space_is_refused():
    plan = plan_for("cpu", sets=("runtime.env.VLLM_CPU_KVCACHE_SPACE=lots",))
    with pytest.raises(InputError, match="VLLM_CPU_KVCACHE_SPACE"):
        plan_fit(derive(plan))


def test_more_memory_never_fits_fewer():
    last = -1
    for hw in ["h100x8", "h200x8"]:
        seqs = plan_fit(derive(plan_for(hw)), CTX_256K).sequences
        assert seqs >= last
        last = seqs
    assert (
        plan_fit(derive(plan_for("b300x4")), CTX_256K).sequences
        >= plan_fit(derive(plan_for("b200x4")), CTX_256K).sequences
    )


def test_monotonic_in_context_and_utilization():
    plan = plan_for("b300x4")
    counts = [plan_fit(derive(plan), c).sequences for c in (32768, 65536, 131072, 262144, 524288, 1048576)]
    assert counts == sorted(counts, reverse=True)
    low = plan_for("b300x4", sets=("serving.gpu_memory_utilization=0.8",))
    assert plan_fit(derive(low), CTX_256K).sequences <= plan_fit(derive(plan), CTX_256K).sequences


def test_impossible_layout_does_not_fit():
    # FP8 caches: vLLM refuses an NVFP4 cache on Hopper (engine rule vllm-nvfp4-kv-needs-sm10x)
    sets = ("parallelism.tensor=1", "cache.kv_dtype=fp8", "cache.indexer_dtype=fp8")
    plan = plan_for("h100x8", recipe="blackwell", sets=sets)
    fit = plan_fit(derive(plan), CTX_256K)
    assert not fit.fits and fit.sequences == 0


def test_parse_context():
    assert parse_context("256k") == 262144
    assert parse_context("1M") == 1048576
    assert parse_context("8192") == 8192
    with pytest.raises(InputError):
        parse_context("lots")


def test_longest_context_inverts_resident_sequences():
    from m31ctl.capacity.fit import plan_longest_context

    plan = plan_for("b300x4", profile="throughput")
    held = plan_fit(derive(plan), CTX_256K).sequences
    longest = plan_longest_context(derive(plan), held)
    assert longest >= CTX_256K
    assert plan_fit(derive(plan), longest).sequences >= held
    assert plan_fit(derive(plan), longest + 128).sequences < held


def test_comparison_respects_recipe_rules_and_lists_m3():
    from m31ctl.capacity.fit import comparison
    from m31ctl.capacity.fit import profile_layouts as _layouts

    hopper = plan_for("h200x8")
    rows = comparison(derive(hopper), CTX_256K, _layouts(derive(hopper)))
    assert {r.kv_dtype for r in rows} == {"fp8"}  # the Hopper recipe forbids an NVFP4 cache
    assert {r.model for r in rows} == {"MiniMax-M3.1-Flash", "MiniMax-M3 (MXFP8)"}


def test_capacity_cli_and_plot(cli, tmp_path):

    result = cli(
        "capacity",
        "--hardware",
        "b300x4",
        "--profile",
        "throughput",
        "--context",
        "256k",
        "--sequences",
        "76",
        "--json",
        "--plot",
        str(tmp_path / "cap.png"),
    )
    assert result.returncode == 0, result.stderr
    data = cli_json.data(result.stdout)
    assert data["fit"]["sequences_published_basis"] == 76 and data["layout"] == "DEP4"
    assert data["fit"]["sequences"] <= 76 and data["fit"]["kv_cache_tokens"] > 0
    assert set(data["fit"]["kv_bytes_per_token"]) >= {"main_attention", "indexer", "total"}
    assert data["fit"]["sensitivity"]["gpu_memory_utilization"]["low"] < 0.92
    pairs = {(r["model"], r["layout"]): r for r in data["comparison"]}
    m3 = pairs[("MiniMax-M3 (MXFP8)", "throughput (DEP4, MoE EP4)")]
    assert m3["sequences_published_basis"] == 28 and m3["sequences"] <= 28 and m3["kv_cache_tokens"] > 0
    assert (tmp_path / "cap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Each table says which geometry it used: whose, from where, and what is unpublished.
    assert data["fit"]["geometry"] == {
        "model": "MiniMax-M3.1-Flash",
        "name": "MiniMax-M3.1-Flash's (main attention from the launch post's bytes per token)",
        "source": "recipes/models.yaml",
        "published": False,
        "unpublished": ["sparse_layers=60", "indexer_dim=128"],
    }
    assert m3["geometry"]["published"] and m3["geometry"]["name"].startswith("MiniMax-M3-preview's")


def test_capacity_text_names_each_geometry(cli):
    text = cli("capacity", "--hardware", "b300x4", env={"COLUMNS": "400"}).stdout
    lines = [line for line in text.splitlines() if line.startswith("geometry of ")]
    assert lines == [
        "geometry of MiniMax-M3.1-Flash: MiniMax-M3.1-Flash's (main attention from the launch post's bytes "
        "per token), from recipes/models.yaml; unpublished: sparse_layers=60, indexer_dim=128",
        "geometry of MiniMax-M3 (MXFP8): MiniMax-M3-preview's (vLLM 0.32 MiniMaxM3TextConfig defaults), from "
        "recipes/models.yaml; every value published",
    ]


def test_plot_draws_only_what_the_recipe_allows(tmp_path):
    """The plot draws the comparison's own rows: Hopper's FP8-only rule leaves no NVFP4 line."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from m31ctl.capacity.fit import profile_layouts
    from m31ctl.cli.plot import draw

    plan = resolve(PlanRequest(hardware=simulated("h200x8")))
    labels: list[str] = []
    original = plt.close

    def capture(fig):  # type: ignore[no-untyped-def]
        labels.extend(
            line.get_label()
            for ax in fig.axes
            for line in ax.get_lines()
            if not line.get_label().startswith("_")
        )
        original(fig)

    plt.close = capture
    try:
        draw(derive(plan), profile_layouts(derive(plan)), tmp_path / "h200.png")
    finally:
        plt.close = original
    assert labels and all("fp8 KV" in label for label in labels)
    assert not any("nvfp4" in label for label in labels)


def _safetensors(path, tensors):  # type: ignore[no-untyped-def]
    """A safetensors file of zero-filled bf16 tensors: {name: element count}."""
    header, offset = {}, 0
    for name, count in tensors.items():
        header[name] = {"dtype": "BF16", "shape": [count], "data_offsets": [offset, offset + 2 * count]}
        offset += 2 * count
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(offset))


def test_a_local_moe_is_sharded_as_vllm_shards_it(tmp_path):
    """Routed experts (.experts.N.) spread over DP x TP with or without EP; the rest by TP only
    (FusedMoEParallelConfig.make). The real-vLLM proof is in tests/engine/test_engine_truth.py."""
    from m31ctl.capacity.geometry import checkpoint_weights
    from m31ctl.capacity.memory import weights_per_gpu

    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    _safetensors(
        tmp_path / "model.safetensors",
        {
            "model.layers.0.block_sparse_moe.experts.0.w1.weight": 3000,
            "model.layers.0.block_sparse_moe.experts.1.w1.weight": 3000,
            "model.layers.0.mlp.shared_experts.w1.weight": 500,  # a shared expert is dense
            "model.embed_tokens.weight": 500,
        },
    )
    dense, experts = checkpoint_weights(tmp_path)
    assert (dense, experts) == (2000, 12000)
    weights = memory_inputs(
        derive(resolve(PlanRequest(hardware=simulated("cpu"), sets=(f"model.path={tmp_path}",))))
    ).weights
    assert weights == (2000.0, 12000.0)
    for expert in (False, True):
        assert weights_per_gpu(weights, Sharding(tensor=2, data=2, expert=expert)) == 2000 / 2 + 12000 / 4
    assert weights_per_gpu(weights, Sharding(tensor=4)) == 14000 / 4
    assert Sharding(tensor=2, data=2).moe_label() == "MoE TP4" and DEP4.moe_label() == "MoE EP4"


def test_the_drafts_kv_is_counted_from_a_local_dspark_config(tmp_path):
    config = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "hidden_size": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    p = resolve(PlanRequest(hardware=simulated("cpu"), sets=(f"model.path={tmp_path}",)))
    without = token_bytes(memory_inputs(derive(p)), Sharding())
    (tmp_path / "dspark").mkdir()
    draft = {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}
    (tmp_path / "dspark" / "config.json").write_text(json.dumps(draft))
    inputs = memory_inputs(derive(p))
    assert inputs.geometry.draft_layers == 1 and inputs.geometry.name.startswith("the checkpoint's own")
    # one layer x K and V x 2 heads x 64 x bf16, in the main cache's dtype
    assert token_bytes(inputs, Sharding()).main_attention == without.main_attention + 1 * 2 * 2 * 64 * 2


def test_a_pd_plan_states_each_roles_capacity():
    """A P/D pair's capacity is each role's on its own layout (issue 36): prefill's KV tokens are
    prompts in flight, decode's sequences stay resident; one server has no roles."""
    from tests.conftest import run_cli

    sets = ["--set", "disaggregation.enabled=true", "--set", "disaggregation.decode.tensor=2",
            "--set", "disaggregation.decode.data=2"]  # fmt: skip
    shown = run_cli("capacity", "--hardware", "b300x8", *sets, "--json")
    assert shown.returncode == 0, shown.stderr
    roles = cli_json.data(shown.stdout)["roles"]
    assert sorted(roles) == ["decode", "prefill"]
    assert roles["prefill"]["layout"] == "TP4" and roles["decode"]["layout"] != roles["prefill"]["layout"]
    assert roles["prefill"]["kv_cache_tokens"] > 0 and roles["decode"]["sequences"] > 0
    text = run_cli("capacity", "--hardware", "b300x8", *sets).stdout
    assert "prefill (TP4): " in text and "prompt tokens it holds in flight" in text
    assert f"decode ({roles['decode']['layout']}): {roles['decode']['sequences']} sequences" in text
    alone = run_cli("capacity", "--hardware", "b300x8", "--json")
    assert cli_json.data(alone.stdout)["roles"] is None


def test_without_context_capacity_asks_what_the_plan_can_serve(cli):
    """No --context: 256k, or the plan's longest sequence where that is shorter. The CPU recipe's
    2,048 positions used to be refused as '--context 256k', a flag the user never typed."""
    shown = cli("capacity", "--recipe", "cpu", "--hardware", "cpu", "--json")
    assert shown.returncode == 0, shown.stderr
    assert cli_json.data(shown.stdout)["fit"]["context"] == 2048
    gpu = cli("capacity", "--hardware", "b300x4", "--json")
    assert cli_json.data(gpu.stdout)["fit"]["context"] == 262144
    asked = cli("capacity", "--recipe", "cpu", "--hardware", "cpu", "--context", "256k")
    assert asked.returncode == 2 and "--context 256k (262,144 tokens) is beyond" in asked.stderr
