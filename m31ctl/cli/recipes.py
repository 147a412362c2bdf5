"""`m31ctl recipes list | show NAME | validate FILE`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from m31ctl.cli.output import console, emit_json, table
from m31ctl.plan.recipes import Recipe, builtin_recipes, get_recipe
from m31ctl.plan.resolve import check_recipe_file


def summary(recipe: Recipe) -> dict[str, Any]:
    return {
        "name": recipe.recipe,
        "status": recipe.status,
        "description": recipe.description,
        "file": recipe.path,
        "match": recipe.match.model_dump(mode="json"),
        "recommended": recipe.recommended.model_dump(mode="json", exclude_none=True),
        "rules": [r.model_dump(mode="json", exclude_none=True) for r in recipe.rules],
        "default_variant": recipe.default_variant,
        "variants": {n: o.description for n, o in recipe.variants.items()},
        "profiles": {
            n: (f"unsupported: {o.unsupported}" if o.unsupported else o.description)
            for n, o in recipe.profiles.items()
        },
    }


def list_recipes(as_json: bool) -> None:
    recipes = builtin_recipes()
    if as_json:
        emit_json({"recipes": [summary(r) for r in recipes.values()]})
        return
    t = table(None, ["recipe", "status", "hardware", "min GPUs", "variants", "profiles"])
    for r in recipes.values():
        profiles = [n for n, o in r.profiles.items() if not o.unsupported]
        t.add_row(
            r.recipe,
            r.status,
            ", ".join(r.match.products) or ", ".join(r.match.families),
            str(r.match.min_gpus),
            ", ".join(r.variants),
            ", ".join(profiles),
        )
    console().print(t)


def show(name: str, as_json: bool) -> None:
    data = summary(get_recipe(name))
    if as_json:
        emit_json(data)
        return
    from rich.text import Text

    out = console()
    out.print(Text(f"{data['name']} ({data['status']}): {data['description']}", style="bold"))
    out.print(Text(f"file: {data['file']}"))
    match = data["match"]
    out.print(
        Text(
            f"matches: {match['vendor']} {', '.join(match['families'])} "
            f"({', '.join(match['products']) or 'any product'}), at least {match['min_gpus']} GPUs"
        )
    )
    for key, value in data["recommended"].items():
        out.print(Text(f"recommended {key}: {value}"))
    for rule in data["rules"]:
        cond = {k: v for k, v in rule.items() if k in ("equals", "one_of", "not_in")}
        out.print(Text(f"rule {rule['id']}: {rule['key']} {cond} because {rule['reason']}"))
        out.print(Text(f"  source: {rule['source']}"))
    for kind in ("variants", "profiles"):
        for option, text in data[kind].items():
            marker = " (default)" if kind == "variants" and option == data["default_variant"] else ""
            out.print(Text(f"{kind[:-1]} {option}{marker}: {text}"))


def validate(path: Path, as_json: bool) -> None:
    """Load a recipe file and resolve every variant x profile; the first error is the answer."""
    recipe, checked = check_recipe_file(path)
    if as_json:
        emit_json(
            {
                "file": str(path),
                "recipe": recipe.recipe,
                "valid": True,
                "checked": [{"variant": v, "profile": p, "plan_hash": h} for v, p, h in checked],
            }
        )
        return
    console().print(
        f"{path}: recipe {recipe.recipe} is valid ({len(checked)} variant x profile combinations resolve)",
        markup=False,
    )


def constraints_markdown() -> str:
    """docs/constraints.md: every hard rule of every built-in recipe, generated so it cannot drift
    (`python scripts/gen-constraints`; a test compares the file with this)."""
    lines = [
        "# Hard constraints",
        "",
        "Generated from the `rules:` of each recipe by `scripts/gen-constraints`; do not edit.",
        "A plan that breaks one is refused at plan time (exit 2), naming the rule and the layer that broke it.",
        "",
        "| rule | recipe | setting | must | reason | source |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for recipe in builtin_recipes().values():
        for rule in recipe.rules:
            cells = [rule.id, recipe.recipe, f"`{rule.key}`", rule.expectation(), rule.reason, rule.source]
            lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines) + "\n"
