"""YAML files of settings: parsed to nodes with line numbers, refusing what a settings file has
no need for (aliases, tags, duplicate keys), and flattened into layers whose every value
knows its file and line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from m31ctl.errors import InputError
from m31ctl.inputs import MAX_DEPTH, read_text
from m31ctl.plan.layers import Layer, Setting, Source


def _yaml_loader() -> yaml.constructor.SafeConstructor:
    # Only SafeLoader's constructor builds values from composed nodes: a fresh one per value (its
    # state as construct_document leaves it), without a reader, scanner and parser (3 us each, a
    # few hundred values a recipe file).
    return yaml.constructor.SafeConstructor()


# libyaml's parser where PyYAML was built with it (5-10x faster); the same nodes and marks.
_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def safe_load(text: str) -> Any:
    """yaml.safe_load through _Loader: the same values (SafeLoader's constructor), libyaml's parser
    where PyYAML has it (the shipped model facts and capability table: 5 ms where the pure-Python
    parser took 30 on a first run)."""
    return yaml.load(text, Loader=_Loader)


def compose_yaml(text: str, file: str) -> yaml.Node | None:
    """Parse to a node tree with line numbers. Aliases are refused: an alias bomb expands
    exponentially, and a settings file has no need for them."""
    try:
        node = yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        line = mark.line + 1 if mark is not None else None
        raise InputError(
            f"invalid YAML: {exc.problem}",
            where=f"{file}:{line}" if line else file,
            hint="fix the syntax; `python -c 'import yaml,sys; yaml.safe_load(open(sys.argv[1]))' FILE` shows it",
        ) from None
    except yaml.YAMLError as exc:
        raise InputError(f"invalid YAML: {exc}", where=file) from None
    except RecursionError:
        raise InputError("the YAML is nested too deeply", where=file) from None
    if node is not None:
        _refuse_aliases_and_depth(node, file)
    return node


def _refuse_aliases_and_depth(root: yaml.Node, file: str) -> None:
    """An alias makes the composer share one node; meeting a node twice means an alias. Depth is
    bounded here, before anything recursive (construction, flattening, validation) walks the tree:
    libyaml stops at 1,000 levels, far past Python's recursion limit for those walks."""
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, yaml.ScalarNode):
            continue
        if id(node) in seen:
            raise InputError(
                "YAML aliases (*name) are not allowed in m31ctl files",
                where=f"{file}:{node.start_mark.line + 1}",
                hint="write the value out in full",
            )
        if depth > MAX_DEPTH:
            raise InputError(
                f"the YAML is nested more than {MAX_DEPTH} levels deep",
                where=f"{file}:{node.start_mark.line + 1}",
                hint="settings are a few levels of mappings and short lists",
            )
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                stack.extend(((key, depth + 1), (value, depth + 1)))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, depth + 1) for item in node.value)


def construct(node: yaml.Node, file: str = "<yaml>") -> Any:
    """Build the plain Python value of a YAML node: safe types only, no duplicate keys."""
    if isinstance(node, yaml.MappingNode):
        for _key, _value, _line in mapping_items(node, file):
            pass  # raises on duplicate keys
    try:
        return _yaml_loader().construct_object(node, deep=True)
    except yaml.constructor.ConstructorError as exc:
        mark = exc.problem_mark or node.start_mark
        raise InputError(
            f"unsupported YAML: {exc.problem}",
            where=f"{file}:{mark.line + 1}",
            hint="plain scalars, lists and mappings only (no !!python or other tags)",
        ) from None
    except (ValueError, RecursionError):
        # Python's limits: integers over 4,300 digits, structures nested past the recursion limit.
        raise InputError(
            "a value is too large or too deeply nested",
            where=f"{file}:{node.start_mark.line + 1}",
            hint="settings are small numbers, strings and short lists",
        ) from None


def mapping_items(node: yaml.Node, file: str) -> Iterator[tuple[str, yaml.Node, int]]:
    if not isinstance(node, yaml.MappingNode):
        raise InputError(
            "expected a mapping of keys to values",
            where=f"{file}:{node.start_mark.line + 1}",
        )
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        line = key_node.start_mark.line + 1
        key = construct(key_node, file)
        if not isinstance(key, str):
            raise InputError(f"keys must be strings, got {key!r}", where=f"{file}:{line}")
        if key in seen:
            raise InputError(
                f"duplicate key {key!r} (first at line {seen[key]})",
                where=f"{file}:{line}",
                hint="keep one of them",
            )
        seen[key] = line
        yield key, value_node, line


def flatten_node(node: yaml.Node, file: str, make_source: Any, prefix: str = "") -> Layer:
    """Flatten a YAML mapping node into dotted keys, recording each leaf's line."""
    out: Layer = {}
    for key, value_node, line in mapping_items(node, file):
        dotted = f"{prefix}{key}"
        if isinstance(value_node, yaml.MappingNode) and value_node.value:
            out.update(flatten_node(value_node, file, make_source, prefix=f"{dotted}."))
        else:
            out[dotted] = Setting(construct(value_node, file), make_source(file, line))
    return out


# A layer file's top-level `provenance: TEXT` is not a setting: it says where the file's values
# came from (`m31ctl bench --write-profile` writes "measured by m31ctl bench on HOST, DATE"), and
# every value of the file carries it as its source's label, so `plan --explain` shows it.
PROVENANCE_KEY = "provenance"


def load_layer_file(path: Path, layer: str = "file") -> Layer:
    """A user override file: YAML whose keys are plan settings (and an optional provenance)."""
    text = read_text(path, "override file", hint="check the path given to -f")
    node = compose_yaml(text, str(path))
    if node is None:
        return {}
    label = _take_provenance(node, str(path)) or layer
    return flatten_node(node, str(path), lambda f, line: Source(layer, f, line, detail=label))


def _take_provenance(node: yaml.Node, file: str) -> str | None:
    """Remove the top-level provenance key from the mapping node and return its text."""
    if not isinstance(node, yaml.MappingNode):
        return None
    for index, (key_node, value_node) in enumerate(node.value):
        if isinstance(key_node, yaml.ScalarNode) and key_node.value == PROVENANCE_KEY:
            value = construct(value_node, file)
            if not isinstance(value, str) or not value.strip():
                raise InputError(
                    f"{PROVENANCE_KEY} must be a line of text saying where the values came from",
                    where=f"{file}:{key_node.start_mark.line + 1}",
                )
            del node.value[index]
            return value.strip()
    return None
