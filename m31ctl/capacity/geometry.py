"""A model's KV geometry: from recipes/models.yaml, or from a local checkpoint's config.json.

A local model directory (model.path holding a config.json) is sized from its own config, as vLLM
sizes it: this is how the CPU rehearsal's generated model, or a local mirror of a MiniMax
checkpoint, gets the geometry the engine will see.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from m31ctl.capacity.memory import Geometry, GeometryOrigin
from m31ctl.errors import InputError
from m31ctl.inputs import read_text
from m31ctl.plan.catalog import ModelFacts

# Hugging Face torch_dtype spellings -> cache dtype names.
_TORCH_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def facts_geometry(model: ModelFacts) -> Geometry:
    g = model.geometry

    def count(fact: Any) -> int:
        return int(fact.value) if fact is not None else 0

    origin = GeometryOrigin(model.display_name, g.name, "recipes/models.yaml", tuple(g.unpublished()))
    return Geometry(
        layers=int(g.layers.value),
        kv_heads=int(g.kv_heads.value),
        head_dim=int(g.head_dim.value),
        dtype=str(g.dtype.value),
        sparse_layers=count(g.sparse_layers),
        indexer_dim=count(g.indexer_dim),
        draft_layers=count(g.draft_layers),
        draft_kv_heads=count(g.draft_kv_heads),
        draft_head_dim=count(g.draft_head_dim),
        origin=origin,
    )


def local_config(directory: str | None) -> Path | None:
    """The config.json of a local model directory (the Deployment's absolute host path), or None
    for a hub repo id or a directory without one."""
    if directory is None:
        return None
    config = Path(directory) / "config.json"
    return config if config.is_file() else None


def config_geometry(config: Path, model: str = "") -> Geometry:
    """Geometry from a Hugging Face config.json (text_config for multimodal models); `model`
    names whose checkpoint it is."""
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
    draft = _draft_geometry(config.parent / "dspark" / "config.json")
    return Geometry(
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=_TORCH_DTYPES.get(dtype_name, "bf16"),
        # MiniMax-M3's config: which layers are sparse, and the indexer's key size.
        sparse_layers=sum(1 for flag in sparse.get("sparse_attention_freq", ()) if flag) if use_sparse else 0,
        indexer_dim=int(sparse.get("sparse_index_dim", 0)) if use_sparse else 0,
        draft_layers=draft[0],
        draft_kv_heads=draft[1],
        draft_head_dim=draft[2],
        origin=GeometryOrigin(model, "the checkpoint's own", str(config)),
    )


def _draft_geometry(config: Path) -> tuple[int, int, int]:
    """The DSpark draft's KV geometry from its dspark/config.json (layers, KV heads, head size);
    zeros when the draft is not there or does not say."""
    if not config.is_file():
        return 0, 0, 0
    try:
        data = json.loads(read_text(config, "draft config"))
        text: dict[str, Any] = data.get("text_config") or data
        heads = int(text["num_attention_heads"])
        return (
            int(text["num_hidden_layers"]),
            int(text.get("num_key_value_heads") or heads),
            int(text.get("head_dim") or int(text["hidden_size"]) // heads),
        )
    except (ValueError, KeyError, TypeError):
        return 0, 0, 0


# Routed experts' tensors in a Hugging Face MoE checkpoint (Mixtral's block_sparse_moe.experts.N,
# MiniMax's and DeepSeek's mlp.experts.N); a shared expert is a dense MLP, sharded like one.
_EXPERT_TENSOR = re.compile(r"\.experts\.\d+\.")
_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors caps its JSON header at 100 MB


def checkpoint_weights(directory: Path) -> tuple[int, int]:
    """(dense, routed expert) bytes of a local checkpoint's safetensors files, read from each
    file's header (tensor names and offsets; no weights are read). A .bin checkpoint or an
    unreadable header counts as dense."""
    dense = experts = 0
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return checkpoint_bytes(directory), 0
    for path in files:
        try:
            with path.open("rb") as handle:
                size = int.from_bytes(handle.read(8), "little")
                header = json.loads(handle.read(size)) if 0 < size <= _HEADER_LIMIT else None
        except (OSError, ValueError):
            header = None
        if not isinstance(header, dict):
            dense += path.stat().st_size
            continue
        for name, entry in header.items():
            if name == "__metadata__" or not isinstance(entry, dict):
                continue
            start, end = entry.get("data_offsets", (0, 0))
            if _EXPERT_TENSOR.search(name) and "shared_expert" not in name:
                experts += end - start
            else:
                dense += end - start
    return dense, experts


def checkpoint_bytes(directory: Path) -> int:
    """Bytes of the weight files in a local model directory."""
    return sum(p.stat().st_size for p in directory.glob("*.safetensors")) or sum(
        p.stat().st_size for p in directory.glob("*.bin")
    )
