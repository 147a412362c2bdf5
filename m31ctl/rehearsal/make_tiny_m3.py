"""Make a tiny MiniMax-M3 checkpoint on the spot: the model's own architecture (vLLM's
`MiniMaxM3SparseForCausalLM`: MSA sparse attention with its lightning indexer, Gemma norms, a
dense leading layer, sigmoid-routed MoE with a shared expert and SwiGLU-OAI) scaled down where
the kernels do not care, kept where they do, with random weights saved as real safetensors, a
tokenizer and a chat template. Nothing is downloaded.

Kept as the kernels key on them: 128-dim heads, 4 KV heads, 4 index heads of 128 and one shared
index key, top-16 of 128-token blocks, the first layer dense, 2 of 8 routed experts plus a
shared one. Shrunk: 4 layers, hidden 1,024, 8 query heads, expert width 256, a 512-entry vocab.

The routed experts are stored as the real checkpoint stores them, in ModelOpt NVFP4
(`--quant nvfp4`, the default): per expert and projection (w1 gate, w3 up, w2 down) a `weight`
of packed E2M1 pairs (uint8, the first value in the low nibble), a `weight_scale` of FP8 E4M3
scales per 16 inputs, a per-tensor FP32 `weight_scale_2` and an FP32 `input_scale`, with a
`quantization_config` (`quant_method: modelopt`, `quant_algo: NVFP4`, `group_size: 16`) whose
exclusion list keeps everything but the routed experts unquantized, and the same in
hf_quant_config.json (ModelOpt's own file). `--quant bf16` stores the experts in bf16.

What the real checkpoint quantizes (docs/gpu-rehearsal.md, "The tiny MiniMax-M3"): NVFP4
routed experts, MXFP8 for the other projections (the launch post; nvidia/MiniMax-M3-NVFP4 is a
ModelOpt MIXED_PRECISION checkpoint, "MXFP8 base layers + NVFP4 routed experts",
NVIDIA/TensorRT-LLM#15857), and not the router (vLLM keeps its weights in FP32: GateLinear
with params_dtype float32), the embeddings, the norms, lm_head or the vision tower (vLLM's
modelopt.py serves any vision_tower unquantized). Here the non-expert projections stay bf16
instead of MXFP8: the NVFP4 experts on Marlin are the path under test, and MXFP8 dense GEMMs on
Hopper would be a second untried kernel path in the same start.

Text form (architecture MiniMaxM3SparseForCausalLM, `model_type: minimax_m3_vl` with a
`text_config`: vLLM 0.26's config registry knows no `minimax_m3_text`): no vision tower, whose
weight layout and image processor files would be two more unknowns; vLLM builds its
multimodal config only for a multimodal architecture (config/model.py), so the recipe's
`--limit-mm-per-prompt` is accepted and has nothing to limit. No dspark/ draft: no source
this session read gives its structure.

Standalone (torch, safetensors, tokenizers and transformers, which vLLM brings):

    python m31ctl/rehearsal/make_tiny_m3.py DIR [--quant nvfp4|bf16]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

try:
    from m31ctl.rehearsal import make_tiny_model
except ImportError:  # run as a script: its directory is there, not the package
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_tiny_model  # type: ignore[no-redef,import-not-found,unused-ignore]

LAYERS = 4
DENSE = [0] + [1] * (LAYERS - 1)  # the first layer dense (MLP, full attention), the rest MoE + MSA
TEXT_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 1024,
    "intermediate_size": 256,
    "dense_intermediate_size": 1024,
    "shared_intermediate_size": 256,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "max_position_embeddings": 524288,  # the real model's (vLLM's MiniMaxM3TextConfig default)
    "rms_norm_eps": 1e-6,
    "use_gemma_norm": True,
    "attention_output_gate": False,
    "rope_theta": 5000000,
    "rotary_dim": 64,
    "partial_rotary_factor": 0.5,
    "hidden_act": "swigluoai",
    "swiglu_alpha": 1.702,
    "swiglu_beta": 1.0,
    "swiglu_limit": 7.0,
    "use_qk_norm": True,
    "qk_norm_type": "per_head",
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "routed_scaling_factor": 2.0,
    "num_mtp_modules": 0,  # no MTP head is stored (vLLM's main model skips mtp.* weights)
    "moe_layer_freq": DENSE,
    "sparse_attention_config": {
        "use_sparse_attention": True,
        "sparse_index_dim": 128,
        "sparse_num_index_heads": 4,
        "sparse_topk_blocks": 16,
        "sparse_block_size": 128,
        "sparse_disable_index_value": DENSE,
        "sparse_score_type": "max",
        "sparse_init_block": 0,
        "sparse_local_block": 1,
        "sparse_attention_freq": DENSE,
    },
    "tie_word_embeddings": False,
}
# Everything but the routed experts stays unquantized: ModelOpt wildcards over vLLM's module
# names (modelopt.py is_layer_excluded matches them with fnmatch).
EXCLUDED = [
    "lm_head",
    "model.embed_tokens",
    "model.layers.*.self_attn*",
    "model.layers.*.mlp*",
    "model.layers.*.block_sparse_moe.gate",
    "model.layers.*.block_sparse_moe.shared_experts*",
]
# The real tokenizer holds MiniMax-M3's reasoning markers as whole entries (vLLM's
# minimax_m3_reasoning_parser.py); the tool-call marker is the Rust parser's start token.
MARKERS = ["<mm:think>", "</mm:think>", "]<]minimax[>[<tool_call>", "]<]minimax[>[</tool_call>"]
# The M3 template prefills the start marker when thinking_mode is "enabled" (the reasoning
# parser's docstring), so generated text lands in the reasoning field.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if thinking_mode is defined and thinking_mode == 'enabled' %}<mm:think>{% endif %}{% endif %}"
)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # FP4 magnitudes; bit 3 is the sign
FP8_MAX = 448.0
GROUP = 16


def config(quant: str, text_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """config.json: the VL wrapper's model_type with the text backbone's architecture."""
    data: dict[str, Any] = {
        "architectures": ["MiniMaxM3SparseForCausalLM"],
        "model_type": "minimax_m3_vl",
        "text_config": dict(text_config or TEXT_CONFIG),
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    if quant == "nvfp4":
        data["quantization_config"] = {
            "quant_method": "modelopt",
            "quant_algo": "NVFP4",
            "group_size": GROUP,
            "kv_cache_scheme": None,
            "ignore": EXCLUDED,
            "producer": {"name": "m31ctl make_tiny_m3.py (ModelOpt's layout)", "version": "1"},
        }
    return data


def nvfp4(weight: Any) -> dict[str, Any]:
    """ModelOpt NVFP4 of one [out, in] weight: packed E2M1 codes, FP8 block scales (16 inputs
    each) and the per-tensor FP32 second-level scale, so that weight ~= E2M1 x block x global."""
    import torch  # the engine's Python has it; the config alone (tests) is made without

    out, inn = weight.shape
    w = weight.float()
    global_scale = w.abs().max().clamp(min=1e-12) / (6.0 * FP8_MAX)
    groups = w.view(out, inn // GROUP, GROUP)
    block = (groups.abs().amax(-1) / 6.0 / global_scale).clamp(min=2.0**-9, max=FP8_MAX)
    block_fp8 = block.to(torch.float8_e4m3fn)
    scaled = groups / (block_fp8.float() * global_scale).unsqueeze(-1)
    levels = torch.tensor(E2M1)
    index = (scaled.abs().clamp(max=6.0).unsqueeze(-1) - levels).abs().argmin(-1)
    codes = (index | ((scaled < 0).long() << 3)).view(out, inn)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return {
        "weight": packed.contiguous(),
        "weight_scale": block_fp8.contiguous(),
        "weight_scale_2": global_scale.reshape(()).to(torch.float32),
        "input_scale": torch.tensor(1.0 / (6.0 * FP8_MAX), dtype=torch.float32),
    }


def weights(quant: str, seed: int = 0, text_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every tensor vLLM's MiniMaxM3Model.load_weights reads, under the checkpoint's names."""
    import torch  # the engine's Python has it; the config alone (tests) is made without

    c = text_config or TEXT_CONFIG
    gen = torch.Generator().manual_seed(seed)
    hidden, head = c["hidden_size"], c["head_dim"]
    sparse = c["sparse_attention_config"]

    def rand(*shape: int, dtype: Any = torch.bfloat16) -> Any:
        return (torch.randn(*shape, generator=gen) * 0.02).to(dtype)

    def norm(size: int) -> Any:
        return torch.zeros(size, dtype=torch.bfloat16)  # Gemma norm: scale 1 + weight

    t: dict[str, Any] = {
        "model.embed_tokens.weight": rand(c["vocab_size"], hidden),
        "model.norm.weight": norm(hidden),
        "lm_head.weight": rand(c["vocab_size"], hidden),
    }
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        t[f"{p}.input_layernorm.weight"] = norm(hidden)
        t[f"{p}.post_attention_layernorm.weight"] = norm(hidden)
        t[f"{a}.q_proj.weight"] = rand(c["num_attention_heads"] * head, hidden)
        t[f"{a}.k_proj.weight"] = rand(c["num_key_value_heads"] * head, hidden)
        t[f"{a}.v_proj.weight"] = rand(c["num_key_value_heads"] * head, hidden)
        t[f"{a}.o_proj.weight"] = rand(hidden, c["num_attention_heads"] * head)
        t[f"{a}.q_norm.weight"] = norm(head)
        t[f"{a}.k_norm.weight"] = norm(head)
        if sparse["sparse_attention_freq"][i]:
            index = sparse["sparse_index_dim"]
            t[f"{a}.index_q_proj.weight"] = rand(sparse["sparse_num_index_heads"] * index, hidden)
            t[f"{a}.index_k_proj.weight"] = rand(index, hidden)  # one shared index key
            t[f"{a}.index_q_norm.weight"] = norm(index)
            t[f"{a}.index_k_norm.weight"] = norm(index)
        if not c["moe_layer_freq"][i]:
            width = c["dense_intermediate_size"]
            t[f"{p}.mlp.gate_proj.weight"] = rand(width, hidden)
            t[f"{p}.mlp.up_proj.weight"] = rand(width, hidden)
            t[f"{p}.mlp.down_proj.weight"] = rand(hidden, width)
            continue
        m = f"{p}.block_sparse_moe"
        experts, width = c["num_local_experts"], c["intermediate_size"]
        t[f"{m}.gate.weight"] = rand(experts, hidden, dtype=torch.float32)  # the router is FP32
        t[f"{m}.e_score_correction_bias"] = torch.zeros(experts, dtype=torch.float32)
        shared = width * c["n_shared_experts"]
        t[f"{m}.shared_experts.gate_proj.weight"] = rand(shared, hidden)
        t[f"{m}.shared_experts.up_proj.weight"] = rand(shared, hidden)
        t[f"{m}.shared_experts.down_proj.weight"] = rand(hidden, shared)
        for e in range(experts):
            for name, shape in (("w1", (width, hidden)), ("w3", (width, hidden)), ("w2", (hidden, width))):
                w = rand(*shape)
                key = f"{m}.experts.{e}.{name}"
                if quant == "nvfp4":
                    t.update({f"{key}.{k}": v for k, v in nvfp4(w).items()})
                else:
                    t[f"{key}.weight"] = w
    return t


