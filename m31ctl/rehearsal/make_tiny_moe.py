"""The rehearsal's tiny mixture-of-experts model, for plans with expert parallelism: vLLM refuses
--enable-expert-parallel on a model without experts ("Number of experts in the model must be
greater than 0"), and MiniMax-M3.1-Flash is one. A 2-layer Mixtral with random bf16 weights and
the tiny Llama's tokenizer and geometry (make_tiny_model.py); nothing is downloaded.

Standalone like make_tiny_model.py (it runs in the vLLM environment or inside the image):

    python m31ctl/rehearsal/make_tiny_moe.py DIR [--kv-heads N] [--experts N]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

try:
    from m31ctl.rehearsal import make_tiny_model
except ImportError:  # run as a script inside the image: its directory is there, not the package
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import make_tiny_model  # type: ignore[no-redef,import-not-found,unused-ignore]


def make(directory: Path, kv_heads: int = 4, experts: int = 4) -> None:
    """The tiny Llama first (tokenizer, chat template), then its config and weights replaced by
    a Mixtral of the same geometry: every rank of an expert-parallel group holds experts."""
    # lazy: torch and transformers live in vLLM's Python only
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    make_tiny_model.make(directory, kv_heads)
    geometry = {**make_tiny_model.CONFIG, "num_key_value_heads": kv_heads}
    geometry.pop("tie_word_embeddings")
    torch.manual_seed(0)
    llama = json.loads((directory / "config.json").read_text())
    config = MixtralConfig(
        **geometry,
        num_local_experts=experts,
        num_experts_per_tok=2,
        tie_word_embeddings=False,
        bos_token_id=llama.get("bos_token_id"),
        eos_token_id=llama.get("eos_token_id"),
        pad_token_id=llama.get("pad_token_id"),
        torch_dtype="bfloat16",
    )
    for stale in directory.glob("model*.safetensors*"):
        stale.unlink()
    MixtralForCausalLM(config).to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    (directory / "m31ctl-rehearsal.json").write_text(
        json.dumps({"made_by": "m31ctl", "experts": experts, **geometry}, indent=1) + "\n"
    )


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Make the CPU rehearsal's tiny MoE model.")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--kv-heads", type=int, default=4, choices=(1, 2, 4))
    parser.add_argument("--experts", type=int, default=4, choices=(2, 4, 8))
    ns = parser.parse_args()
    make(ns.directory, ns.kv_heads, ns.experts)
    print(f"tiny MoE model written to {ns.directory}")
