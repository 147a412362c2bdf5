"""Make the CPU rehearsal's tiny model on the spot: a 2-layer Llama with random bf16 weights
and a small byte-level BPE tokenizer with a chat template. Nothing is downloaded.

Standalone (torch, transformers and tokenizers, which vLLM brings), so it runs in the vLLM
environment or inside the rehearsal image:

    python m31ctl/rehearsal/make_tiny_model.py DIR
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# head_dim 64: vLLM's CPU attention kernel rejects 16 (vllm-engine-facts.md).
CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "vocab_size": 512,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def corpus() -> list[str]:
    words = [
        "the",
        "model",
        "serves",
        "tokens",
        "on",
        "four",
        "GPUs",
        "with",
        "sparse",
        "attention",
        "and",
        "a",
        "speculative",
        "draft;",
        "hello",
        "world,",
        "how",
        "are",
        "you",
        "today?",
        "I",
        "am",
        "a",
        "tiny",
        "rehearsal",
        "model",
        "made",
        "for",
        "m31ctl",
        "tests.",
        "0123456789",
        "abcdefghijklmnopqrstuvwxyz",
        "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
        ".,;:!?'\"()[]{}",
    ]
    return [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 4


def tokenizer(
    directory: Path, vocab_size: int, markers: Sequence[str] = (), chat_template: str = CHAT_TEMPLATE
) -> Any:
    """Train the byte-level BPE tokenizer on corpus(), add `markers` as whole (not special)
    entries, save it with the chat template into `directory` and return it. With markers, the
    vocabulary is padded with unused entries up to vocab_size, so every id a model of that
    vocabulary can sample decodes."""
    # the engine's Python has them; importing this module for its CONFIG needs neither
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(markers),
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus(), trainer=trainer)
    if markers:
        bpe.add_tokens([AddedToken(m, normalized=False, special=False) for m in markers])
        bpe.add_special_tokens([f"<|unused_{i}|>" for i in range(vocab_size - bpe.get_vocab_size())])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>", eos_token="<|end|>", pad_token="</s>"
    )
    fast.chat_template = chat_template
    fast.save_pretrained(directory)
    return fast


def make(directory: Path, kv_heads: int = 4) -> None:
    """kv_heads below the tensor-parallel size makes vLLM replicate KV heads across ranks (the
    capacity model's replication case); the default matches the rehearsal recipe."""
    # lazy: torch and friends live in vLLM's Python only; CONFIG is read without them
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = tokenizer(directory, int(CONFIG["vocab_size"]))

    torch.manual_seed(0)
    geometry = {**CONFIG, "num_key_value_heads": kv_heads}
    config = LlamaConfig(
        **geometry,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "m31ctl-rehearsal.json").write_text(
        json.dumps({"made_by": "m31ctl", **geometry}, indent=1) + "\n"
    )


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Make the CPU rehearsal's tiny model.")
    parser.add_argument("directory", type=Path)
    parser.add_argument("--kv-heads", type=int, default=4, choices=(1, 2, 4))
    ns = parser.parse_args()
    make(ns.directory, ns.kv_heads)
    print(f"tiny model written to {ns.directory}")
