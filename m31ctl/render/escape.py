"""Escaping for where each value lands: shell words, systemd command lines, YAML documents."""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from functools import cache
from importlib.util import find_spec
from typing import Any

from m31ctl.memo import memoized


class ShellExpansion(str):
    """Shell text m31ctl means the script's shell to expand when it runs ("$HF_CACHE"): written
    verbatim by shell_word. Built only from fixed text and shell_word()s, never from a value."""


def shell_word(value: object) -> str:
    """One shell word, taken literally (paths are absolute by now: the Deployment expanded `~`
    once), except a ShellExpansion, which the script expands when it runs (the script's cache
    under the home of whoever runs it, render/script_cache.py)."""
    if isinstance(value, ShellExpansion):
        return str(value)
    return shlex.quote(str(value))


_SYSTEMD_SAFE = re.compile(r"^[A-Za-z0-9_@%+=:,./-]+$")


def systemd_word(value: object) -> str:
    """One word of a systemd Exec line: %-specifiers, $-expansion and quotes are escaped."""
    text = str(value).replace("%", "%%").replace("$", "$$")
    if _SYSTEMD_SAFE.match(text) and "%%" not in text:
        return text
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t")
    return f'"{escaped}"'


# An Exec line's continuation: systemd joins a line ending in a backslash with the next one, the
# backslash read as a space (systemd.syntax(7)), so a folded line is the same command.
SYSTEMD_CONTINUATION = " \\\n    "


def systemd_command(words: Sequence[object]) -> str:
    """An Exec line's words, folded one option a line: a `docker run` of 60 words on one line
    was 1,322 characters no reviewer reads. A line starts at each word that begins with `-`, and
    at a positional word after an option that has its value (the image after `--gpus all`); the
    words before the first option (the program and its subcommand) stay together."""
    lines: list[list[str]] = []
    for word in map(str, words):
        starts_option = word.startswith("-")
        after_value = bool(lines) and lines[-1][0].startswith("-") and len(lines[-1]) == 2
        if not lines or starts_option or after_value:
            lines.append([word])
        else:
            lines[-1].append(word)
    return SYSTEMD_CONTINUATION.join(" ".join(systemd_word(w) for w in line) for line in lines)


@cache
def _dumper() -> type:
    """libyaml's emitter where PyYAML was built with it (the pure-Python one is ten times slower;
    both write the same bytes for these documents). PyYAML is imported here, on first use, so
    the targets that write no YAML never load it."""
    import yaml  # lazy: PyYAML's import costs start-up the YAML-less targets need not pay

    base = getattr(yaml, "CSafeDumper", yaml.SafeDumper)

    class Dumper(base):  # type: ignore[misc,valid-type]
        """Block style, no aliases, stable order: diffs stay readable and renders byte-identical."""

        def ignore_aliases(self, data: Any) -> bool:
            return True

    def represent_str(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
        style = "|" if "\n" in data else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)

    Dumper.add_representer(str, represent_str)
    return Dumper


def to_yaml(document: Any) -> str:
    import yaml  # lazy: as in _dumper

    return yaml.dump(
        document, Dumper=_dumper(), sort_keys=False, default_flow_style=False, allow_unicode=True, width=4096
    ).rstrip("\n")


def yaml_file(comment_lines: Sequence[str], documents: Sequence[Any], explicit_start: bool) -> str:
    """A YAML file: `#` comment lines, then each document (after `---` when explicit_start).

    The documents are built as data and only serialized here: YAML is never templated as text.
    The serialized text is memoized (m31ctl/memo.py): importing PyYAML costs a render more than
    everything else it does, and the same plan yields the same documents run after run."""
    head = "".join(f"{line}\n" for line in comment_lines)
    marker = "---\n" if explicit_start else ""
    bodies = memoized(
        # repr() tells apart what YAML writes differently (1, 1.0, True and "1"; key order); a
        # value whose repr is not stable across runs costs a miss, never a wrong answer.
        "yaml",
        repr(documents).encode(),
        lambda: [to_yaml(d) for d in documents],
        code=(__file__, _pyyaml_file()),
    )
    return head + "".join(f"{marker}{body}\n" for body in bodies)


def _pyyaml_file() -> str:
    """PyYAML's installed package file, found without importing it: the emitter is its code."""
    spec = find_spec("yaml")
    return spec.origin if spec is not None and spec.origin else ""


def compose_literal(value: str) -> str:
    """Compose interpolates $VAR and ${VAR} in every string; $$ is a literal $."""
    return value.replace("$", "$$")


class Interpolation(str):
    """A Compose string m31ctl means to be interpolated (${HOME}, ${VLLM_API_KEY:?...})."""


def compose_escape(data: Any) -> Any:
    """Every string of a Compose document made literal, keys included, except the
    Interpolations m31ctl put there on purpose (returned as plain strings for the emitter)."""
    if isinstance(data, Interpolation):
        return str(data)
    if isinstance(data, str):
        return compose_literal(data)
    if isinstance(data, dict):
        return {compose_escape(k): compose_escape(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [compose_escape(v) for v in data]
    return data
