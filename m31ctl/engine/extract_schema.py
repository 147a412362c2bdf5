"""Extract what `vllm serve` accepts from an installed vLLM, as one JSON document.

Standalone on purpose: it imports vLLM and the standard library only, so it runs in any
Python that has vLLM, including inside an engine image (`m31ctl doctor` sends it there).

    python m31ctl/engine/extract_schema.py > m31ctl/engine/schemas/vllm-0.32.0.json
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import sys
import typing
from typing import Any

SCHEMA_FORMAT = 1
# JSON-valued flags whose keys are the fields of a vLLM config dataclass.
JSON_CONFIGS = {
    "--speculative-config": "SpeculativeConfig",
    "--attention-config": "AttentionConfig",
    "--compilation-config": "CompilationConfig",
}


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return None  # dataclass instances, callables: not part of the contract


def _type_name(action: argparse.Action) -> str:
    if isinstance(
        action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)
    ):
        return "flag"
    t = action.type
    if t is int:
        return "int"
    if t is float:
        return "float"
    name = getattr(t, "__name__", "") or ""
    if "human_readable_int" in name:
        return "human_int"
    if name in ("parse_dataclass", "_parse_type") or action.dest.endswith("_config"):
        return "json"
    return "str"


def _literal_values(tp: Any) -> list[Any] | None:
    """Allowed values of a Literal / Optional[Literal] / Enum annotation, else None."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return [_jsonable(v) for v in typing.get_args(tp)]
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return [m.name for m in tp]
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", typing.Union)):
        values: list[Any] = []
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            inner = _literal_values(arg)
            if inner is None:
                return None
            values += inner
        return values or None
    if origin is typing.Annotated:
        return _literal_values(typing.get_args(tp)[0])
    return None


def _config_fields(cls: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        values = _literal_values(hints.get(f.name, f.type))
        fields[f.name] = {"type": str(f.type).replace("typing.", "")[:120], "values": values}
    return fields


def serve_parser_factory() -> Any:
    """vLLM's `vllm serve` parser builder, wherever this release keeps it."""
    try:  # 0.32
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        try:  # 0.33 moved the serve parser
            from vllm.entrypoints.common.cli_args import make_arg_parser
        except ImportError:  # 0.26 and earlier: the OpenAI server's own module
            from vllm.entrypoints.openai.cli_args import make_arg_parser
    return make_arg_parser


def extract() -> dict[str, Any]:
    # vLLM: run in the engine's Python only (the host has no vLLM; this module is standalone there)
    import vllm
    import vllm.config as config
    import vllm.envs as envs

    make_arg_parser = serve_parser_factory()
    # vLLM, as above
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    from vllm.reasoning import ReasoningParserManager
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    try:  # vLLM, as above; its tool parsers moved between releases
        from vllm.tool_parsers import ToolParserManager
    except ImportError:  # older layout
        from vllm.entrypoints.openai.tool_parsers import ToolParserManager

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    flags = []
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        flags.append(
            {
                "options": sorted(action.option_strings),
                "dest": action.dest,
                "type": _type_name(action),
                "nargs": action.nargs if isinstance(action.nargs, (str, int)) else None,
                "choices": sorted(str(c) for c in action.choices) if action.choices else None,
                "default": _jsonable(action.default),
            }
        )
    flags.sort(key=lambda f: f["dest"])
    json_configs = {flag: _config_fields(getattr(config, cls)) for flag, cls in JSON_CONFIGS.items()}
    spec_method = _config_fields(config.SpeculativeConfig)["method"]["values"] or []
    return {
        "format": SCHEMA_FORMAT,
        "engine": "vllm",
        "version": vllm.__version__,
        "flags": flags,
        "json_configs": json_configs,
        "attention_backends": sorted(m.name for m in AttentionBackendEnum),
        "speculative_methods": sorted(str(m) for m in spec_method),
        "quantization_methods": sorted(QUANTIZATION_METHODS),
        "tool_call_parsers": sorted({*ToolParserManager.tool_parsers, *ToolParserManager.lazy_parsers}),
        "reasoning_parsers": sorted(
            {*ReasoningParserManager.reasoning_parsers, *ReasoningParserManager.lazy_parsers}
        ),
        "environment_variables": sorted(envs.environment_variables),
    }


def main() -> None:
    json.dump(extract(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
