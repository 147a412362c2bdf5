"""A model's KV geometry: from recipes/models.yaml, or from a local checkpoint's config.json.

A local model directory (model.path holding a config.json) is sized from its own config, as vLLM
sizes it: this is how the CPU rehearsal's generated model, or a local mirror of a MiniMax
checkpoint, gets the geometry the engine will see.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from m31ctl.capacity.model import Geometry
from m31ctl.errors import InputError
from m31ctl.inputs import read_text
from m31ctl.plan.recipes import ModelFacts

# Hugging Face torch_dtype spellings -> cache dtype names.
_TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def facts_geometry(model: ModelFacts) -> Geometry:
    g = model.geometry
    return Geometry(
        layers=int(g.layers.value),
        kv_heads=int(g.kv_heads.value),
        head_dim=int(g.head_dim.value),
        dtype=str(g.dtype.value),
        sparse_layers=int(g.sparse_layers.value) if g.sparse_layers else 0,
        indexer_dim=int(g.indexer_dim.value) if g.indexer_dim else 0,
    )


def local_config(directory: str | None) -> Path | None:
    """The config.json of a local model directory (the Deployment's absolute host path), or None
    for a hub repo id or a directory without one."""
    if directory is None:
        return None
    config = Path(directory) / "config.json"
    return config if config.is_file() else None


def config_geometry(config: Path) -> Geometry:
    """Geometry from a Hugging Face config.json (text_config for multimodal models)."""
    try:
        data = json.loads(read_text(config, "model config"))
    except ValueError as exc:
        raise InputError(f"{config} is not valid JSON: {exc}", where=str(config)) from None
    text: dict[str, Any] = data.get("text_config") or data
    try:
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        layers = int(text["num_hidden_layers"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(
            f"{config} lacks the attention geometry ({exc})",
            where=str(config),
            hint="num_hidden_layers, num_attention_heads and hidden_size or head_dim are needed",
        ) from None
    dtype_name = str(text.get("torch_dtype") or data.get("torch_dtype") or "bfloat16")
    sparse = text.get("sparse_attention_config") or {}
    use_sparse = bool(sparse) and bool(sparse.get("use_sparse_attention", True))
    return Geometry(
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=_TORCH_DTYPES.get(dtype_name, "bf16"),
        # MiniMax-M3's config: which layers are sparse, and the indexer's key size.
        sparse_layers=sum(1 for flag in sparse.get("sparse_attention_freq", ()) if flag) if use_sparse else 0,
        indexer_dim=int(sparse.get("sparse_index_dim", 0)) if use_sparse else 0,
    )


def checkpoint_bytes(directory: Path) -> int:
    """Bytes of the weight files in a local model directory."""
    return sum(p.stat().st_size for p in directory.glob("*.safetensors")) or sum(
        p.stat().st_size for p in directory.glob("*.bin")
    )
