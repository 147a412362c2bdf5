"""vLLM's argv grammar, spelled once: how `vllm serve` reads a flag, for every reader of argv.

vLLM's parser (vllm/utils/argparse_utils.py FlexibleArgumentParser over argparse) is lenient:
`_` and `-` are interchangeable in long names, `--flag=value` and `--flag value` both work, an
unambiguous prefix of a long flag is accepted silently (argparse allow_abbrev), a JSON-valued flag
takes dotted keys (`--speculative-config.method dspark`, `-ac.indexer_kv_dtype nvfp4`), and a
repeated flag keeps its last value. The validator (engine/validate.py), the owned flags
(engine/owned.py), the redactor (m31ctl/redact.py) and the engine rules (plan/engine_rules.py)
read argv through this module so they cannot disagree about what a token sets.

A top-level module with no import of m31ctl: the plan (which may not import the engine), the
redactor every command loads, and the engine all read argv through it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

# A long stem this short names no flag on its own ("--a"): prefixes start at two characters.
MIN_STEM = 2
# The schemas extracted from vLLM releases (engine/extract_schema.py).
SCHEMAS = Path(__file__).resolve().parent / "engine" / "schemas"
_VERSION = re.compile(r"^[0-9]+(\.[0-9A-Za-z]+)*$")


class Spelled(NamedTuple):
    """One argv token as vLLM reads its name: `--Tensor_Parallel=4` -> name `--tensor-parallel`,
    inline value `4`; `-ac.indexer_kv_dtype` -> name `-ac`, key `indexer_kv_dtype`."""

    token: str
    name: str  # normalized: long names with `-` for `_`; short names as written
    key: str | None  # the dotted sub-key of a JSON-valued flag
    inline: str | None  # the value after `=`


def spell(token: str, *, fold_case: bool = False) -> Spelled | None:
    """How vLLM reads `token`'s flag name, or None for a token that is no flag (a value).
    `fold_case`: also read `--Port` as `--port`, which vLLM rejects; for the readers that refuse
    or mask (owned flags, secrets), where reading more than vLLM does is the safe side."""
    if not token.startswith("-") or token in ("-", "--") or _is_number(token):
        return None
    head, eq, inline = token.partition("=")
    base, dot, key = head.partition(".")
    if base.startswith("--"):
        base = "--" + base[2:].replace("_", "-")
        base = base.lower() if fold_case else base
    return Spelled(token, base, key if dot else None, inline if eq else None)


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


class Resolution(NamedTuple):
    flag: str | None  # the option it names, as listed in `options`
    candidates: tuple[str, ...]  # several: an ambiguous prefix (vLLM rejects it)
    abbreviated: bool = False


def resolve(name: str, options: Iterable[str]) -> Resolution:
    """Which of `options` the normalized `name` sets: itself, or the one long option it is an
    unambiguous prefix of. Short names (`-tp`) match exactly only, as argparse reads them here."""
    listed = set(options)
    if name in listed:
        return Resolution(name, (name,))
    if not name.startswith("--") or len(name) - 2 < MIN_STEM:
        return Resolution(None, ())
    found = tuple(sorted(o for o in listed if o.startswith("--") and o.startswith(name)))
    return Resolution(found[0] if len(found) == 1 else None, found, abbreviated=bool(found))


def prefix_of(name: str, flags: Iterable[str]) -> str | None:
    """The first of `flags` that the normalized long `name` spells in full or as a prefix, even
    where vLLM would find the prefix ambiguous: for the readers that must err on the safe side
    (a secret's value is masked whatever else the prefix could mean)."""
    if not name.startswith("--") or len(name) - 2 < MIN_STEM:
        return None
    return next((flag for flag in flags if flag.startswith(name)), None)


class Occurrence(NamedTuple):
    flag: str  # the canonical long option
    spelled: Spelled
    value: str | None  # None for a switch, or a flag with no value after it
    position: int  # in argv


def occurrences(
    args: Iterable[str], groups: Mapping[str, str], takes_value: Iterable[str]
) -> Iterator[Occurrence]:
    """Every flag of `args` that names one of `groups` (option -> its canonical long option),
    with its value. `takes_value`: canonical options that read the next token as their value."""
    argv = list(args)
    valued = set(takes_value)
    for index, token in enumerate(argv):
        spelled = spell(token)
        if spelled is None:
            continue
        hit = resolve(spelled.name, groups).flag
        if hit is None:
            continue
        flag = groups[hit]
        value = spelled.inline
        if value is None and (flag in valued or spelled.key is not None) and index + 1 < len(argv):
            value = argv[index + 1]
        yield Occurrence(flag, spelled, value, index)


def json_config(args: Iterable[str], flag: str, aliases: Iterable[str] = ()) -> dict[str, Any]:
    """A JSON-valued flag as vLLM merges it: each occurrence's object, and dotted keys folded in
    (`-ac.key value`; the value read as JSON where it parses, else as a string)."""
    groups = {flag: flag, **dict.fromkeys(aliases, flag)}
    merged: dict[str, Any] = {}
    for hit in occurrences(args, groups, (flag,)):
        raw = hit.value or ""
        if hit.spelled.key is None:
            try:
                data = json.loads(raw)
            except ValueError:
                continue
            if isinstance(data, dict):
                merged.update(data)
            continue
        try:
            merged[hit.spelled.key] = json.loads(raw)
        except ValueError:
            merged[hit.spelled.key] = raw
    return merged


# --- vLLM's option table (what an installed vLLM registers, extracted per release) -------------


class UnknownSchema(LookupError):
    """No schema file for a vLLM version (validate.py turns it into the user's error)."""


@cache
def schema_data(version: str) -> dict[str, Any]:
    path = SCHEMAS / f"vllm-{version}.json"
    if not _VERSION.match(version) or not path.is_file():
        raise UnknownSchema(version)
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def known_versions() -> list[str]:
    return sorted(p.stem.removeprefix("vllm-") for p in SCHEMAS.glob("vllm-*.json"))


@cache
def option_groups(version: str) -> dict[str, str]:
    """Every option vLLM registers (`-tp`, `--no-enable-expert-parallel`, ...) -> the flag's
    canonical long option (its longest spelling, as `--help` lists it first)."""
    groups: dict[str, str] = {}
    for flag in schema_data(version)["flags"]:
        canonical = canonical_option(flag["options"])
        for option in flag["options"]:
            groups[option] = canonical
    return groups


def canonical_option(options: list[str]) -> str:
    """A flag's canonical long option among its spellings (not a `--no-` negation)."""
    long = [o for o in options if o.startswith("--") and not o.startswith("--no-")]
    return max(long or options, key=len) if len(long) != 1 else long[0]


def canonical(token: str, version: str, *, fold_case: bool = False) -> Resolution:
    """The canonical long option `token` sets in vLLM `version`, or why none: unknown (no
    candidates) or an ambiguous prefix (several)."""
    spelled = spell(token, fold_case=fold_case)
    if spelled is None:
        return Resolution(None, ())
    groups = option_groups(version)
    found = resolve(spelled.name, groups)
    named = tuple(dict.fromkeys(groups[c] for c in found.candidates))
    if found.flag is None and len(named) == 1:  # `--enable-exp`: both spellings of one flag
        return Resolution(named[0], named, found.abbreviated)
    if found.flag is None:
        return Resolution(None, named, found.abbreviated)
    return Resolution(groups[found.flag], named, found.abbreviated)
