"""Hardware recipes and model facts: loading, validation and selection."""

from __future__ import annotations

import functools
import json
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

if TYPE_CHECKING:
    import yaml

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from m31ctl.errors import InputError, UnsupportedHardware, close_matches
from m31ctl.hardware import Hardware, describe_arch
from m31ctl.inputs import decode, read_bytes
from m31ctl.plan.layers import Layer, Source, layer_from_data, layer_to_data
from m31ctl.plan.parsed import parsed
from m31ctl.resources import recipes_dir


class _CatalogModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)


class Match(_CatalogModel):
    vendor: Literal["nvidia", "amd", "cpu"]
    families: tuple[str, ...]
    archs: tuple[str, ...] = ()  # compute capability or gfx target; the selection key
    products: tuple[str, ...] = ()
    min_gpus: int = Field(ge=0)
    # Memory per GPU the recipe's layout was written for (GiB, as the driver reports it).
    min_memory_gib: float = Field(0, ge=0)


class Rule(_CatalogModel):
    """A hard rule: checked after every layer is merged, whoever set the value."""

    id: str
    key: str
    reason: str
    # Where the constraint comes from: a URL (upstream recipe, vLLM source, vendor doc) or a seed
    # file with the quoted phrase. Required: a rule nobody can trace is a guess.
    source: str = Field(min_length=8)
    equals: Any = None
    one_of: tuple[Any, ...] | None = None
    not_in: tuple[Any, ...] | None = None

    @model_validator(mode="after")
    def _one_condition(self) -> Rule:
        given = [self.equals is not None, self.one_of is not None, self.not_in is not None]
        if sum(given) != 1:
            raise ValueError(f"rule {self.id}: give exactly one of equals, one_of, not_in")
        return self

    def allows(self, value: Any) -> bool:
        if self.equals is not None:
            return bool(value == self.equals)
        if self.one_of is not None:
            return value in self.one_of
        assert self.not_in is not None
        return value not in self.not_in

    def condition(self) -> str:
        """The rule as a person reads it: "must equal 128", "must be one of fp8, bf16" (values as
        a recipe or --set spells them: false, not False; fp8, not 'fp8')."""
        if self.equals is not None:
            said = _spelt(self.equals)
            return f"must be {said}" if isinstance(self.equals, bool) else f"must equal {said}"
        if self.one_of is not None:
            return f"must be one of {', '.join(_spelt(v) for v in self.one_of)}"
        return f"must not be one of {', '.join(_spelt(v) for v in self.not_in or ())}"

    def expectation(self) -> str:
        if self.equals is not None:
            return f"must be {self.equals!r}"
        if self.one_of is not None:
            return f"must be one of {list(self.one_of)!r}"
        return f"must not be one of {list(self.not_in or ())!r}"


def _spelt(value: Any) -> str:
    """A rule's value as YAML and --set spell it: bare strings and numbers, JSON for the rest."""
    return value if isinstance(value, str) else json.dumps(value)


class Recommended(_CatalogModel):
    cuda_driver: str | None = None
    rocm: str | None = None


class Option(_CatalogModel):
    """A variant or a profile: a named layer of settings, or a documented refusal."""

    name: str
    description: str = ""
    unsupported: str | None = None
    layer: dict[str, Any] = Field(default_factory=dict, exclude=True)  # dotted key -> Setting


