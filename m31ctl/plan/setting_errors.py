"""A settings validation error as the user can act on it: the setting and the layer that set
it, the setting meant where a key is unknown (serving.max_num_seqs for `max_num_seqs`), and the
exact --set to type where a list was given as a bare word."""

from __future__ import annotations

import json
import shlex
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from m31ctl.errors import InputError, close_matches
from m31ctl.plan.layers import Layer
from m31ctl.plan.settings import PlanSettings
from m31ctl.redact import redact


def _model_fields_at(loc: tuple[str, ...]) -> list[str]:
    model: type[BaseModel] = PlanSettings
    for part in loc:
        info = model.model_fields.get(part)
        annotation = info.annotation if info else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _section(annotation: Any) -> type[BaseModel] | None:
    """The settings section an annotation holds (`RdmaSettings | None` holds RdmaSettings)."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _setting_paths(model: type[BaseModel] = PlanSettings, prefix: str = "") -> list[str]:
    """Every setting's dotted path, in the schema's order (serving.max_num_seqs, ...)."""
    paths: list[str] = []
    for name, info in model.model_fields.items():
        section = _section(info.annotation)
        paths.extend(_setting_paths(section, f"{prefix}{name}.") if section else [f"{prefix}{name}"])
    return paths


def _meant_setting(dotted: str) -> str | None:
    """The setting an unknown key most likely means: a close spelling of it, then the one whose
    last part is the key's (`max_num_seqs` is serving.max_num_seqs), then a close spelling of
    that last part; the shortest path first where several match."""
    paths = _setting_paths()
    close = close_matches(dotted, paths, n=1, cutoff=0.8)
    if close:
        return close[0]
    leaf = dotted.rsplit(".", 1)[-1]
    by_leaf: dict[str, list[str]] = {}
    for path in sorted(paths, key=lambda p: p.count(".")):  # stable: the schema's order kept
        by_leaf.setdefault(path.rsplit(".", 1)[-1], []).append(path)
    if leaf in by_leaf:
        return by_leaf[leaf][0]
    near = close_matches(leaf, list(by_leaf), n=1, cutoff=0.8)
    return by_leaf[near[0]][0] if near else None


def _as_json_list(value: Any, loc: tuple[str, ...]) -> str:
    """A scalar given where a list belongs, as the JSON list it stands for: "--a --b" is two
    items, and a number where the items are strings is one, quoted. Without spaces, so a screen
    wraps it as one word."""
    items = shlex.split(value) if isinstance(value, str) and value.strip() else [value]
    if str in get_args(_annotation_at(loc)):
        items = [i if isinstance(i, str) else json.dumps(i) for i in items]
    return json.dumps(items, separators=(",", ":"))


def _annotation_at(loc: tuple[str, ...]) -> Any:
    model: type[BaseModel] | None = PlanSettings
    annotation: Any = None
    for part in loc:
        info = model.model_fields.get(part) if model else None
        annotation = info.annotation if info else None
        model = _section(annotation)
    return annotation


def validation_error(exc: ValidationError, merged: Layer) -> InputError:
    err = exc.errors()[0]
    loc = tuple(str(p) for p in err["loc"])
    dotted = ".".join(loc)
    setting = merged.get(dotted)
    for cut in range(len(loc) - 1, 0, -1):  # an item inside a list setting: name the setting
        if setting is not None:
            break
        owner = ".".join(loc[:cut])
        if owner in merged:
            setting = merged[owner]
            item = "".join(f"[{part}]" for part in loc[cut:])
            message = str(err["msg"]).removeprefix("Value error, ")
            return InputError(f"{owner}{item}: {message}", where=str(setting.source))
    if setting is None:  # an error on a whole section: blame the last layer that touched it
        touching = [s for k, s in merged.items() if k.startswith(dotted + ".") or not dotted]
        setting = touching[-1] if touching else None
    where = str(setting.source) if setting else None
    if err["type"] == "extra_forbidden":
        parent, leaf = loc[:-1], loc[-1]
        close = [".".join((*parent, c)) for c in close_matches(leaf, _model_fields_at(parent), n=1)]
        # A close sibling that is a section (`tensor_parallel` is not `parallelism`) is no setting.
        meant = close[0] if close and close[0] in _setting_paths() else _meant_setting(dotted)
        hint = f"did you mean {meant!r}?" if meant else "see `m31ctl plan --explain` for valid keys"
        if meant and setting is not None and setting.source.layer == "--set":
            value = setting.value
            typed = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
            hint = redact(f"did you mean {meant!r}? --set {shlex.quote(f'{meant}={typed}')}")
        return InputError(f"unknown setting {dotted!r}", where=where, hint=hint)
    message = str(err["msg"]).removeprefix("Value error, ")
    if err["type"] == "missing":
        return InputError(f"setting {dotted!r} is required", hint="set it in a -f file or with --set")
    if err["type"] in ("tuple_type", "list_type") and setting is not None and dotted in merged:
        if setting.source.layer == "--set":
            typed = shlex.quote(f"{dotted}={_as_json_list(setting.value, loc)}")
            return InputError(
                f"{dotted} is a list: --set takes it as JSON, quoted for the shell",
                where=where,
                hint=redact(f"--set {typed}"),
            )
        return InputError(
            f"{dotted}={redact(repr(setting.value))}: a list is expected",
            where=where,
            hint=redact(
                f"write it as a YAML list, e.g. {dotted.rsplit('.', 1)[-1]}: {_as_json_list(setting.value, loc)}"
            ),
        )
    shown = f"{dotted}={redact(repr(setting.value))}: " if setting is not None and dotted in merged else ""
    return InputError(f"{shown}{message}", where=where)
