"""The model facts vLLM reads from the checkpoint when it builds its config, read as it reads them.

Heads, positions, the tokenizer's limit, RoPE scaling, the MSA block size and the DSpark draft's
block size come from the checkpoint's own config.json when it is on this host (model.path a
directory, or the Hugging Face cache under runtime.hf_cache), else from recipes/models.yaml with
their sources: the engine rules (plan/engine_rules.py) then check a plan against what the engine
will see, and the capacity model (capacity/indexer_cost.py) finds the same checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

from m31ctl.checkpoint import cached_snapshot, host_path, model_source
from m31ctl.errors import InputError
from m31ctl.plan.catalog import ModelFacts
from m31ctl.plan.settings import PlanSettings

# Hugging Face's "no limit" sentinel for tokenizer model_max_length.
_NO_TOKENIZER_LIMIT = 10**20


class Fact(NamedTuple):
    value: int
    source: str


class RopeScaling(NamedTuple):
    rope_type: str
    factor: float
    original: int | None  # original_max_position_embeddings
    source: str

    @property
    def reach(self) -> int | None:
        """The positions the scaling covers (factor x original), when it says."""
        return int(self.factor * self.original) if self.original else None


class CheckpointFacts(NamedTuple):
    """What vLLM reads from the checkpoint when it builds its config."""

    kv_heads: Fact
    attention_heads: Fact | None
    max_positions: Fact | None
    tokenizer_max: Fact | None
    rope: RopeScaling | None
    sparse_block_size: Fact | None  # MSA sparse attention: a MiniMax-M3 model
    draft_block_size: Fact | None
    nested_text_config: bool  # the decoder's config sits under text_config
    config: str | None  # the config.json read; None: recipes/models.yaml
    draft_unknown: str = ""  # why draft_block_size is None
    sparse_topk_blocks: Fact | None = None  # MSA: the blocks the indexer selects per query

    @property
    def sparse_window(self) -> Fact | None:
        """The tokens a sparse layer attends to whole (sparse_topk_blocks x sparse_block_size:
        2,048 for MiniMax-M3): below it the indexer selects every block, so what its key cache
        holds decides nothing. None: no MSA sparse attention, or no top-k stated."""
        block, topk = self.sparse_block_size, self.sparse_topk_blocks
        if block is None or topk is None:
            return None
        return Fact(block.value * topk.value, f"{topk.source} x {block.source}")


def checkpoint_dir(settings: PlanSettings) -> tuple[Path | None, str]:
    """The checkpoint's directory on this host (holding its config.json), or None; and where it
    was looked for. model.path and the cache are read as the Deployment reads them."""
    source = model_source(settings.model.path)
    if source.host_path is not None:
        local = Path(source.host_path)
        return (local if (local / "config.json").is_file() else None), str(local)
    snapshot = cached_snapshot(host_path(settings.runtime.hf_cache, "runtime.hf_cache"), source.reference)
    if snapshot is not None and (snapshot / "config.json").is_file():
        return snapshot, str(snapshot)
    return None, f"{source.reference} in the Hugging Face cache {settings.runtime.hf_cache}"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise InputError(f"cannot read {path}: {exc}", where=str(path)) from None
    if not isinstance(data, dict):
        raise InputError(f"{path} is not a JSON object", where=str(path))
    return data


def _int(value: Any) -> int | None:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def rope_scaling(rope: Any, source: str) -> RopeScaling | None:
    """A config's rope_scaling (or rope_parameters) when it scales; None for none or "default"."""
    if not isinstance(rope, dict):
        return None
    if "rope_type" not in rope and "type" not in rope:  # rope_parameters keyed by layer type
        found = [r for r in (rope_scaling(v, source) for v in rope.values()) if r]
        return found[0] if found else None
    kind = str(rope.get("rope_type") or rope.get("type"))
    factor = rope.get("factor")
    if kind == "default" or not isinstance(factor, (int, float)):
        return None
    return RopeScaling(kind, float(factor), _int(rope.get("original_max_position_embeddings")), source)


def checkpoint_facts(settings: PlanSettings, model: ModelFacts) -> CheckpointFacts:
    """From the checkpoint's config.json when it is on this host, else recipes/models.yaml."""
    directory, looked = checkpoint_dir(settings)
    limits, geometry = model.limits, model.geometry
    yaml_src = "recipes/models.yaml: "
    kv_heads = Fact(int(geometry.kv_heads.value), yaml_src + geometry.kv_heads.source)

    def from_yaml(item: Any) -> Fact | None:
        return Fact(int(item.value), yaml_src + item.source) if item is not None else None

    if directory is None:
        why = (
            f"the checkpoint's dspark/config.json is not on this host (looked for {looked}); "
            "it is checked once the checkpoint is there"
        )
        published = from_yaml(limits.draft_block_size)
        return CheckpointFacts(
            kv_heads=kv_heads,
            attention_heads=from_yaml(limits.attention_heads),
            max_positions=from_yaml(limits.max_position_embeddings),
            tokenizer_max=None,
            rope=None,
            sparse_block_size=from_yaml(limits.sparse_block_size),
            sparse_topk_blocks=from_yaml(limits.sparse_topk_blocks),
            draft_block_size=published,
            nested_text_config=limits.sparse_block_size is not None,  # MiniMax-M3 nests text_config
            config=None,
            draft_unknown="" if published else why,
        )
    config = directory / "config.json"
    data = _read_json(config)
    nested = isinstance(data.get("text_config"), dict)
    text: dict[str, Any] = data["text_config"] if nested else data
    src = str(config)

    def fact(name: str, node: Mapping[str, Any] = text, where: str = src) -> Fact | None:
        value = _int(node.get(name))
        return Fact(value, f"{where} {name}") if value is not None else None

    heads = fact("num_attention_heads")
    kv = fact("num_key_value_heads") or heads or kv_heads
    sparse = text.get("sparse_attention_config") or {}
    msa = isinstance(sparse, dict) and sparse.get("use_sparse_attention", True)
    sparse_block = fact("sparse_block_size", sparse, f"{src} sparse_attention_config") if msa else None
    sparse_topk = fact("sparse_topk_blocks", sparse, f"{src} sparse_attention_config") if msa else None
    tokenizer = directory / "tokenizer_config.json"
    tok_max = fact("model_max_length", _read_json(tokenizer), str(tokenizer)) if tokenizer.is_file() else None
    if tok_max is not None and tok_max.value >= _NO_TOKENIZER_LIMIT:
        tok_max = None
    draft_config = directory / "dspark" / "config.json"
    draft: Fact | None = None
    draft_unknown = ""
    if draft_config.is_file():
        draft_data = _read_json(draft_config)
        draft = fact("block_size", draft_data, str(draft_config)) or fact(
            "dspark_block_size", draft_data, str(draft_config)
        )
        if draft is None:
            draft_unknown = f"{draft_config} states no block_size or dspark_block_size"
    else:
        draft_unknown = f"{draft_config} is not on this host"
    rope = rope_scaling(text.get("rope_scaling") or text.get("rope_parameters"), f"{src} rope_scaling")
    return CheckpointFacts(
        kv_heads=kv,
        attention_heads=heads,
        max_positions=fact("max_position_embeddings"),
        tokenizer_max=tok_max,
        rope=rope,
        sparse_block_size=sparse_block,
        sparse_topk_blocks=sparse_topk,
        draft_block_size=draft,
        nested_text_config=nested,
        config=src,
        draft_unknown=draft_unknown,
    )
