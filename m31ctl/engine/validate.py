"""Check the adapter's argv and environment against the engine's own schema, without vLLM.

The schema is what an installed vLLM accepts (extract_schema.py), plus the day-zero image's
declared extensions. vLLM itself accepts prefixes and checks backend names, parser names and
JSON keys only at engine start-up, minutes into a load; this finds those mistakes in
milliseconds.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any, NamedTuple

from m31ctl import vllm_argv as argv
from m31ctl.deployment import Deployment
from m31ctl.engine.adapter import EngineInvocation, build_invocation
from m31ctl.errors import InputError, close_matches
from m31ctl.plan.engine_capabilities import capability_table

# Environment variables vLLM removed, and what replaced them (vllm-engine-facts.md). vLLM only
# warns "Unknown vLLM environment variable" for them, so the setting silently does nothing.
REMOVED_ENV = {
    "VLLM_ATTENTION_BACKEND": "--attention-backend (attention_backend in the plan)",
    "VLLM_USE_FLASHINFER_MOE_FP4": "--moe-backend (moe.backend in the plan)",
    "VLLM_USE_FLASHINFER_MOE_FP8": "--moe-backend (moe.backend in the plan)",
    "VLLM_FLASHINFER_MOE_BACKEND": "--moe-backend (moe.backend in the plan)",
    "VLLM_NVFP4_GEMM_BACKEND": "--linear-backend",
}
_HUMAN_INT = re.compile(r"^(auto|-1|\d+(\.\d+)?[kKmMgG]?)$")
# Config keys whose values name attention backends (the enum, plus image extensions).
_BACKEND_KEYS = {("--speculative-config", "attention_backend"), ("--attention-config", "backend")}


def _scalar(raw: str) -> Any:
    """A dotted key's value as vLLM reads it: JSON where it parses, else the string."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw


class Finding(NamedTuple):
    token: str
    message: str
    hint: str = ""

    def line(self) -> str:
        return f"{self.token}: {self.message}" + (f" ({self.hint})" if self.hint else "")


@dataclass(frozen=True)
class EngineSchema:
    version: str
    data: dict[str, Any]
    extension: dict[str, Any]
    image: str

    @cached_property
    def options(self) -> dict[str, dict[str, Any]]:
        return {opt: flag for flag in self.data["flags"] for opt in flag["options"]}

    def attention_backends(self) -> set[str]:
        return set(self.data["attention_backends"]) | set(self.extension.get("attention_backends", ()))


SCHEMAS = argv.SCHEMAS


def _schema_data(version: str) -> dict[str, Any]:
    try:
        return argv.schema_data(version)
    except argv.UnknownSchema:
        raise InputError(
            f"no engine schema for vLLM {version!r}",
            hint=f"engine.schema_version must be one of: {', '.join(argv.known_versions())}",
        ) from None


@cache
def _extensions() -> dict[str, Any]:
    text = (SCHEMAS / "image-extensions.json").read_text(encoding="utf-8")
    images: dict[str, Any] = json.loads(text)["images"]
    return images


def schema_for(image: str, version: str) -> EngineSchema:
    """The schema `image` is checked against: the release's, plus the names a known day-zero image
    adds. An image the capability table does not know (a private build, a mirror's tag) may be
    either: it is given every known image's names, and the plan warns that its capabilities are
    unchecked (plan/engine_check.py), rather than refusing names it may well have."""
    extensions = _extensions()
    extension = extensions.get(image)
    if extension is None:
        known = capability_table().engine_for(image) is not None
        extension = {} if known else _union(extensions.values())
    return EngineSchema(version, _schema_data(version), extension, image)


def _union(extensions: Any) -> dict[str, Any]:
    names = sorted({name for ext in extensions for name in ext.get("attention_backends", [])})
    return {"attention_backends": names, "why": "an image m31ctl does not know: any day-zero name"}


def schema_from_data(data: dict[str, Any], image: str) -> EngineSchema:
    """A schema extracted from an image itself (doctor's engine check): no extension needed."""
    return EngineSchema(f"{data.get('version', '?')} in {image}", data, {}, image)


def _closest(name: str, candidates: list[str]) -> str:
    close = close_matches(name, candidates, n=1, cutoff=0.6)
    return f"did you mean {close[0]}?" if close else ""


