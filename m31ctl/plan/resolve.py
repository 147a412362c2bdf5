"""Layered resolution into one typed, immutable plan whose every value knows its source."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from pydantic import BaseModel, ValidationError

from m31ctl.checkpoint import model_source
from m31ctl.errors import InputError, M31Error, RuleViolation
from m31ctl.hardware import PRODUCTS, SERVED_ARCHS, Hardware, cpu_host, simulated, vendor_facts
from m31ctl.plan.catalog import (
    ModelFacts,
    Recipe,
    defaults_layer,
    get_model,
    get_recipe,
    load_recipe,
    select_recipe,
)
from m31ctl.plan.checkpoint_facts import checkpoint_facts
from m31ctl.plan.disaggregation import (
    check_disaggregation,
    check_role_engines,
    engine_settings,
    pair_fabric_warnings,
    pair_wider_than_host,
)
from m31ctl.plan.engine_check import check_engine
from m31ctl.plan.layers import Layer, Setting, Source, merge, parse_set, unflatten
from m31ctl.plan.rdma import check_fabric
from m31ctl.plan.rollout import decide_rollout
from m31ctl.plan.runtime_notes import runtime_warnings
from m31ctl.plan.runtime_shapes import (
    MoELayout,
    apply_decode_limit,
    decide_expert,
    decode_limits,
    moe_layout,
    shape_warnings,
)
from m31ctl.plan.setting_errors import validation_error
from m31ctl.plan.settings import Parallelism, PlanSettings

DEFAULT_PROFILE = "latency"


class PlanRequest(NamedTuple):
    """What the user asked for: everything `plan`, `render`, `launch` and `doctor` share."""

    hardware: Hardware
    recipe: str | None = None
    variant: str | None = None
    profile: str | None = None  # None: DEFAULT_PROFILE
    files: tuple[Path, ...] = ()
    sets: tuple[str, ...] = ()

    def option_words(self) -> list[str]:
        """The plan options besides the host, as a command line spells them."""
        return option_words(self.recipe, self.variant, self.profile, self.files, self.sets)


def option_words(
    recipe: str | None, variant: str | None, profile: str | None, files: Sequence[Path], sets: Sequence[str]
) -> list[str]:
    """`--recipe R --variant V --profile P -f FILE... --set K=V...`, each given one as given: the
    one spelling of a plan's options for the commands m31ctl says to run (hints, rendered headers)."""
    words: list[str] = []
    for flag, value in (("--recipe", recipe), ("--variant", variant), ("--profile", profile)):
        if value is not None:
            words += [flag, value]
    for path in files:
        words += ["-f", str(path)]
    for expression in sets:
        words += ["--set", expression]
    return words


class Plan(NamedTuple):
    recipe: Recipe
    variant: str
    profile: str
    hardware: Hardware
    model: ModelFacts
    settings: PlanSettings
    provenance: Mapping[str, Source]
    warnings: tuple[str, ...] = ()
    # What was asked (hardware, recipe, variant, profile, -f files, --set), as given: a rendered
    # file says the command that makes it again. Not part of the hash: the settings are.
    request: PlanRequest | None = None

    @property
    def gpus_needed(self) -> int:
        return self.settings.parallelism.gpus

    @property
    def moe_layout(self) -> MoELayout | None:
        """The MoE layer as vLLM builds it for these settings' layout (plan/runtime_shapes.py), for
        every plan of a MoE model, None for a dense one. A P/D pair's roles each have their own:
        the plan of each role engine (Deployment.engines) answers for it."""
        if self.model.expert_weights == "none":
            return None
        return moe_layout(self.settings.parallelism, self.hardware)

    @property
    def max_num_seqs_limit(self) -> int | None:
        """The most sequences per engine the plan's engines (each P/D role's layout) run under
        their runtime rules, or None where none applies (`bench --write-profile` must not write
        more)."""
        heads = msa_query_heads(self.settings, self.model)
        limits = decode_limits(engine_settings(self.settings), self.hardware, heads)
        return min(limit.max_num_seqs for _who, limit in limits) if limits else None

    def settings_dict(self) -> dict[str, Any]:
        # An aggregated plan leaves the disaggregation section out: its identity (hash, lock,
        # rendered labels) stays what it was before P/D existed; the section shows once enabled.
        # The fabric section likewise, until fabric.rdma is set.
        # And kubernetes.spare_gpus until it is said.
        exclude: dict[str, Any] = {} if self.settings.disaggregation.enabled else {"disaggregation": True}
        if self.settings.fabric.rdma is None:
            exclude["fabric"] = True
        if self.settings.kubernetes.spare_gpus is None:
            exclude["kubernetes"] = {"spare_gpus"}
        return self.settings.model_dump(mode="json", exclude=exclude or None)

    @property
    def hash(self) -> str:
        """Identifies what would run: recipe, variant, profile and every setting."""
        # `verify` holds the acceptance gate's load and pass marks: changing them changes what is
        # checked, not what runs, so a server is still the plan's server.
        settings = {k: v for k, v in self.settings_dict().items() if k != "verify"}
        payload = {
            "recipe": self.recipe.recipe,
            "variant": self.variant,
            "profile": self.profile,
            "settings": settings,
        }
        digest = hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode())
        return digest.hexdigest()[:12]

    def explain(self) -> list[tuple[str, Any, str]]:
        """Every leaf setting with its value and source, in key order."""
        rows = []
        for key, value in sorted(_flatten_settings(self.settings_dict()).items()):
            source = self.provenance.get(key)
            rows.append((key, value, str(source) if source else "schema default"))
        return rows