class Recipe(_CatalogModel):
    recipe: str
    description: str
    status: Literal["stable", "preview", "rehearsal"]
    match: Match
    recommended: Recommended = Field(default_factory=Recommended)  # not built at import
    rules: tuple[Rule, ...] = ()
    default_variant: str
    path: str
    layer: dict[str, Any] = Field(default_factory=dict, exclude=True)
    variants: dict[str, Option]
    profiles: dict[str, Option]

    def variant(self, name: str | None) -> Option:
        return self._pick(self.variants, name or self.default_variant, "variant")

    def profile(self, name: str) -> Option:
        option = self._pick(self.profiles, name, "profile")
        if option.unsupported:
            raise InputError(
                f"profile {name!r} is not supported by the {self.recipe} recipe: {option.unsupported}",
                where=self.path,
            )
        return option

    def _pick(self, options: dict[str, Option], name: str, kind: str) -> Option:
        if name in options:
            return options[name]
        close = close_matches(name, list(options), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise InputError(
            f"the {self.recipe} recipe has no {kind} {name!r}",
            hint=f"{hint}choose one of: {', '.join(options)}",
        )


_TOP_KEYS = {
    "recipe",
    "description",
    "status",
    "match",
    "recommended",
    "rules",
    "default_variant",
    "settings",
    "variants",
    "profiles",
}
_OPTION_KEYS = {"description", "settings", "unsupported"}


def _display(path: Path) -> str:
    try:
        return str(path.relative_to(recipes_dir().parent))
    except ValueError:
        return str(path)


def _options(node: yaml.Node, file: str, kind: str) -> dict[str, Any]:
    # lazy: m31ctl.plan.yamlfile loads PyYAML; a plan served from the memo never parses YAML
    from m31ctl.plan.yamlfile import construct, flatten_node, mapping_items

    options: dict[str, Any] = {}
    for name, option_node, _line in mapping_items(node, file):
        fields: dict[str, Any] = {"name": name, "layer": {}}
        if option_node.value:  # an empty option is allowed: it changes nothing
            for key, value_node, key_line in mapping_items(option_node, file):
                if key not in _OPTION_KEYS:
                    raise InputError(
                        f"unknown key {key!r} in {kind} {name!r}",
                        where=f"{file}:{key_line}",
                        hint=f"allowed: {', '.join(sorted(_OPTION_KEYS))}",
                    )
                if key == "settings":
                    detail = f"{kind} {name}"
                    layer = flatten_node(value_node, file, lambda f, ln, d=detail: Source(kind, f, ln, d))
                    fields["layer"] = layer_to_data(layer)
                else:
                    fields[key] = construct(value_node, file)
        options[name] = fields
    return options


def _parse_recipe(raw: bytes, *, path: Path) -> dict[str, Any]:
    """A recipe file as JSON-able data (settings layers keep file and line): the form the
    parsed-file cache stores."""
    # lazy: m31ctl.plan.yamlfile loads PyYAML; a plan served from the memo never parses YAML
    from m31ctl.plan.yamlfile import compose_yaml, construct, flatten_node, mapping_items

    file = _display(path)
    node = compose_yaml(decode(raw, path, "recipe file"), file)
    if node is None:
        raise InputError("empty recipe file", where=file)
    fields: dict[str, Any] = {"path": file, "layer": {}}
    for key, value_node, line in mapping_items(node, file):
        if key not in _TOP_KEYS:
            close = close_matches(key, sorted(_TOP_KEYS), n=1)
            raise InputError(
                f"unknown recipe key {key!r}",
                where=f"{file}:{line}",
                hint=f"did you mean {close[0]!r}?" if close else None,
            )
        if key == "settings":
            layer = flatten_node(value_node, file, lambda f, ln: Source("recipe", f, ln, "recipe"))
            fields["layer"] = layer_to_data(layer)
        elif key in ("variants", "profiles"):
            fields[key] = _options(value_node, file, key[:-1])
        else:
            fields[key] = construct(value_node, file)
    return fields


def _recipe_from_data(data: dict[str, Any]) -> Recipe:
    fields = dict(data)
    file = str(fields.get("path"))
    fields["layer"] = layer_from_data(fields.get("layer") or {})
    # Options and the recommendation as plain data: Recipe validates them inside its own schema
    # (building Option's and Recommended's validators apart would cost start-up for nothing).
    fields.setdefault("recommended", {})
    for kind in ("variants", "profiles"):
        if isinstance(fields.get(kind), dict):
            fields[kind] = {
                name: {**option, "layer": layer_from_data(option.get("layer") or {})}
                if isinstance(option, dict)
                else option
                for name, option in fields[kind].items()
            }
    try:
        recipe = Recipe(**fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        raise InputError(f"invalid recipe: {loc}: {err['msg']}", where=file) from None
    if recipe.default_variant not in recipe.variants:
        raise InputError(f"default_variant {recipe.default_variant!r} is not among the variants", where=file)
    return recipe


def load_recipe(path: Path) -> Recipe:
    """A user's recipe file (`recipes validate`): always parsed, never cached."""
    raw = read_bytes(path, "recipe file")
    return _recipe_from_data(_parse_recipe(raw, path=path))


@cache
def builtin_recipes() -> dict[str, Recipe]:
    recipes: dict[str, Recipe] = {}
    for path in sorted(recipes_dir().glob("*.yaml")):
        if path.stem in ("models", "defaults"):
            continue
        recipe = _recipe_from_data(parsed(path, functools.partial(_parse_recipe, path=path)))
        recipes[recipe.recipe] = recipe
    return recipes


def get_recipe(name: str) -> Recipe:
    recipes = builtin_recipes()
    if name in recipes:
        return recipes[name]
    close = close_matches(name, list(recipes), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise InputError(f"unknown recipe {name!r}", hint=f"{hint}choose one of: {', '.join(recipes)}")


def _parse_defaults(raw: bytes, path: Path) -> dict[str, list[Any]]:
    # lazy: m31ctl.plan.yamlfile loads PyYAML; a plan served from the memo never parses YAML
    from m31ctl.plan.yamlfile import compose_yaml, flatten_node, mapping_items

    file = _display(path)
    node = compose_yaml(decode(raw, path, "defaults file"), file)
    for key, value_node, _line in mapping_items(node, file) if node is not None else ():
        if key == "settings":
            layer = flatten_node(value_node, file, lambda f, ln: Source("defaults", f, ln, "defaults"))
            return layer_to_data(layer)
    return {}


@cache
def defaults_layer() -> Layer:
    path = recipes_dir() / "defaults.yaml"
    data: dict[str, list[Any]] = parsed(path, lambda raw: _parse_defaults(raw, path))
    return layer_from_data(data)


class Sourced(_CatalogModel):
    """A model fact with where it comes from: a number nobody can trace is a guess."""

    value: int | str
    source: str = Field(min_length=8)
    # False: nobody has published this figure for this model; the value is a stand-in (its
    # source says which), and every plan of the model names it in a warning.
    published: bool = True


class ModelGeometry(_CatalogModel):
    """What sizes the KV cache (docs/capacity.md): per layer, per token."""

    # Which geometry this is, as capacity tables name it ("MiniMax-M3-preview's", ...).
    name: str = "the model's"
    layers: Sourced
    kv_heads: Sourced
    head_dim: Sourced
    dtype: Sourced  # what an "auto" cache dtype stores
    # MSA sparse attention: layers with an indexer key cache, and its vector size.
    sparse_layers: Sourced | None = None
    indexer_dim: Sourced | None = None
    # The speculative draft's own KV cache (DSpark: its dspark/config.json): layers, KV heads
    # and head size per token, in the main cache's dtype unless the speculative config sets one.
    draft_layers: Sourced | None = None
    draft_kv_heads: Sourced | None = None
    draft_head_dim: Sourced | None = None

    def unpublished(self) -> list[str]:
        """The facts no one has published for this model, as `name=value`."""
        return [
            f"{name}={fact.value}" for name, fact in self if isinstance(fact, Sourced) and not fact.published
        ]


class ModelLimits(_CatalogModel):
    """What vLLM checks a plan against when it builds its config (m31ctl/plan/engine_rules.py),
    for when the checkpoint's own config.json is not on this host."""

    attention_heads: Sourced | None = None
    max_position_embeddings: Sourced | None = None
    # MSA: the sparse block size the KV cache block size must equal.
    sparse_block_size: Sourced | None = None
    # MSA: the blocks the indexer selects per query (its window: this x sparse_block_size tokens).
    sparse_topk_blocks: Sourced | None = None
    # The DSpark draft's block size (its dspark/config.json): tokens one draft step proposes.
    draft_block_size: Sourced | None = None


class ModelFacts(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)
    id: str
    display_name: str
    hf_repo: str
    params_total_b: float
    params_active_b: float
    checkpoint_gb: float
    expert_weights: str
    dense_weights: str
    # The launch post's KV bytes per token (main attention only): the published basis.
    published_kv_bytes_per_token: dict[str, int] = Field(default_factory=dict)
    geometry: ModelGeometry
    limits: ModelLimits = Field(default_factory=ModelLimits)
    max_context: int
    modalities: tuple[str, ...]
    draft: dict[str, str] | None = None
    compare_with: tuple[str, ...] = ()


def _parse_models(raw: bytes) -> Any:
    from m31ctl.plan.yamlfile import safe_load  # lazy: PyYAML, as above

    return safe_load(raw.decode("utf-8"))


@cache
def model_facts() -> dict[str, ModelFacts]:
    data = parsed(recipes_dir() / "models.yaml", _parse_models)
    return {key: ModelFacts(id=key, **value) for key, value in data["models"].items()}


def get_model(model_id: str) -> ModelFacts:
    models = model_facts()
    if model_id not in models:
        raise InputError(f"unknown model {model_id!r}", hint=f"known models: {', '.join(models)}")
    return models[model_id]


def select_recipe(hw: Hardware) -> Recipe:
    """The recipe that serves this hardware's family; a clear refusal when none does."""
    if hw.count == 0:
        raise UnsupportedHardware(
            "no GPU found on this host",
            hint="pass --hardware (e.g. --hardware b300x4) to plan for another host",
        )
    for recipe in builtin_recipes().values():
        match = recipe.match
        if match.vendor == hw.vendor and (
            hw.arch in match.archs if match.archs else hw.family in match.families
        ):
            return recipe
    found = f"{hw.count}x {hw.product or 'GPU'} ({describe_arch(hw.arch)})"
    # A host named by --hardware: the remedy is another name, not the flag the user just passed.
    other = (
        "--hardware names one they serve (b300x4, h200x8, mi355xx8, ...)"
        if hw.simulated
        else "pass --hardware or --recipe to plan for other hardware"
    )
    raise UnsupportedHardware(
        f"{found} is not supported by any recipe",
        hint="recipes exist for Hopper (9.0), Blackwell (10.0, 10.3), Rubin (10.7) and MI350 (gfx950); "
        + other,
    )


class RecipeMatch(NamedTuple):
    """`probe`'s answer about recipes: the one that serves this hardware, or why none does."""

    recipe: Recipe | None
    reason: str | None = None

    def enough_gpus(self, hw: Hardware) -> bool:
        return self.recipe is not None and hw.count >= self.recipe.match.min_gpus


def match_recipe(hw: Hardware) -> RecipeMatch:
    try:
        return RecipeMatch(select_recipe(hw))
    except UnsupportedHardware as exc:
        return RecipeMatch(None, exc.one_line())
