"""The engine's own rules, mirrored so that a plan the engine would refuse is refused at resolve.

vLLM checks much of a configuration only when it builds its engine config, minutes into a start
and after the download: tensor and decode-context parallelism against the model's heads, the
context length against the checkpoint's positions, the attention and speculative configs, what
the MiniMax-M3 model code accepts. Each rule here mirrors one such check and names the vLLM
source it mirrors (`ENGINE_RULES`).

Each rule is a function of one `RuleContext` (plan/rule_context.py), whose model facts come from
the checkpoint's own config.json when it is on this host (plan/checkpoint_facts.py). They are
checked, with what the engine image can run (plan/engine_capabilities.py), in plan/engine_check.py;
docs/engine-rules.md is generated from them and the table (plan/engine_rules_doc.py,
scripts/gen-constraints).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from m31ctl.hardware import Platform
from m31ctl.plan.checkpoint_facts import RopeScaling, rope_scaling
from m31ctl.plan.rule_context import RuleContext

_ALLOW_LONG = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
# RoPE types whose factor vLLM does not apply to max_position_embeddings (vllm/config/model.py
# _get_and_verify_max_len: "YaRN variants leave max_position_embeddings already scaled").
_UNSCALED_ROPE = {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}


class EngineRule(NamedTuple):
    id: str
    key: str  # the setting a violation is blamed on
    summary: str
    source: str  # the vLLM code it mirrors
    check: Callable[[RuleContext], str | None]  # why the plan breaks it, or None


def _tp_divides_heads(ctx: RuleContext) -> str | None:
    heads, tp = ctx.facts.attention_heads, ctx.settings.parallelism.tensor
    if heads is None or heads.value % tp == 0:
        return None
    return (
        f"the model's {heads.value} attention heads ({heads.source}) must be divisible by the "
        f"tensor-parallel size ({tp})"
    )


def _dcp_kv_heads(ctx: RuleContext) -> str | None:
    dcp, tp, kv = ctx.settings.parallelism.decode_context, ctx.settings.parallelism.tensor, ctx.facts.kv_heads
    if dcp <= 1 or tp > kv.value:
        return None
    return (
        f"Decode context parallelism for GQA/MQA requires `--tensor-parallel-size` ({tp}) to be "
        f"greater than the model's total number of KV heads ({kv.value}, {kv.source}); vLLM refuses "
        "-dcp > 1 here. The launch post's indexer DCP is not -dcp: it shards the indexer's work "
        "(vLLM 0.33 --attention-config minimax_m3_indexer_cp, ROCm)"
    )


def _dcp_max(ctx: RuleContext) -> str | None:
    dcp, tp, kv = ctx.settings.parallelism.decode_context, ctx.settings.parallelism.tensor, ctx.facts.kv_heads
    if dcp <= 1 or tp <= kv.value or dcp <= tp // kv.value:
        return None
    return (
        f"`--decode-context-parallel-size` ({dcp}) exceeds the maximum supported value "
        f"({tp // kv.value}) for `--tensor-parallel-size` ({tp}) and {kv.value} model KV heads"
    )


def _dcp_q_per_kv(ctx: RuleContext) -> str | None:
    dcp, heads, kv = ctx.settings.parallelism.decode_context, ctx.facts.attention_heads, ctx.facts.kv_heads
    if dcp <= 1 or heads is None or (heads.value // kv.value) % dcp == 0:
        return None
    return (
        f"the model's number of query heads per KV head ({heads.value // kv.value}) must be "
        f"divisible by `--decode-context-parallel-size` ({dcp})"
    )


def _overridden_rope(ctx: RuleContext) -> tuple[RopeScaling | None, str]:
    """RoPE scaling from --hf-overrides in engine.extra_args, and a note when it is misplaced."""
    overrides = ctx.hf_overrides
    text_config = overrides.get("text_config")
    nested: dict[str, Any] = text_config if isinstance(text_config, dict) else {}
    found = rope_scaling(nested.get("rope_scaling") or nested.get("rope_parameters"), "--hf-overrides")
    if found:
        return found, ""
    top = rope_scaling(overrides.get("rope_scaling") or overrides.get("rope_parameters"), "--hf-overrides")
    if top and ctx.facts.nested_text_config:
        return None, (
            "; --hf-overrides sets rope_scaling at the top level, which misses the decoder's config: "
            'put it under "text_config" (vllm-project/recipes MiniMax-M3.yaml: "a top-level override '
            "silently misses the decoder's config\")"
        )
    return top, ""


def _derived_max_len(ctx: RuleContext) -> tuple[int, str] | None:
    """vLLM's derived max_model_len: max_position_embeddings, times a RoPE factor that is not
    YaRN-like, capped by the tokenizer's model_max_length."""
    positions = ctx.facts.max_positions
    if positions is None:
        return None
    derived, key = positions.value, f"max_position_embeddings={positions.value}, {positions.source}"
    rope = _overridden_rope(ctx)[0] or ctx.facts.rope
    if rope and rope.rope_type not in _UNSCALED_ROPE:
        derived = int(derived * rope.factor)
        key += f" x {rope.rope_type} factor {rope.factor:g}"
    tok = ctx.facts.tokenizer_max
    if tok is not None and tok.value < derived:
        derived, key = tok.value, f"model_max_length={tok.value}, {tok.source}"
    return derived, key


