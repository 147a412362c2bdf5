"""MiniMax-M3's own code path on the lent H200 (issue 48), replayed: the Hopper recipe launched by
m31ctl on a tiny MiniMax-M3 checkpoint (m31ctl/rehearsal/make_tiny_m3.py) with vLLM 0.26.0 and
FlashInfer 0.6.14, captured by scripts/device-gpu-m3 into tests/fixtures/gpu/h200-m3-vllm026/ (its
README says how). No GPU and no vLLM: every figure comes from the capture, and m31ctl's code reads
it again here. Beside it, what the capture taught m31ctl: the FP8 index cache a vLLM before 0.32
refuses off SM10x, refused at plan time and by doctor, with its fallback and cost; verify on
random weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from m31ctl.checks import CheckStatus
from m31ctl.errors import RuleViolation
from m31ctl.rehearsal import make_tiny_m3

CAPTURE = Path(__file__).parent / "fixtures" / "gpu" / "h200-m3-vllm026"
HOPPER_ON_ONE = ("engine.image=vllm/vllm-openai:v0.26.0", "parallelism.tensor=1")


def _plan(hw: str, *sets: str, recipe: str = "hopper"):
    from m31ctl.hardware import simulated
    from m31ctl.plan import PlanRequest, resolve

    return resolve(PlanRequest(hardware=simulated(hw), recipe=recipe, sets=sets))


def _refusal(hw: str, *sets: str) -> str:
    with pytest.raises(RuleViolation) as caught:
        _plan(hw, *sets)
    return caught.value.one_line()


@pytest.fixture(scope="module")
def tiny_m3(tmp_path_factory) -> Path:
    """The tiny checkpoint's config.json and its marker (the weights need torch; not made here)."""
    directory = tmp_path_factory.mktemp("tiny-m3")
    (directory / "config.json").write_text(json.dumps(make_tiny_m3.config("nvfp4")))
    (directory / "m31ctl-rehearsal.json").write_text(json.dumps({"made_by": "m31ctl", "weights": "random"}))
    return directory


# --- the FP8 index cache by engine version -------------------------------------------------------


@pytest.mark.parametrize("version", ["0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0"])
def test_the_recipes_fp8_index_cache_is_refused_on_hopper_before_vllm_032(version):
    """vLLM 0.26-0.31's Triton indexer takes bf16 only (common/indexer.py select_indexer_impl_cls,
    read in each release's wheel); 0.26 was seen refusing at model init on the H200. The plan
    refuses it before any download, naming the engine, the source and the fallback with its cost."""
    message = _refusal("h200x8", f"engine.image=vllm/vllm-openai:v{version}")
    assert f"stock vLLM {version.rsplit('.', 1)[0]}, CUDA build" in message
    assert "FP8 sparse-attention index cache outside compute capability 10.x" in message
    assert "cache.indexer_dtype=fp8" in message and "select_indexer_impl_cls" in message
    # The fallback and what it costs MiniMax-M3.1-Flash at TP8 (models.yaml's geometry): the
    # index keys double, 23,040 -> 30,720 bytes a token on each rank.
    assert "--set cache.indexer_dtype=bf16 serves without it" in message
    assert "each rank stores 30,720 bytes a token instead of 23,040" in message
    assert "25% fewer KV tokens" in message


def test_the_fallback_plans_and_newer_engines_keep_fp8():
    assert _plan("h200x8", "engine.image=vllm/vllm-openai:v0.26.0", "cache.indexer_dtype=bf16")
    for image in (
        "vllm/vllm-openai:v0.32.0",
        "vllm/vllm-openai:v0.33.1",
        "vllm/vllm-openai:minimax-m31-flash",
    ):
        assert _plan("h200x8", f"engine.image={image}").settings.cache.indexer_dtype == "fp8"


def test_compute_capability_10_runs_an_fp8_index_cache_on_its_msa_indexer_in_every_release():
    """On compute capability 10.x the MSA indexer takes FP8 (0.26's too): nothing lacks there."""
    from m31ctl.hardware import simulated
    from m31ctl.plan.engine_rules import lacking_in_version

    settings = _plan("h200x8").settings
    assert lacking_in_version(settings, simulated("b300x4"), "0.26.0", "cuda") == []
    assert len(lacking_in_version(settings, simulated("h200x8"), "0.26.0", "cuda")) == 1
    assert lacking_in_version(settings, simulated("h200x8"), "0.32.0", "cuda") == []
    assert lacking_in_version(settings, simulated("h200x8"), "0.25.0", "cuda") == []  # not in the table


def test_the_tiny_checkpoints_cost_is_its_own_geometry(tiny_m3):
    """With the checkpoint's config.json on the host the cost is its own: 4 layers x 1,024 bytes
    of FP8 K and V, and 3 sparse layers x 128 index values."""
    message = _refusal("h200x1", *HOPPER_ON_ONE, f"model.path={tiny_m3}")
    assert (
        "each rank stores 4,864 bytes a token instead of 4,480 (3 sparse layers x 128 index values)"
        in message
    )


