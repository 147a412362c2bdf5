"""Layers of settings and where each value came from.

A layer is a flat mapping from a dotted key (``cache.kv_dtype``) to a value and its
source. Merging layers is a dict update, so precedence is simply the order of the
layers; the merged result keeps, for each key, the source of the layer that won.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from m31ctl.errors import InputError


class Source(NamedTuple):
    """Where a value came from: a layer name and, for files, the file and line."""

    layer: str  # "defaults", "recipe", "variant", "profile", "file", "--set", "hardware"
    file: str | None = None
    line: int | None = None
    detail: str | None = None  # e.g. "--set #2" or "variant aiter"

    def __str__(self) -> str:
        where = ""
        if self.file is not None:
            where = f"{self.file}:{self.line}" if self.line is not None else self.file
        label = self.detail or self.layer
        if where and label == "file":
            return where  # a user file speaks for itself
        return f"{label} ({where})" if where else label


class Setting(NamedTuple):
    value: Any
    source: Source


Layer = dict[str, Setting]


def flatten_value(value: Any, source: Source, prefix: str) -> Layer:
    if isinstance(value, Mapping) and value:
        out: Layer = {}
        for key, sub in value.items():
            out.update(flatten_value(sub, source, f"{prefix}.{key}"))
        return out
    return {prefix: Setting(value, source)}


class FlagSet(str):
    """A `--set` expression a command flag stands for (`--port 8001` is runtime.port=8001): its
    source is the flag the user typed, not a `--set #N` they never typed."""

    flag: str

    def __new__(cls, expr: str, flag: str) -> FlagSet:
        made = super().__new__(cls, expr)
        made.flag = flag
        return made


def parse_set(expr: str, index: int) -> Layer:
    """`--set key.path=value`; the value is JSON when it parses as JSON, else a string."""
    key, sep, raw = expr.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise InputError(
            f"--set expects key.path=value, got {expr!r}",
            hint="for example --set serving.max_model_len=131072",
        )
    try:
        value: Any = json.loads(raw)
    except json.JSONDecodeError as exc:
        if raw.strip()[:1] in ("[", "{", '"'):  # meant as JSON, but broken
            raise InputError(
                f"--set {key}: broken JSON value ({exc.msg} at column {exc.pos + 1})",
                hint="quote the whole argument for the shell, e.g. --set 'engine.extra_args=[\"--x\"]'",
            ) from None
        value = raw
    except (ValueError, RecursionError):
        # json's own limits: integers over 4,300 digits, arrays nested past the recursion limit.
        raise InputError(
            f"--set {key}: the value is too large or too deeply nested",
            hint="settings are small numbers, strings and short lists",
        ) from None
    source = Source("--set", detail=getattr(expr, "flag", None) or f"--set #{index}")
    return flatten_value(value, source, key)


def merge(layers: Iterable[Layer]) -> Layer:
    """Later layers win. Setting a key replaces everything below it, and vice versa."""
    merged: Layer = {}
    for layer in layers:
        for key, setting in layer.items():
            prefix = key + "."
            for existing in [k for k in merged if k.startswith(prefix)]:
                del merged[existing]
            parts = key.split(".")
            for i in range(1, len(parts)):
                merged.pop(".".join(parts[:i]), None)
            merged[key] = setting
    return merged


def unflatten(layer: Layer) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for key in sorted(layer):
        node = tree
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = layer[key].value
    return tree


# Layers travel through the parsed-file cache (parsed.py) as JSON: [value, layer, file, line, detail].
def layer_to_data(layer: Layer) -> dict[str, list[Any]]:
    return {
        key: [s.value, s.source.layer, s.source.file, s.source.line, s.source.detail]
        for key, s in layer.items()
    }


def layer_from_data(data: Mapping[str, list[Any]]) -> Layer:
    return {key: Setting(v[0], Source(v[1], v[2], v[3], v[4])) for key, v in data.items()}
