"""docs/engine-rules.md, generated (scripts/gen-constraints) from the engine rules, the runtime
shapes and the engine capability table, so the reference cannot drift from what is checked
(tests/engine/test_engine_truth.py compares the two).
"""

from __future__ import annotations

from m31ctl.plan.engine_capabilities import capability_table
from m31ctl.plan.engine_rules import ENGINE_RULES
from m31ctl.plan.runtime_shapes import RUNTIME_RULES


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def engine_rules_markdown() -> str:
    table = capability_table()
    lines = [
        "# Engine rules and capabilities",
        "",
        "Generated from `m31ctl/plan/engine_rules.py` and `recipes/engines/capabilities.yaml` by",
        "`scripts/gen-constraints`; do not edit. Checked when a plan is resolved: a plan that breaks a",
        "rule, or uses a capability its engine image lacks, is refused (exit 2) naming the setting, the",
        "image and the source; an image the table does not list, or an `unknown` answer, is a warning.",
        "Model facts come from the checkpoint's config.json when it is on this host (model.path, or the",
        "Hugging Face cache under runtime.hf_cache), else `recipes/models.yaml`.",
        "",
        "## Rules",
        "",
        "| rule | setting | must | mirrors |",
        "| --- | --- | --- | --- |",
    ]
    for rule in ENGINE_RULES:
        lines.append(f"| {rule.id} | `{rule.key}` | {_cell(rule.summary)} | {_cell(rule.source)} |")
    lines += [
        "",
        "## Runtime shapes",
        "",
        "Limits vLLM meets only under load, and the MoE layout it builds (m31ctl/plan/runtime_shapes.py):",
        "set or refused before launch, or stated as a warning.",
        "",
        "| rule | setting | must | source |",
        "| --- | --- | --- | --- |",
    ]
    for shape in RUNTIME_RULES:
        lines.append(f"| {shape.id} | `{shape.key}` | {_cell(shape.summary)} | {_cell(shape.source)} |")
    lines += [
        "",
        "## Engine images",
        "",
        "| engine | platform | vLLM base | images |",
        "| --- | --- | --- | --- |",
    ]
    for engine in table.engines:
        images = ", ".join(f"`{i}`" for i in engine.images)
        lines.append(
            f"| {engine.id} ({_cell(engine.description)}) | {engine.platform.value} | {engine.vllm} | {images} |"
        )
    lines += ["", "## Capabilities", "", "`claimed`: the launch post says so, no code seen.", ""]
    for capability in table.capabilities.values():
        lines += [
            f"### {capability.id}: {capability.name}",
            "",
            "| engine | has | source |",
            "| --- | --- | --- |",
        ]
        for engine in table.engines:
            answer = capability.answer(engine.id)
            has = "unknown" if answer is None else str(answer.has).lower()
            source = answer.source if answer else ""
            lines.append(f"| {engine.id} | {has} | {_cell(source)} |")
        lines.append("")
    return "\n".join(lines)