def test_doctor_names_what_the_imported_vllm_lacks(tiny_m3):
    """A native engine's image name says nothing of its version: doctor's engine-config check
    reads the version the engine's Python imported (config_check.py's answer) and fails a plan
    that uses what that vLLM's model code refuses, though vLLM builds its configuration."""
    from m31ctl.deployment import derive
    from m31ctl.doctor.base import Outcome
    from m31ctl.doctor.checks.engine_config import judge_capabilities
    from m31ctl.engine.dry_run import EngineConfigCheck

    # The image the plan names (the day-zero one) has it; the Python found has 0.26.0.
    deployment = derive(_plan("h200x1", "parallelism.tensor=1", f"model.path={tiny_m3}"))
    built = Outcome(CheckStatus.OK, "vLLM 0.26.0 (cuda) builds the plan's configuration natively: TP 1")
    answer = EngineConfigCheck.from_json({"ok": True, "vllm": "0.26.0", "platform": "cuda", "resolved": {}})
    outcome = judge_capabilities(built, answer, deployment, "natively")
    assert outcome.status is CheckStatus.FAIL
    assert outcome.message.startswith(
        "vLLM 0.26.0 natively builds the plan's configuration but its model code lacks: an FP8 sparse-attention"
    )
    assert "--set cache.indexer_dtype=bf16 serves without it" in outcome.message
    newer = EngineConfigCheck.from_json({"ok": True, "vllm": "0.32.0", "platform": "cuda", "resolved": {}})
    assert judge_capabilities(built, newer, deployment, "natively") is built
    fallback = derive(_plan("h200x1", *HOPPER_ON_ONE, "cache.indexer_dtype=bf16", f"model.path={tiny_m3}"))
    assert judge_capabilities(built, answer, fallback, "natively") is built


# --- verify on random weights ----------------------------------------------------------------------


def test_verify_knows_a_checkpoint_m31ctl_made_has_random_weights(tiny_m3, tmp_path):
    from m31ctl.deployment import derive
    from m31ctl.served.verify import random_weights

    made = derive(_plan("h200x1", *HOPPER_ON_ONE, "cache.indexer_dtype=bf16", f"model.path={tiny_m3}"))
    assert random_weights(made) == (
        f"the checkpoint's weights are random ({tiny_m3 / 'm31ctl-rehearsal.json'}), so what the model writes is noise"
    )
    (tmp_path / "config.json").write_text((tiny_m3 / "config.json").read_text())
    real = derive(_plan("h200x1", *HOPPER_ON_ONE, "cache.indexer_dtype=bf16", f"model.path={tmp_path}"))
    assert random_weights(real) is None
    hub = derive(_plan("h200x8"))
    assert random_weights(hub) is None


# --- the tiny checkpoint ----------------------------------------------------------------------------


def test_the_tiny_checkpoint_keeps_what_the_kernels_key_on():
    config = make_tiny_m3.config("nvfp4")
    assert config["model_type"] == "minimax_m3_vl" and config["architectures"] == [
        "MiniMaxM3SparseForCausalLM"
    ]
    text = config["text_config"]
    sparse = text["sparse_attention_config"]
    assert (text["head_dim"], text["num_key_value_heads"], text["hidden_size"]) == (128, 4, 1024)
    assert (sparse["sparse_num_index_heads"], sparse["sparse_index_dim"]) == (4, 128)
    assert (sparse["sparse_topk_blocks"], sparse["sparse_block_size"]) == (16, 128)
    assert text["moe_layer_freq"] == sparse["sparse_attention_freq"] == [0, 1, 1, 1]
    assert (text["num_local_experts"], text["n_shared_experts"], text["use_gemma_norm"]) == (8, 1, True)
    quant = config["quantization_config"]
    assert (quant["quant_method"], quant["quant_algo"], quant["group_size"]) == ("modelopt", "NVFP4", 16)
    # Everything but the routed experts is excluded (ModelOpt wildcards over vLLM's module names).
    from fnmatch import fnmatch

    def excluded(prefix: str) -> bool:
        return any(fnmatch(prefix, p) or p == prefix for p in quant["ignore"])

    assert not excluded("model.layers.1.block_sparse_moe.experts")
    for prefix in ("lm_head", "model.layers.0.self_attn.qkv_proj", "model.layers.2.self_attn.o_proj",
                   "model.layers.0.mlp.gate_up_proj", "model.layers.1.block_sparse_moe.gate",
                   "model.layers.3.block_sparse_moe.shared_experts.down_proj"):  # fmt: skip
        assert excluded(prefix), prefix
    assert "quantization_config" not in make_tiny_m3.config("bf16")


def test_nvfp4_packing_round_trips():
    torch = pytest.importorskip("torch")
    weight = torch.randn(32, 64) * 0.02
    packed = make_tiny_m3.nvfp4(weight)
    assert packed["weight"].dtype == torch.uint8 and tuple(packed["weight"].shape) == (32, 32)
    assert tuple(packed["weight_scale"].shape) == (32, 4) and packed["weight_scale_2"].shape == ()
    codes = torch.stack([packed["weight"] & 0xF, packed["weight"] >> 4], -1).flatten(1).long()
    values = torch.tensor(make_tiny_m3.E2M1)[codes & 7] * torch.where(codes & 8 > 0, -1.0, 1.0)
    scales = packed["weight_scale"].float().repeat_interleave(16, 1) * packed["weight_scale_2"]
    assert torch.allclose(values * scales, weight, atol=0.25 * float(weight.abs().max()))