def _check_json_config(flag: str, value: str, schema: EngineSchema) -> list[Finding]:
    try:
        config = json.loads(value)
    except json.JSONDecodeError as exc:
        return [Finding(flag, f"not valid JSON ({exc.msg})")]
    if not isinstance(config, dict):
        return [Finding(flag, "must be a JSON object")]
    fields = schema.data["json_configs"].get(flag)
    if fields is None:
        return []
    findings = []
    for key, item in config.items():
        if key not in fields:
            findings.append(Finding(flag, f"unknown key {key!r}", _closest(key, list(fields))))
            continue
        if (flag, key) in _BACKEND_KEYS:
            allowed = schema.attention_backends()
        elif flag == "--speculative-config" and key == "method":
            allowed = set(schema.data["speculative_methods"])
        else:
            allowed = set(fields[key]["values"] or ())
        if allowed and item is not None and item not in allowed:
            hint = _closest(str(item), sorted(map(str, allowed))) or f"one of {sorted(map(str, allowed))}"
            findings.append(Finding(flag, f"{key}={item!r} is not accepted by vLLM {schema.version}", hint))
    return findings


_NAMED_VALUES = {
    "--attention-backend": "attention_backends",
    "--tool-call-parser": "tool_call_parsers",
    "--reasoning-parser": "reasoning_parsers",
    "--quantization": "quantization_methods",
}


def _check_value(flag: dict[str, Any], token: str, value: str, schema: EngineSchema) -> list[Finding]:
    canonical = max(flag["options"], key=len)
    if flag["choices"] and value not in flag["choices"]:
        return [
            Finding(
                token,
                f"{value!r} is not a choice",
                _closest(value, flag["choices"]) or f"one of {', '.join(flag['choices'][:12])}",
            )
        ]
    if flag["type"] == "int" and not re.fullmatch(r"-?\d+", value):
        return [Finding(token, f"{value!r} is not an integer")]
    if flag["type"] == "float":
        try:
            float(value)
        except ValueError:
            return [Finding(token, f"{value!r} is not a number")]
    if flag["type"] == "human_int" and not _HUMAN_INT.match(value):
        return [Finding(token, f"{value!r} is not a token count (e.g. 262144 or 256k)")]
    if canonical in _NAMED_VALUES:
        names = (
            schema.attention_backends()
            if canonical == "--attention-backend"
            else set(schema.data[_NAMED_VALUES[canonical]])
        )
        if value not in names:
            return [
                Finding(
                    token, f"{value!r} is unknown to vLLM {schema.version}", _closest(value, sorted(names))
                )
            ]
    if flag["type"] == "json" and canonical in schema.data["json_configs"]:
        return _check_json_config(canonical, value, schema)
    if flag["type"] == "json" and value.lstrip().startswith(("{", "[")):
        try:
            json.loads(value)
        except json.JSONDecodeError as exc:
            return [Finding(token, f"not valid JSON ({exc.msg})")]
    return []


def _lookup(name: str, options: dict[str, dict[str, Any]]) -> tuple[dict[str, Any] | None, Finding | None]:
    """The flag a normalized name sets (m31ctl/vllm_argv.py), or the finding: vLLM takes an
    unambiguous prefix silently, which is a mistake waiting for the next flag that shares it."""
    found = argv.resolve(name, options)
    if found.flag is not None and not found.abbreviated:
        return options[found.flag], None
    if found.candidates:
        flags = list(dict.fromkeys(argv.canonical_option(options[c]["options"]) for c in found.candidates))
        return None, Finding(
            name,
            "abbreviated flag",
            f"write it in full: {flags[0]}" if len(flags) == 1 else f"ambiguous: {', '.join(flags[:4])}",
        )
    return None, Finding(name, "unknown flag", _closest(name, [o for o in options if o.startswith("--")]))


