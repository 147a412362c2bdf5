"""The engine's check of a plan when it is resolved: its rules first, then what its image can run.

vLLM checks much of a configuration only minutes into a start, after the download; this check
refuses (RuleViolation, exit 2) what the engine would refuse (plan/engine_rules.py) or what the
engine image lacks (plan/engine_capabilities.py), blaming the layer that set the value, and
returns warnings for what cannot be checked.
"""

from __future__ import annotations

from typing import Any

from m31ctl.errors import RuleViolation
from m31ctl.hardware import Hardware, vendor_facts
from m31ctl.plan.catalog import get_model
from m31ctl.plan.engine_capabilities import (
    CAPABILITIES_FILE,
    capability_table,
    capability_uses,
    fallback_hint,
)
from m31ctl.plan.engine_rules import ENGINE_RULES
from m31ctl.plan.layers import Layer
from m31ctl.plan.rule_context import RuleContext, rule_context
from m31ctl.plan.settings import PlanSettings


def _culprit(merged: Layer, key: str) -> str:
    setting = merged.get(key)
    return str(setting.source) if setting else "schema default"


def _value(ctx: RuleContext, key: str) -> Any:
    node: Any = ctx.settings.model_dump(mode="json")
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def check_engine(settings: PlanSettings, merged: Layer, hw: Hardware) -> tuple[str, ...]:
    """Refuse (RuleViolation, exit 2) a plan the engine would refuse or its image cannot run;
    return warnings for what cannot be checked. `merged` names the layer that set each value."""
    ctx = rule_context(settings, hw, get_model(settings.model.id))
    for rule in ENGINE_RULES:
        why = rule.check(ctx)
        if why:
            raise RuleViolation(
                f"{rule.key}={_value(ctx, rule.key)!r} breaks engine rule {rule.id!r}: {why} [{rule.source}]",
                where=_culprit(merged, rule.key),
                hint=f"change {rule.key}, or the settings it depends on",
            )
    warnings = _capability_check(ctx, merged)
    if settings.speculative.method == "dspark" and ctx.minimax_m3 and ctx.facts.draft_block_size is None:
        warnings.append(
            f"speculative.tokens={settings.speculative.tokens} is not checked against the DSpark draft's "
            f"block size: {ctx.facts.draft_unknown}"
        )
    return tuple(warnings)


def _capability_check(ctx: RuleContext, merged: Layer) -> list[str]:
    image = ctx.settings.engine.image
    table = capability_table()
    engine = table.engine_for(image)
    uses = capability_uses(ctx)
    gpu = vendor_facts(ctx.hardware.vendor).gpus
    if engine is None:
        if not uses and not gpu:
            return []
        named = [table.capabilities[u.capability].name for u in uses]
        if gpu:
            named.insert(0, f"a {ctx.platform.title} build")
        return [
            f"engine.image={image} is not in m31ctl's engine capability table (recipes/{CAPABILITIES_FILE}): "
            f"cannot check that it has {', '.join(named)}"
        ]
    label = f"{image} ({engine.description})"
    missing: list[str] = []
    fallbacks: list[str] = []
    if engine.platform is not ctx.platform:
        missing.append(
            f"a {ctx.platform.title} build for this host's "
            f"{ctx.hardware.vendor} GPUs: it is a {engine.platform.title} "
            f"build [recipes/{CAPABILITIES_FILE} engines.{engine.id}]"
        )
    unknown: list[str] = []
    for use in uses:
        capability = table.capabilities[use.capability]
        answer = capability.answer(engine.id)
        if answer is None or answer.has == "unknown":
            unknown.append(capability.name)
        elif answer.has is False:
            missing.append(f"{capability.name} ({use.key}={use.value}) [{answer.source}]")
            if capability.fallback is not None:
                fallbacks.append(fallback_hint(ctx, capability.fallback))
    if missing:
        raise RuleViolation(
            f"engine.image={label} lacks what the plan uses: " + "; ".join(missing),
            where=_culprit(merged, "engine.image"),
            hint="; ".join(
                [*fallbacks, "or use an image that has them (recipes/engines/capabilities.yaml)"]
                if fallbacks
                else [
                    "use an image that has them (recipes/engines/capabilities.yaml), or change those settings"
                ]
            ),
        )
    if unknown:
        return [f"engine.image={label}: unknown whether it has {', '.join(unknown)}; not checked"]
    return []