def _allow_long(ctx: RuleContext) -> bool:
    return ctx.env.get(_ALLOW_LONG, "0").strip().lower() in ("1", "true")


def _max_model_len(ctx: RuleContext) -> str | None:
    derived = _derived_max_len(ctx)
    wanted = ctx.settings.serving.max_model_len
    if derived is None or wanted <= derived[0] or _allow_long(ctx):
        return None
    return (
        f"User-specified max_model_len ({wanted}) is greater than the derived max_model_len "
        f"({derived[1]}); vLLM refuses it unless {_ALLOW_LONG}=1 (runtime.env), and past the "
        "native positions the model needs RoPE scaling (engine rule m31-long-context-rope)"
    )


def _long_context_rope(ctx: RuleContext) -> str | None:
    derived = _derived_max_len(ctx)
    wanted = ctx.settings.serving.max_model_len
    if derived is None or wanted <= derived[0] or not _allow_long(ctx):
        return None
    rope, note = _overridden_rope(ctx)
    rope = rope or ctx.facts.rope
    if rope is not None and (rope.reach is None or rope.reach >= wanted):
        return None
    have = (
        f"{rope.rope_type} x{rope.factor:g} reaches {rope.reach} ({rope.source})"
        if rope
        else "neither the checkpoint's config nor --hf-overrides scales RoPE"
    )
    return (
        f"max_model_len {wanted} is past the model's {derived[1]} and {_ALLOW_LONG}=1 only silences "
        f'vLLM\'s check ("positions exceeding derived_max_model_len lead to nan"): {have}{note}. '
        'Add YaRN under text_config in engine.extra_args, e.g. --hf-overrides \'{"text_config":{"rope_scaling":'
        '{"rope_type":"yarn","factor":2.0,"original_max_position_embeddings":524288}}}\''
    )


def _nvidia_ignores_rope_scaling(ctx: RuleContext) -> str | None:
    positions = ctx.facts.max_positions
    wanted = ctx.settings.serving.max_model_len
    if (
        ctx.platform is not Platform.CUDA
        or not ctx.minimax_m3
        or positions is None
        or wanted <= positions.value
    ):
        return None
    return (
        f"max_model_len {wanted} is past the checkpoint's {positions.value} positions ({positions.source}), "
        "and vLLM's NVIDIA MiniMax-M3 model builds its rotary embedding from rope_theta and "
        "partial_rotary_factor alone, ignoring rope_scaling (YaRN in --hf-overrides changes nothing "
        "there): positions past the native ones read beyond the rotary cache. Only the AMD model "
        "applies YaRN; on NVIDIA serve at most the native context"
    )


def _block_size(ctx: RuleContext) -> str | None:
    sparse, block = ctx.facts.sparse_block_size, ctx.settings.cache.block_size
    if sparse is None or block is None or block == sparse.value:
        return None
    return (
        f"MiniMax Sparse Attention's kernels support KV cache blocks of {sparse.value} tokens only "
        f'({sparse.source}); vLLM aborts KV cache init with "No common block size for {block}"'
    )


def _nvfp4_sm10x(ctx: RuleContext) -> str | None:
    hw = ctx.hardware
    if ctx.settings.cache.kv_dtype != "nvfp4" or ctx.platform is not Platform.CUDA or not ctx.minimax_m3:
        return None
    if (hw.arch or "").split(".")[0] == "10":
        return None
    return (
        "MiniMax M3 sparse attention supports an NVFP4 KV cache only with the SM100 MSA backend "
        f"(compute capability 10.x); this host's GPUs are {hw.arch}"
    )