def validate(inv: EngineInvocation, schema: EngineSchema) -> list[Finding]:
    """Every way `inv` breaks `schema`: unknown or abbreviated flags, bad choices and types,
    unknown keys and values in the JSON configs, removed or unknown environment variables.
    Pure: reads nothing but its arguments; an empty list means vLLM's parser would accept it."""
    options = schema.options
    findings: list[Finding] = []
    args = list(inv.args)
    if not args or args[0].startswith("-"):
        findings.append(Finding("argv", "the model must come first"))
    i = 1
    while i < len(args):
        token = args[i]
        i += 1
        if token.startswith("-O") and token != "-O":  # vLLM turns -O3 into --optimization-level 3
            token, value = "--optimization-level", token[3:] if token[2:3] == "=" else token[2:]
            flag = options.get(token)
            if flag is not None:
                findings += _check_value(flag, "-O", value, schema)
            continue
        if not token.startswith("-"):
            findings.append(Finding(token, "stray positional argument"))
            continue
        spelled = argv.spell(token)
        if spelled is None:  # a negative number where a flag was expected
            findings.append(Finding(token, "stray positional argument"))
            continue
        name, eq, inline = spelled.name, spelled.inline is not None, spelled.inline or ""
        flag, problem = _lookup(name, options)
        if problem is not None:
            findings.append(problem)
            if not eq and i < len(args) and not args[i].startswith("-"):
                i += 1  # its value: one finding per mistake
            continue
        assert flag is not None
        if flag["type"] == "flag":
            continue
        if spelled.key is not None:  # `-ac.key value`: one key of a JSON flag, checked as such
            value = inline if eq else (args[i] if i < len(args) else "")
            i += 0 if eq else 1
            canonical = max(flag["options"], key=len)
            findings += _check_json_config(canonical, json.dumps({spelled.key: _scalar(value)}), schema)
            continue
        if eq:
            values = [inline]
        elif flag["nargs"] in ("+", "*"):
            values = []
            while i < len(args) and not args[i].startswith("-"):
                values.append(args[i])
                i += 1
        else:
            if i >= len(args):
                findings.append(Finding(name, "expects a value"))
                continue
            values = [args[i]]
            i += 1
        for value in values:
            findings += _check_value(flag, name, value, schema)
    known_env = set(schema.data["environment_variables"])
    for key, _value in inv.env:
        if key in REMOVED_ENV:
            findings.append(
                Finding(
                    key, "removed from vLLM: it is ignored with only a warning", f"use {REMOVED_ENV[key]}"
                )
            )
        elif key.startswith("VLLM_") and key not in known_env:
            findings.append(
                Finding(
                    key,
                    f"unknown to vLLM {schema.version}: it would be ignored",
                    _closest(key, sorted(known_env)),
                )
            )
    return findings


def check_plan_engine(
    inv: EngineInvocation,
    version: str,
    extra_args: tuple[str, ...] = (),
    extra_args_source: str | None = None,
) -> None:
    """Raise one InputError naming the first finding (and how many more) when the argv is off.
    A finding in engine.extra_args points at the layer that set them."""
    findings = validate(inv, schema_for(inv.image, version))
    if findings:
        more = f" (+{len(findings) - 1} more: see `m31ctl validate`)" if len(findings) > 1 else ""
        first = findings[0]
        where = extra_args_source if first.token in extra_args else None
        raise InputError(
            f"vLLM {version} would reject {first.line()}{more}",
            where=where,
            hint="fix the setting, or pass --no-validate to skip this check",
        )


class PlanValidation(NamedTuple):
    """`m31ctl validate`'s answer: every finding for the plan's argv and environment."""

    schema: EngineSchema
    invocation: EngineInvocation
    findings: tuple[Finding, ...]

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": "vllm",
            "schema_version": self.schema.version,
            "image": self.invocation.image,
            "extension": self.schema.extension.get("attention_backends", []),
            "ok": self.ok,
            "findings": [f._asdict() for f in self.findings],
        }


class GroupValidation(NamedTuple):
    """`m31ctl validate` of a P/D group: each role engine's validation, by role."""

    roles: tuple[tuple[str, PlanValidation], ...]

    @property
    def ok(self) -> bool:
        return all(one.ok for _, one in self.roles)

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "roles": {role: one.to_json() for role, one in self.roles}}


def validate_engine(deployment: Deployment) -> PlanValidation:
    """Every finding for one engine's invocation against the schema its image names."""
    inv = build_invocation(deployment)
    schema = schema_for(inv.image, deployment.plan.settings.engine.schema_version)
    return PlanValidation(schema, inv, tuple(validate(inv, schema)))


def validate_plan(deployment: Deployment) -> PlanValidation | GroupValidation:
    """The plan's engine, or each role engine of a P/D group (each may name its own image)."""
    group = deployment.disaggregated
    if group is None:
        return validate_engine(deployment)
    return GroupValidation(
        tuple(
            (role.kv_transfer.role.value, validate_engine(role)) for role in group.roles if role.kv_transfer
        )
    )