def make(
    directory: Path, quant: str = "nvfp4", heads: int | None = None, kv_heads: int | None = None
) -> dict[str, Any]:
    """Write the checkpoint; return what m31ctl-rehearsal.json says of it. `heads`: query heads
    (8 by default; the real model's 64 keep its 16 query heads per KV head). `kv_heads`: KV heads
    (4 by default, the real model's total; 1 is what each rank holds when the real model runs at
    TP8, since vLLM replicates 4 KV heads over 8 ranks: one GPU then sees the Hopper recipe's
    per-rank attention shapes)."""
    from safetensors.torch import save_file  # type: ignore[import-not-found,unused-ignore]

    text_config = {**TEXT_CONFIG, "num_attention_heads": heads or TEXT_CONFIG["num_attention_heads"]}
    if kv_heads:
        # The index heads follow: vLLM fuses index_q into the QKV projection and shards it like
        # the KV heads (0.26 model_executor/layers/linear.py MinimaxM3QKVParallelLinearWithIndexer
        # asserts total_num_index_heads == total_num_kv_heads; at TP >= 4 a rank holds one of each).
        sparse = {**TEXT_CONFIG["sparse_attention_config"], "sparse_num_index_heads": kv_heads}
        text_config.update(num_key_value_heads=kv_heads, sparse_attention_config=sparse)

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tiny_model.tokenizer(directory, TEXT_CONFIG["vocab_size"], MARKERS, CHAT_TEMPLATE)
    data = config(quant, text_config)
    text = data["text_config"]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        data[key] = text[key] = getattr(tokenizer, key)
    (directory / "config.json").write_text(json.dumps(data, indent=1) + "\n")
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}) + "\n"
    )
    if quant == "nvfp4":
        modelopt = {
            "producer": data["quantization_config"]["producer"],
            "quantization": {
                "quant_algo": "NVFP4",
                "kv_cache_quant_algo": None,
                "group_size": GROUP,
                "exclude_modules": EXCLUDED,
            },
        }
        (directory / "hf_quant_config.json").write_text(json.dumps(modelopt, indent=1) + "\n")
    tensors = weights(quant, text_config=text_config)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    made = {
        "made_by": "m31ctl",
        "model": "MiniMax-M3 (text), tiny",
        "weights": "random",
        "quant": quant,
        "tensors": len(tensors),
        "parameters": sum(int(v.numel()) for v in tensors.values()),
        "bytes": (directory / "model.safetensors").stat().st_size,
    }
    (directory / "m31ctl-rehearsal.json").write_text(json.dumps(made, indent=1) + "\n")
    return made


if __name__ == "__main__":
    import argparse
    import time

    parser = argparse.ArgumentParser(description="Make a tiny MiniMax-M3 checkpoint (random weights).")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--quant", choices=("nvfp4", "bf16"), default="nvfp4")
    parser.add_argument("--heads", type=int, default=None, help="query heads (default 8)")
    parser.add_argument("--kv-heads", type=int, default=None, help="KV heads (default 4; 1: a TP8 rank's)")
    ns = parser.parse_args()
    started = time.monotonic()
    made = make(ns.directory, ns.quant, ns.heads, ns.kv_heads)
    print(json.dumps({**made, "seconds": round(time.monotonic() - started, 1)}))