def _indexer_cp(ctx: RuleContext) -> str | None:
    if not ctx.indexer_cp:
        return None
    s = ctx.settings
    problems = []
    if ctx.platform is not Platform.ROCM:
        problems.append(f"it runs on ROCm only (this host is {ctx.platform.title})")
    if s.parallelism.tensor < 2:
        problems.append("it needs --tensor-parallel-size > 1 (it shards over the TP group)")
    if s.cache.indexer_dtype not in ("auto", "bf16", "fp8"):
        problems.append(
            f"it needs a bf16 or fp8 e4m3 index cache (cache.indexer_dtype is {s.cache.indexer_dtype})"
        )
    if s.parallelism.decode_context != 1:
        problems.append("it shards indexer work, not the KV cache, and requires -dcp 1")
    return "minimax_m3_indexer_cp: " + "; ".join(problems) if problems else None


def _dspark_tokens(ctx: RuleContext) -> str | None:
    spec, block = ctx.settings.speculative, ctx.facts.draft_block_size
    if spec.method != "dspark" or block is None or spec.tokens is None or spec.tokens <= block.value:
        return None
    return (
        f"{spec.tokens} speculative tokens exceed the DSpark draft's block size of {block.value} "
        f"({block.source}): one draft step proposes one block, so tokens past it are untrained "
        "and acceptance collapses"
    )


def _monokernel(ctx: RuleContext) -> str | None:
    if not ctx.monokernel:
        return None
    s = ctx.settings
    par = s.parallelism
    reasons = []
    if par.tensor != 4:
        reasons.append("requires tensor parallel size 4")
    if par.pipeline > 1:
        reasons.append("does not support pipeline parallelism")
    if par.data > 1:
        reasons.append("does not support data parallelism")
    if par.decode_context > 1:
        reasons.append("does not support decode context parallelism")
    if par.expert:
        reasons.append("does not support expert parallelism")
    if s.cache.kv_dtype != "fp8":
        reasons.append("requires an FP8 KV cache")
    if s.cache.block_size != 128:
        reasons.append("requires KV cache block size 128")
    if s.cache.indexer_dtype != "fp8":
        reasons.append('requires indexer_kv_dtype "fp8"')
    if s.speculative.method != "none":
        reasons.append("supports only EAGLE3 speculative decoding")
    if s.moe.backend != "aiter":
        reasons.append("requires --moe-backend aiter")
    if ctx.model.expert_weights != "mxfp4":
        reasons.append(
            f"runs MXFP4 experts (the AITER_MXFP4_MXFP4 layout); this checkpoint's are {ctx.model.expert_weights}"
        )
    return "MiniMax-M3 specialized decode unsupported: " + "; ".join(reasons) if reasons else None


def _cpu_offload_platform(ctx: RuleContext) -> str | None:
    if ctx.settings.cache.cpu_offload_gib is None or ctx.platform in (Platform.CUDA, Platform.ROCM):
        return None
    return (
        "vLLM's CPU offloading runs only on CUDA-alike and XPU GPUs: the CPU build starts its "
        "OffloadingConnector and dies at worker init"
    )


