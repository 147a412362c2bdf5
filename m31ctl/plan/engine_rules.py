"""The engine's own rules and the engine image's capabilities, checked when a plan is resolved.

vLLM checks much of a configuration only when it builds its engine config, minutes into a start
and after the download: tensor and decode-context parallelism against the model's heads, the
context length against the checkpoint's positions, the attention and speculative configs, what
the MiniMax-M3 model code accepts. Each rule here mirrors one such check and names the vLLM
source it mirrors (`ENGINE_RULES`). What each engine image can run at all is one table,
recipes/engines/capabilities.yaml: a plan that uses something its image lacks is refused, an
image the table does not know (or an answer it does not know) is a warning naming what cannot be
checked.

Model facts (heads, positions, RoPE scaling, the MSA block size, the DSpark draft's block size)
come from the checkpoint's own config.json when it is on this host (model.path a directory, or
the Hugging Face cache under runtime.hf_cache), else from recipes/models.yaml with their sources.
docs/engine-rules.md is generated from this module and the table (scripts/gen-constraints).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Callable, Mapping
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

from m31ctl import vllm_argv as argv
from m31ctl.checkpoint import cached_snapshot, host_path, model_source
from m31ctl.errors import InputError, RuleViolation
from m31ctl.hardware import Hardware, Platform, vendor_facts
from m31ctl.plan.catalog import ModelFacts, get_model
from m31ctl.plan.layers import Layer
from m31ctl.plan.parsed import parsed
from m31ctl.plan.runtime_shapes import RUNTIME_RULES
from m31ctl.plan.settings import PlanSettings
from m31ctl.resources import recipes_dir

CAPABILITIES_FILE = "engines/capabilities.yaml"
_ALLOW_LONG = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"
# RoPE types whose factor vLLM does not apply to max_position_embeddings (vllm/config/model.py
# _get_and_verify_max_len: "YaRN variants leave max_position_embeddings already scaled").
_UNSCALED_ROPE = {"su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling"}
# Hugging Face's "no limit" sentinel for tokenizer model_max_length.
_NO_TOKENIZER_LIMIT = 10**20


# --- the capability table --------------------------------------------------------------------


class CapabilityAnswer(NamedTuple):
    has: bool | str  # True, False, "claimed" or "unknown"
    source: str


class Engine(NamedTuple):
    id: str
    description: str
    platform: Platform
    vllm: str
    images: tuple[str, ...]


class CapabilityFallback(NamedTuple):
    """The setting that serves without a capability an engine lacks, and why it is one."""

    key: str
    value: Any
    note: str


class Capability(NamedTuple):
    id: str
    name: str
    engines: tuple[tuple[str, CapabilityAnswer], ...]  # (engine pattern, answer), first match answers
    fallback: CapabilityFallback | None = None

    def answer(self, engine: str) -> CapabilityAnswer | None:
        for pattern, answer in self.engines:
            if fnmatch.fnmatchcase(engine, pattern):
                return answer
        return None


class CapabilityTable(NamedTuple):
    engines: tuple[Engine, ...]
    capabilities: Mapping[str, Capability]

    def engine_for(self, image: str) -> Engine | None:
        ref = image_reference(image)
        if ref is None:
            return None
        return next((e for e in self.engines if any(fnmatch.fnmatchcase(ref, p) for p in e.images)), None)


def image_reference(image: str) -> str | None:
    """`name:tag` as the table spells it (Docker Hub's host and library/ dropped), or None when the
    image is named by digest alone (which engine it is cannot be told from its name)."""
    name = image.strip()
    for prefix in ("docker.io/", "index.docker.io/", "registry-1.docker.io/"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    name = name.removeprefix("library/")
    name, _, _digest = name.partition("@")
    if ":" not in name.rsplit("/", 1)[-1]:
        return None if _digest else f"{name}:latest"
    return name


def _parse_table(raw: bytes) -> Any:
    import yaml  # lazy: PyYAML costs start-up, and the memo answers most runs without parsing

    return yaml.safe_load(raw.decode("utf-8"))


def _answer(data: Any, where: str) -> CapabilityAnswer:
    if not isinstance(data, dict) or "has" not in data or len(str(data.get("source") or "")) < 8:
        raise InputError("every answer needs `has` and a `source`", where=where)
    has = data["has"]
    if has not in (True, False, "claimed", "unknown"):
        raise InputError(f"has: {has!r} must be true, false, claimed or unknown", where=where)
    return CapabilityAnswer(has, " ".join(str(data["source"]).split()))


def _fallback(data: Any, where: str) -> CapabilityFallback | None:
    if data is None:
        return None
    if not isinstance(data, dict) or not {"key", "value", "note"} <= set(data):
        raise InputError("a fallback needs `key`, `value` and `note`", where=where)
    return CapabilityFallback(str(data["key"]), data["value"], " ".join(str(data["note"]).split()))


def _platform(value: Any, where: str) -> Platform:
    try:
        return Platform(value)
    except ValueError:
        names = ", ".join(p.value for p in Platform)
        raise InputError(f"platform: {value!r} must be one of {names}", where=where) from None


@cache
def capability_table() -> CapabilityTable:
    path = recipes_dir() / CAPABILITIES_FILE
    data = parsed(path, _parse_table)
    where = f"recipes/{CAPABILITIES_FILE}"
    engines = tuple(
        Engine(
            id=name,
            description=str(entry["description"]),
            platform=_platform(entry.get("platform"), f"{where} engines.{name}.platform"),
            vllm=str(entry["vllm"]),
            images=tuple(entry["images"]),
        )
        for name, entry in data["engines"].items()
    )
    capabilities = {
        cap_id: Capability(
            cap_id,
            " ".join(str(entry["name"]).split()),
            tuple((p, _answer(a, f"{where}: {cap_id}.{p}")) for p, a in entry["engines"].items()),
            _fallback(entry.get("fallback"), f"{where}: {cap_id}.fallback"),
        )
        for cap_id, entry in data["capabilities"].items()
    }
    return CapabilityTable(engines, capabilities)


# --- model facts -----------------------------------------------------------------------------


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
    sparse_block = (
        fact("sparse_block_size", sparse, f"{src} sparse_attention_config")
        if isinstance(sparse, dict) and sparse.get("use_sparse_attention", True)
        else None
    )
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
        draft_block_size=draft,
        nested_text_config=nested,
        config=src,
        draft_unknown=draft_unknown,
    )


# --- what the plan asks of the engine ----------------------------------------------------------


def _switch(args: tuple[str, ...], *names: str) -> bool:
    groups = dict.fromkeys(names, names[0])
    return any(True for _ in argv.occurrences(args, groups, ()))


class RuleContext(NamedTuple):
    settings: PlanSettings
    hardware: Hardware
    model: ModelFacts
    facts: CheckpointFacts
    hf_overrides: dict[str, Any]
    monokernel: bool

    @property
    def platform(self) -> Platform:
        # The vendor's platform (hardware.VENDORS): CUDA, ROCm, or the CPU build (a GPU-less host too).
        return vendor_facts(self.hardware.vendor).platform

    @property
    def env(self) -> Mapping[str, str]:
        return self.settings.runtime.env

    @property
    def indexer_cp(self) -> bool:
        return self.settings.cache.indexer_context_parallel

    @property
    def minimax_m3(self) -> bool:
        """A MiniMax Sparse Attention model (the checkpoint states an MSA block size)."""
        return self.facts.sparse_block_size is not None


def _context(settings: PlanSettings, hw: Hardware, model: ModelFacts) -> RuleContext:
    extra = settings.engine.extra_args
    return RuleContext(
        settings=settings,
        hardware=hw,
        model=model,
        facts=checkpoint_facts(settings, model),
        hf_overrides=argv.json_config(extra, "--hf-overrides"),
        monokernel=_switch(extra, "--monokernel") and not _switch(extra, "--no-monokernel"),
    )


# --- the engine's semantic rules ----------------------------------------------------------------


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
)


# --- capabilities the plan uses ------------------------------------------------------------------


class Use(NamedTuple):
    capability: str
    key: str
    value: Any


def capability_uses(ctx: RuleContext) -> list[Use]:
    """Which capabilities of the table the plan uses, and the setting that uses each."""
    s = ctx.settings
    uses: list[Use] = []
    for key, backend in (
        ("attention_backend", s.attention_backend),
        ("speculative.draft_attention_backend", s.speculative.draft_attention_backend),
    ):
        if backend == "FLASHINFER_TS":
            uses.append(Use("flashinfer_ts", key, backend))
    if s.speculative.draft_attention_backend == "FLASHINFER_TS" and s.cache.kv_dtype == "nvfp4":
        uses.append(Use("flashinfer_ts_nvfp4_draft", "speculative.draft_attention_backend", "FLASHINFER_TS"))
    if ctx.minimax_m3 and s.cache.indexer_dtype == "nvfp4":
        uses.append(Use("nvfp4_indexer_cache", "cache.indexer_dtype", "nvfp4"))
    # MiniMax-M3 on a CUDA GPU outside SM10x runs its Triton kernels, not SM10x's MSA ones.
    triton_m3 = (
        ctx.minimax_m3 and ctx.platform is Platform.CUDA and (ctx.hardware.arch or "").split(".")[0] != "10"
    )
    # An FP8 index cache runs on SM10x's MSA indexer in every release, elsewhere on the Triton
    # indexer, which takes FP8 from vLLM 0.32 on (common/indexer.py select_indexer_impl_cls).
    if triton_m3 and s.cache.indexer_dtype in ("fp8", "fp8_e4m3"):
        uses.append(Use("fp8_indexer_cache_off_sm100", "cache.indexer_dtype", s.cache.indexer_dtype))
    # The main cache of the sparse layers, off SM10x: the Triton sparse-attention kernel
    # (common/sparse_attention.py select_main_backend_and_impl_cls), whose FP8 path vLLM 0.26
    # was seen crashing on on the H200.
    if triton_m3 and s.cache.kv_dtype in ("fp8", "fp8_e4m3"):
        uses.append(Use("fp8_kv_cache_sparse_off_sm100", "cache.kv_dtype", s.cache.kv_dtype))
    if s.cache.kv_dtype == "nvfp4":
        uses.append(Use("nvfp4_kv_cache", "cache.kv_dtype", "nvfp4"))
        for key, backend in (
            ("attention_backend", s.attention_backend),
            ("speculative.draft_attention_backend", s.speculative.draft_attention_backend),
        ):
            if backend == "TRITON_ATTN":
                uses.append(Use("triton_attn_nvfp4", key, backend))
                break
    if s.moe.backend == "aiter" and ctx.model.expert_weights == "nvfp4":
        uses.append(Use("aiter_nvfp4_moe", "moe.backend", "aiter"))
    if s.moe.backend in ("deep_gemm_mega_moe", "aiter_mega_moe") and ctx.minimax_m3:
        uses.append(Use("mega_moe", "moe.backend", s.moe.backend))
    if ctx.indexer_cp:
        uses.append(Use("indexer_context_parallel", "cache.indexer_context_parallel", True))
    if ctx.monokernel:
        uses.append(Use("monokernel", "engine.extra_args", "--monokernel"))
    if s.speculative.method == "dspark" and ctx.minimax_m3:
        uses.append(Use("dspark_minimax_m3", "speculative.method", "dspark"))
    return uses


# --- the check -----------------------------------------------------------------------------------


def _culprit(merged: Layer, key: str) -> str:
    setting = merged.get(key)
    return str(setting.source) if setting else "schema default"


def _value(ctx: RuleContext, key: str) -> Any:
    node: Any = ctx.settings.model_dump(mode="json")
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def check_engine(settings: PlanSettings, merged: Layer, hw: Hardware) -> tuple[str, ...]:
    """Refuse (RuleViolation, exit 2) a plan the engine would refuse or its image cannot run;
    return warnings for what cannot be checked. `merged` names the layer that set each value."""
    ctx = _context(settings, hw, get_model(settings.model.id))
    for rule in ENGINE_RULES:
        why = rule.check(ctx)
        if why:
            raise RuleViolation(
                f"{rule.key}={_value(ctx, rule.key)!r} breaks engine rule {rule.id!r}: {why} [{rule.source}]",
                where=_culprit(merged, rule.key),
                hint=f"change {rule.key}, or the settings it depends on",
            )
    warnings = _capability_check(ctx, merged)
    if settings.speculative.method == "dspark" and ctx.minimax_m3 and ctx.facts.draft_block_size is None:
        warnings.append(
            f"speculative.tokens={settings.speculative.tokens} is not checked against the DSpark draft's "
            f"block size: {ctx.facts.draft_unknown}"
        )
    return tuple(warnings)


def _capability_check(ctx: RuleContext, merged: Layer) -> list[str]:
    image = ctx.settings.engine.image
    table = capability_table()
    engine = table.engine_for(image)
    uses = capability_uses(ctx)
    gpu = vendor_facts(ctx.hardware.vendor).gpus
    if engine is None:
        if not uses and not gpu:
            return []
        named = [table.capabilities[u.capability].name for u in uses]
        if gpu:
            named.insert(0, f"a {ctx.platform.title} build")
        return [
            f"engine.image={image} is not in m31ctl's engine capability table (recipes/{CAPABILITIES_FILE}): "
            f"cannot check that it has {', '.join(named)}"
        ]
    label = f"{image} ({engine.description})"
    missing: list[str] = []
    fallbacks: list[str] = []
    if engine.platform is not ctx.platform:
        missing.append(
            f"a {ctx.platform.title} build for this host's "
            f"{ctx.hardware.vendor} GPUs: it is a {engine.platform.title} "
            f"build [recipes/{CAPABILITIES_FILE} engines.{engine.id}]"
        )
    unknown: list[str] = []
    for use in uses:
        capability = table.capabilities[use.capability]
        answer = capability.answer(engine.id)
        if answer is None or answer.has == "unknown":
            unknown.append(capability.name)
        elif answer.has is False:
            missing.append(f"{capability.name} ({use.key}={use.value}) [{answer.source}]")
            if capability.fallback is not None:
                fallbacks.append(_fallback_hint(ctx, capability.fallback))
    if missing:
        raise RuleViolation(
            f"engine.image={label} lacks what the plan uses: " + "; ".join(missing),
            where=_culprit(merged, "engine.image"),
            hint="; ".join(
                [*fallbacks, "or use an image that has them (recipes/engines/capabilities.yaml)"]
                if fallbacks
                else [
                    "use an image that has them (recipes/engines/capabilities.yaml), or change those settings"
                ]
            ),
        )
    if unknown:
        return [f"engine.image={label}: unknown whether it has {', '.join(unknown)}; not checked"]
    return []


def lacking_in_version(settings: PlanSettings, hw: Hardware, version: str, platform: str) -> list[str]:
    """What the plan uses that stock vLLM `version` on `platform` lacks, by the capability table
    (doctor asks with the version the engine's Python imported: a native engine's image name
    says nothing of it), each with its source and fallback; [] for a version the table does not
    list."""
    engine = f"vllm-{'.'.join(version.split('.')[:2])}-{platform}"
    table = capability_table()
    if not any(e.id == engine for e in table.engines):
        return []
    ctx = _context(settings, hw, get_model(settings.model.id))
    found = []
    for use in capability_uses(ctx):
        capability = table.capabilities[use.capability]
        answer = capability.answer(engine)
        if answer is not None and answer.has is False:
            fallback = f"; {_fallback_hint(ctx, capability.fallback)}" if capability.fallback else ""
            found.append(f"{capability.name} ({use.key}={use.value}) [{answer.source}]{fallback}")
    return found


def _fallback_hint(ctx: RuleContext, fallback: CapabilityFallback) -> str:
    """`--set KEY=VALUE`, and for the index cache's dtype where its cost is told: the capacity
    model's (m31ctl/capacity/indexer_cost.py), which the plan stage does not import (data flows
    one way: capacity reads plans)."""
    hint = f"--set {fallback.key}={fallback.value} serves without it ({fallback.note})"
    if fallback.key != "cache.indexer_dtype":
        return hint
    return f"{hint}; its cost in KV tokens: m31ctl capacity --set {fallback.key}={fallback.value}"


# --- the generated reference (docs/engine-rules.md) ----------------------------------------------


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def engine_rules_markdown() -> str:
    table = capability_table()
    lines = [
        "# Engine rules and capabilities",
        "",
        "Generated from `m31ctl/plan/engine_rules.py` and `recipes/engines/capabilities.yaml` by",
        "`scripts/gen-constraints`; do not edit. Checked when a plan is resolved: a plan that breaks a",
        "rule, or uses a capability its engine image lacks, is refused (exit 2) naming the setting, the",
        "image and the source; an image the table does not list, or an `unknown` answer, is a warning.",
        "Model facts come from the checkpoint's config.json when it is on this host (model.path, or the",
        "Hugging Face cache under runtime.hf_cache), else `recipes/models.yaml`.",
        "",
        "## Rules",
        "",
        "| rule | setting | must | mirrors |",
        "| --- | --- | --- | --- |",
    ]
    for rule in ENGINE_RULES:
        lines.append(f"| {rule.id} | `{rule.key}` | {_cell(rule.summary)} | {_cell(rule.source)} |")
    lines += [
        "",
        "## Runtime shapes",
        "",
        "Limits vLLM meets only under load, and the MoE layout it builds (m31ctl/plan/runtime_shapes.py):",
        "set or refused before launch, or stated as a warning.",
        "",
        "| rule | setting | must | source |",
        "| --- | --- | --- | --- |",
    ]
    for shape in RUNTIME_RULES:
        lines.append(f"| {shape.id} | `{shape.key}` | {_cell(shape.summary)} | {_cell(shape.source)} |")
    lines += [
        "",
        "## Engine images",
        "",
        "| engine | platform | vLLM base | images |",
        "| --- | --- | --- | --- |",
    ]
    for engine in table.engines:
        images = ", ".join(f"`{i}`" for i in engine.images)
        lines.append(
            f"| {engine.id} ({_cell(engine.description)}) | {engine.platform.value} | {engine.vllm} | {images} |"
        )
    lines += ["", "## Capabilities", "", "`claimed`: the launch post says so, no code seen.", ""]
    for capability in table.capabilities.values():
        lines += [
            f"### {capability.id}: {capability.name}",
            "",
            "| engine | has | source |",
            "| --- | --- | --- |",
        ]
        for engine in table.engines:
            answer = capability.answer(engine.id)
            has = "unknown" if answer is None else str(answer.has).lower()
            source = answer.source if answer else ""
            lines.append(f"| {engine.id} | {has} | {_cell(source)} |")
        lines.append("")
    return "\n".join(lines)
