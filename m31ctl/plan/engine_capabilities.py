"""What each engine image can run, one table (recipes/engines/capabilities.yaml), and which of it a
plan uses.

A plan that uses something its image lacks is refused (plan/engine_check.py); an image the table
does not know, or an answer it does not know, is a warning naming what cannot be checked. The
table is read here alone: the plan's check, doctor's check of a native engine's vLLM version
(`lacking_in_version`), the engine schema's day-zero names (engine/validate.py) and the generated
docs/engine-rules.md all ask this module, so they cannot read it two ways.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from functools import cache
from typing import Any, NamedTuple

from m31ctl.errors import InputError
from m31ctl.hardware import Hardware, Platform
from m31ctl.plan.catalog import get_model
from m31ctl.plan.parsed import parsed
from m31ctl.plan.rule_context import RuleContext, rule_context
from m31ctl.plan.settings import PlanSettings
from m31ctl.resources import recipes_dir

CAPABILITIES_FILE = "engines/capabilities.yaml"


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
            if matches(engine, pattern):
                return answer
        return None


class CapabilityTable(NamedTuple):
    engines: tuple[Engine, ...]
    capabilities: Mapping[str, Capability]

    def engine_for(self, image: str) -> Engine | None:
        ref = image_reference(image)
        if ref is None:
            return None
        return next((e for e in self.engines if any(matches(ref, p) for p in e.images)), None)


def matches(name: str, pattern: str) -> bool:
    """fnmatch.fnmatchcase(name, pattern), without compiling a regular expression for the table's
    common patterns: one without a wildcard is the name itself, one whose only wildcard is a
    trailing `*` a prefix (`vllm/vllm-openai:v0.32.*`). fnmatch compiled 28 patterns for one
    plan's image, 2 ms of a 0.18 s command."""
    stem, star = (pattern[:-1], True) if pattern.endswith("*") else (pattern, False)
    if any(c in stem for c in "*?["):
        return fnmatch.fnmatchcase(name, pattern)
    return name.startswith(stem) if star else name == stem


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
    # lazy: PyYAML costs start-up, and the memo answers most runs without parsing
    from m31ctl.plan.yamlfile import safe_load

    return safe_load(raw.decode("utf-8"))


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


def lacking_in_version(settings: PlanSettings, hw: Hardware, version: str, platform: str) -> list[str]:
    """What the plan uses that stock vLLM `version` on `platform` lacks, by the capability table
    (doctor asks with the version the engine's Python imported: a native engine's image name
    says nothing of it), each with its source and fallback; [] for a version the table does not
    list."""
    engine = f"vllm-{'.'.join(version.split('.')[:2])}-{platform}"
    table = capability_table()
    if not any(e.id == engine for e in table.engines):
        return []
    ctx = rule_context(settings, hw, get_model(settings.model.id))
    found = []
    for use in capability_uses(ctx):
        capability = table.capabilities[use.capability]
        answer = capability.answer(engine)
        if answer is not None and answer.has is False:
            fallback = f"; {fallback_hint(ctx, capability.fallback)}" if capability.fallback else ""
            found.append(f"{capability.name} ({use.key}={use.value}) [{answer.source}]{fallback}")
    return found


def fallback_hint(ctx: RuleContext, fallback: CapabilityFallback) -> str:
    """`--set KEY=VALUE`, and for the index cache's dtype where its cost is told: the capacity
    model's (m31ctl/capacity/indexer_cost.py), which the plan stage does not import (data flows
    one way: capacity reads plans)."""
    hint = f"--set {fallback.key}={fallback.value} serves without it ({fallback.note})"
    if fallback.key != "cache.indexer_dtype":
        return hint
    return f"{hint}; its cost in KV tokens: m31ctl capacity --set {fallback.key}={fallback.value}"