_MODEL_PY = "vllm/config/model.py"
ENGINE_RULES: tuple[EngineRule, ...] = (
    EngineRule(
        "vllm-tp-divides-heads",
        "parallelism.tensor",
        "the tensor-parallel size divides the model's attention heads",
        f"vLLM 0.32/0.33 {_MODEL_PY} ModelConfig.verify_with_parallel_config",
        _tp_divides_heads,
    ),
    EngineRule(
        "vllm-dcp-kv-heads",
        "parallelism.decode_context",
        "decode context parallelism (-dcp > 1) needs a tensor-parallel size greater than the model's KV heads",
        f"vLLM 0.32/0.33 {_MODEL_PY} ModelConfig.verify_with_parallel_config",
        _dcp_kv_heads,
    ),
    EngineRule(
        "vllm-dcp-max",
        "parallelism.decode_context",
        "-dcp is at most the tensor-parallel size over the KV heads",
        f"vLLM 0.32/0.33 {_MODEL_PY} ModelConfig.verify_with_parallel_config",
        _dcp_max,
    ),
    EngineRule(
        "vllm-dcp-q-per-kv",
        "parallelism.decode_context",
        "-dcp divides the query heads per KV head",
        f"vLLM 0.32/0.33 {_MODEL_PY} ModelConfig.verify_with_parallel_config",
        _dcp_q_per_kv,
    ),
    EngineRule(
        "vllm-max-model-len",
        "serving.max_model_len",
        "max_model_len stays within the checkpoint's max_position_embeddings (and the tokenizer's "
        f"model_max_length) unless {_ALLOW_LONG}=1",
        f"vLLM 0.32/0.33 {_MODEL_PY} _get_and_verify_max_len",
        _max_model_len,
    ),
    EngineRule(
        "m31-long-context-rope",
        "serving.max_model_len",
        f"past the native positions ({_ALLOW_LONG}=1), RoPE scaling that reaches max_model_len, "
        "under text_config for MiniMax-M3",
        f"vLLM 0.32/0.33 {_MODEL_PY} _get_and_verify_max_len (the override's warning: positions past "
        "the derived length lead to nan); vllm-project/recipes models/MiniMaxAI/MiniMax-M3.yaml, AMD "
        'ROCm notes ("Native context is 512K. To go past it, supply a YaRN rope_scaling on the text config")',
        _long_context_rope,
    ),
    EngineRule(
        "vllm-nvidia-m3-no-rope-scaling",
        "serving.max_model_len",
        "on NVIDIA, a MiniMax-M3 context stays within the checkpoint's max_position_embeddings: the "
        "NVIDIA model code ignores rope_scaling",
        "vLLM 0.32/0.33 vllm/models/minimax_m3/nvidia/model.py (get_rope with rope_theta and "
        "partial_rotary_factor only); vllm/models/minimax_m3/amd/model.py applies rope_scaling",
        _nvidia_ignores_rope_scaling,
    ),
    EngineRule(
        "vllm-msa-block-size",
        "cache.block_size",
        "a MiniMax-M3 KV cache block equals the MSA sparse block (128 tokens)",
        "vLLM 0.32/0.33 vllm/models/minimax_m3/common/sparse_attention.py and common/indexer.py "
        'get_supported_kernel_block_sizes ([128]); vllm/v1/worker/utils.py ("No common block size")',
        _block_size,
    ),
    EngineRule(
        "vllm-nvfp4-kv-needs-sm10x",
        "cache.kv_dtype",
        "an NVFP4 main cache on NVIDIA needs compute capability 10.x (the MSA NVFP4 backend)",
        "vLLM 0.32/0.33 vllm/models/minimax_m3/common/sparse_attention.py select_main_backend_and_impl_cls",
        _nvfp4_sm10x,
    ),
    EngineRule(
        "vllm-indexer-cp",
        "cache.indexer_context_parallel",
        "indexer context parallelism (minimax_m3_indexer_cp): ROCm, TP > 1, a bf16 or fp8 index cache, -dcp 1",
        "vLLM 0.33 vllm/config/attention.py AttentionConfig.minimax_m3_indexer_cp and __post_init__; "
        "vllm/models/minimax_m3/common/indexer.py select_indexer_impl_cls; "
        "vllm/models/minimax_m3/amd/indexer_msa.py msa_indexer_cp_enabled",
        _indexer_cp,
    ),
    EngineRule(
        "vllm-dspark-block",
        "speculative.tokens",
        "DSpark's speculative tokens stay within the draft's block size (its dspark/config.json)",
        "vLLM 0.33 vllm/config/speculative.py (a DSpark draft's num_speculative_tokens defaults to its "
        'block_size / dspark_block_size; Qwen3-Omni DSpark requires it equal: "trained block_size")',
        _dspark_tokens,
    ),
    EngineRule(
        "vllm-monokernel",
        "engine.extra_args",
        "--monokernel (MiniMax-M3 specialized decode): TP4 alone, FP8 KV and index caches, 128-token "
        "blocks, EAGLE3 or no speculation, --moe-backend aiter, MXFP4 experts",
        "vLLM 0.33 vllm/models/minimax_m3/amd/specialized_decode/runtime/spec.py refusal_reasons and "
        "runtime/weights.py (AITER_MXFP4_MXFP4)",
        _monokernel,
    ),
    EngineRule(
        "vllm-cpu-offload-platform",
        "cache.cpu_offload_gib",
        "KV offloading to host memory (--kv-offloading-backend native) on a GPU, not vLLM's CPU build",
        'vLLM 0.32 vllm/v1/kv_offload/cpu/spec.py CPUOffloadingSpec.get_worker ("CPU Offloading is '
        'currently only supported on CUDA-alike and XPU GPUs"; seen on the CPU build here)',
        _cpu_offload_platform,
    ),
)