def _flatten_settings(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(_flatten_settings(value, dotted + "."))
        else:
            out[dotted] = value
    return out


def _lookup(tree: Mapping[str, Any], dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return None
        node = node[part]
    return node


def _check_rules(recipe: Recipe, settings: PlanSettings, merged: Layer) -> None:
    tree = settings.model_dump(mode="json")
    for rule in recipe.rules:
        value = _lookup(tree, rule.key)
        if rule.allows(value):
            continue
        setting = merged.get(rule.key)
        culprit = str(setting.source) if setting else "schema default"
        raise RuleViolation(
            f"{rule.key}={value!r} breaks rule {rule.id!r} of the {recipe.recipe} recipe "
            f"({rule.expectation()}: {rule.reason})",
            where=culprit,
            hint=f"remove that override of {rule.key}",
        )


def _fill_host(settings: PlanSettings, merged: Layer, hw: Hardware) -> tuple[PlanSettings, Layer]:
    """parallelism.fill_host: replicate the layout with data parallelism over every GPU of the
    host (one vLLM server: DP ranks on disjoint GPU sets; vLLM's data-parallel deployment)."""
    par = settings.parallelism
    if not par.fill_host or par.nodes > 1:
        return settings, merged
    replicas = hw.count // par.gpus if par.gpus else 0
    if replicas < 2:
        return settings, merged  # nothing to fill: the layout already takes the host (or more)
    data = par.data * replicas
    source = Source("hardware", detail=f"parallelism.fill_host: {replicas} replicas on {hw.count} GPUs")
    filled = settings.model_copy(update={"parallelism": par.model_copy(update={"data": data})})
    return filled, {**merged, "parallelism.data": Setting(data, source)}


def _with_sections(tree: dict[str, Any]) -> dict[str, Any]:
    """Every defaulted section present as a mapping, so PlanSettings validates it inside its own
    schema; a section left to its default_factory would build that model's validator apart, a
    start-up cost for nothing (the result is the same)."""
    for name, info in PlanSettings.model_fields.items():
        annotation = info.annotation
        if (
            info.default_factory is not None
            and isinstance(annotation, type)
            and issubclass(annotation, BaseModel)
        ):
            tree.setdefault(name, {})
    return tree


def _split_across_nodes(settings: PlanSettings, merged: Layer, hw: Hardware) -> tuple[PlanSettings, Layer]:
    """Nodes with fewer GPUs than the tensor-parallel group, when parallelism.nodes asks for
    several: tensor parallelism within a node and pipeline parallelism across nodes, as vLLM's
    multi-node guide and the LeaderWorkerSet example for vLLM do (TP's all-reduces stay on
    NVLink; PP sends one activation per stage boundary). One node never becomes several here."""
    par = settings.parallelism
    per_node = hw.count
    if par.nodes == 1 or not 0 < per_node < par.tensor or par.tensor % per_node or par.pipeline > 1:
        return settings, merged
    stages = par.tensor // per_node
    source = Source(
        "hardware", detail=f"nodes of {per_node} GPUs: TP{per_node} within a node, PP{stages} across nodes"
    )
    split = settings.model_copy(
        update={"parallelism": par.model_copy(update={"tensor": per_node, "pipeline": stages})}
    )
    return split, {
        **merged,
        "parallelism.tensor": Setting(per_node, source),
        "parallelism.pipeline": Setting(stages, source),
    }


def _nodes_problem(par: Parallelism) -> str | None:
    """Why the layout cannot fall evenly on parallelism.nodes, or None. Every node of a group
    gets the same share (one LeaderWorkerSet template per role): pipeline stages one per node
    (over Ray), or data-parallel ranks in equal numbers (vLLM's --data-parallel-size-local)."""
    nodes = par.nodes
    if nodes == 1:
        return None
    if par.pipeline > 1:
        if par.pipeline != nodes or par.data > 1:
            return (
                f"pipeline stages span the nodes one per node: parallelism.pipeline ({par.pipeline}) must "
                f"equal parallelism.nodes ({nodes}), with parallelism.data=1"
            )
        return None
    if par.data % nodes:
        return (
            f"parallelism.data ({par.data}) must be a multiple of parallelism.nodes ({nodes}): each node "
            "runs the same number of data-parallel ranks (vLLM's --data-parallel-size-local)"
        )
    return None


def _check_nodes(settings: PlanSettings, merged: Layer) -> None:
    problem = _nodes_problem(settings.parallelism)
    if problem:
        setting = merged.get("parallelism.nodes")
        raise InputError(
            problem,
            where=str(setting.source) if setting else None,
            hint="change parallelism.nodes, .data or .tensor so the layout divides over the nodes",
        )


def resolve(request: PlanRequest, recipe: Recipe | None = None, *, advise: bool = True) -> Plan:
    """Merge the layers and validate. `recipe` overrides request.recipe (used by `recipes validate`).
    `advise`: warnings may advise a setting, each checked by resolving the plan with it first."""
    if recipe is None:
        recipe = get_recipe(request.recipe) if request.recipe else select_recipe(request.hardware)
    variant = recipe.variant(request.variant)
    profile = recipe.profile(request.profile or DEFAULT_PROFILE)
    layers: list[Layer] = [defaults_layer(), recipe.layer, variant.layer, profile.layer]
    if request.files:
        from m31ctl.plan.yamlfile import load_layer_file  # lazy: PyYAML, only for -f files

        layers += [load_layer_file(path) for path in request.files]
    layers += [parse_set(expr, i) for i, expr in enumerate(request.sets, start=1)]
    merged = merge(layers)
    try:
        settings = PlanSettings.model_validate(_with_sections(unflatten(merged)))
    except ValidationError as exc:
        raise validation_error(exc, merged) from None
    settings, merged = _fill_host(settings, merged, request.hardware)
    _check_rules(recipe, settings, merged)
    # After the rules: they constrain the layout the recipe asks for (TP8 on Hopper); the split
    # only maps that layout onto nodes smaller than it.
    settings, merged = _split_across_nodes(settings, merged, request.hardware)
    _check_nodes(settings, merged)
    model = get_model(settings.model.id)
    # Runtime shapes (plan/runtime_shapes.py): expert parallelism decided, the decode row limit
    # set or enforced, over each engine's own layout (a P/D pair's roles), before the engine
    # rules read the final settings.
    settings, merged = decide_expert(settings, merged, model, engine_settings(settings))
    heads = msa_query_heads(settings, model)
    settings, merged = apply_decode_limit(
        settings, merged, request.hardware, heads, engine_settings(settings)
    )
    check_disaggregation(settings, merged, request.hardware, model)
    check_fabric(settings, merged, request.hardware)
    settings, merged = decide_rollout(settings, merged)
    # A disaggregated plan runs two engines, each refused as the server it is.
    engine_check = check_role_engines if settings.disaggregation.enabled else check_engine
    return Plan(
        recipe=recipe,
        variant=variant.name,
        profile=profile.name,
        hardware=request.hardware,
        model=model,
        settings=settings,
        provenance=MappingProxyType({k: s.source for k, s in merged.items()}),
        request=request,
        warnings=_warnings(recipe, settings, request.hardware)
        + gpu_use_notes(request, recipe, settings, advise)
        + runtime_warnings(settings, request.hardware)
        + shape_warnings(settings, request.hardware, model, engine_settings(settings))
        + pair_fabric_warnings(settings, request.hardware, model)
        + unpublished_warnings(settings, model)
        + engine_check(settings, merged, request.hardware),
    )


def msa_query_heads(settings: PlanSettings, model: ModelFacts) -> int | None:
    """A MiniMax Sparse Attention model's query heads (the checkpoint's config.json where it is
    on this host, else recipes/models.yaml), or None for another model."""
    facts = checkpoint_facts(settings, model)
    return facts.attention_heads.value if facts.attention_heads and facts.sparse_block_size else None


def unpublished_warnings(settings: PlanSettings, model: ModelFacts) -> tuple[str, ...]:
    """The model facts capacity uses that no one has published (recipes/models.yaml
    `published: false`), unless the checkpoint's own config.json is on this host."""
    local = model_source(settings.model.path).host_path
    if local is not None and (Path(local) / "config.json").is_file():
        return ()
    geometry = model.geometry
    notes = []
    unpublished = geometry.unpublished()
    if unpublished:
        notes.append(
            f"capacity for {model.display_name} uses unpublished geometry: {', '.join(unpublished)} "
            f"(recipes/models.yaml, {geometry.name}); the checkpoint's config.json settles it once "
            "model.path is a local copy"
        )
    if settings.speculative.method != "none" and geometry.draft_layers is None:
        notes.append(
            f"capacity does not count the {settings.speculative.method} draft's KV cache (it shares the "
            "pool, in the main cache's dtype): its geometry is unpublished (the checkpoint's "
            "dspark/config.json states it once model.path is a local copy)"
        )
    return tuple(notes)


def _warnings(recipe: Recipe, settings: PlanSettings, hw: Hardware) -> tuple[str, ...]:
    notes = []
    if recipe.status == "preview":
        notes.append(f"the {recipe.recipe} recipe is a preview: {recipe.description}")
    if recipe.status == "rehearsal":
        notes.append("rehearsal recipe: for CI and dry runs only, it does not serve MiniMax-M3.1-Flash")
    return tuple(notes)


def gpu_use_notes(
    request: PlanRequest, recipe: Recipe, settings: PlanSettings, advise: bool
) -> tuple[str, ...]:
    """How much of the host the plan uses, and a setting that uses more where one resolves: the
    advice is the plan resolved again with it (every rule, the P/D ones included), so a plan
    never advises what it would then refuse. A P/D pair counts both roles; one that needs more
    than the host says which targets place it (Kubernetes) and which refuse it."""
    hw = request.hardware
    if not vendor_facts(hw.vendor).gpus:
        return ()
    if settings.disaggregation.enabled:
        return _pair_gpu_notes(request, recipe, settings, advise)
    par = settings.parallelism
    per_node = par.gpus // par.nodes
    # Too few GPUs is refused when the plan is deployed (deployment.require_fit), not noted here.
    if par.nodes > 1 or hw.count <= per_node:
        return ()
    fill = "parallelism.fill_host=true"
    hint = (
        f"; --set {fill} serves on all {hw.count} (data parallelism over the host)"
        if hw.count // per_node >= 2 and advise and _advice_resolves(request, recipe, fill)
        else ""
    )
    return (f"the plan uses {per_node} of the {hw.count} GPUs{hint}",)


def _pair_gpu_notes(
    request: PlanRequest, recipe: Recipe, settings: PlanSettings, advise: bool
) -> tuple[str, ...]:
    hw = request.hardware
    (_, prefill), (_, decode) = engine_settings(settings)
    if prefill.parallelism.nodes > 1 or decode.parallelism.nodes > 1:
        return ()  # roles over nodes of their own: Kubernetes only, said by the targets that refuse it
    p, d = prefill.parallelism.gpus, decode.parallelism.gpus
    if p + d > hw.count:
        return (
            f"{pair_wider_than_host(p, d, hw.product, hw.count)}: only Kubernetes places it, each role on a "
            "node of its own (render --target k8s); compose, script, systemd and launch run the pair on "
            "one host and refuse it (exit 6)",
        )
    if p + d == hw.count:
        return ()
    note = f"the prefill/decode pair uses {p + d} of the {hw.count} GPUs ({p} prefill, {d} decode)"
    replica = d // decode.parallelism.data
    data = (hw.count - p) // replica
    more = f"disaggregation.decode.data={data}"
    if advise and data > decode.parallelism.data and _advice_resolves(request, recipe, more):
        note += f"; --set {more} serves on {p + data * replica} (decode replicas over the host)"
    return (note,)


def _advice_resolves(request: PlanRequest, recipe: Recipe, setting: str) -> bool:
    """Whether the plan with `setting` added resolves (the same rules the user would meet)."""
    try:
        resolve(request._replace(sets=(*request.sets, setting)), recipe, advise=False)
    except M31Error:
        return False
    return True


def _host_for(recipe: Recipe) -> Hardware:
    """A simulated host the recipe matches, with GPUs to spare, to resolve every combination."""
    if not vendor_facts(recipe.match.vendor).gpus:
        return cpu_host()
    archs = [a for a, fam in SERVED_ARCHS.items() if fam.id in recipe.match.families]
    product = next((p for p in PRODUCTS.values() if p.arch in archs), None)
    if product is None:
        raise InputError(
            f"recipe {recipe.recipe} matches no known hardware (families {list(recipe.match.families)})",
            where=recipe.path,
            hint="use families hopper, blackwell, rubin, mi350 or cpu",
        )
    return simulated(f"{product.id}x{max(recipe.match.min_gpus, 8)}")


def check_recipe_file(path: Path) -> tuple[Recipe, list[tuple[str, str, str]]]:
    """`recipes validate`: load a recipe file and resolve every supported variant x profile
    on a host it matches; (variant, profile, plan hash) for each, or the first error."""
    recipe = load_recipe(path)
    hw = _host_for(recipe)
    checked = []
    for variant in recipe.variants:
        for profile, option in recipe.profiles.items():
            if not option.unsupported:
                plan = resolve(PlanRequest(hardware=hw, variant=variant, profile=profile), recipe=recipe)
                checked.append((variant, profile, plan.hash))
    return recipe, checked
