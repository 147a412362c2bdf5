"""`m31ctl recipes list | show NAME | validate FILE`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m31ctl.cli.output import console, emit, text_view
from m31ctl.cli.screen import print_paragraph, print_table
from m31ctl.plan.catalog import Recipe, Rule, builtin_recipes, get_recipe
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


@dataclass(frozen=True)
class RecipeList:
    """`recipes list`: the built-in recipes."""

    recipes: list[Recipe]

    def to_json(self) -> dict[str, Any]:
        return {"recipes": [summary(r) for r in self.recipes]}


@dataclass(frozen=True)
class RecipeShown:
    """`recipes show NAME`: one recipe's summary."""

    data: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return self.data


@dataclass(frozen=True)
class RecipeChecked:
    """`recipes validate FILE`: the recipe, and every variant x profile that resolved (with its plan hash)."""

    path: Path
    recipe: Recipe
    checked: list[tuple[str, str, str]]

    def to_json(self) -> dict[str, Any]:
        return {
            "file": str(self.path),
            "recipe": self.recipe.recipe,
            "valid": True,
            "checked": [{"variant": v, "profile": p, "plan_hash": h} for v, p, h in self.checked],
        }


def list_recipes(as_json: bool) -> None:
    emit(RecipeList(list(builtin_recipes().values())), as_json)


@text_view(RecipeList)
def _list_text(listed: RecipeList) -> None:
    recipes = listed.recipes
    rows = [
        [
            r.recipe,
            r.status,
            ", ".join(r.match.products) or ", ".join(r.match.families),
            str(r.match.min_gpus),
            ", ".join(r.variants),
            ", ".join(n for n, o in r.profiles.items() if not o.unsupported),
        ]
        for r in recipes
    ]
    print_table(console(), None, ["recipe", "status", "hardware", "min GPUs", "variants", "profiles"], rows)


def show(name: str, as_json: bool) -> None:
    emit(RecipeShown(summary(get_recipe(name))), as_json)


@text_view(RecipeShown)
def _show_text(shown: RecipeShown) -> None:
    data = shown.data
    out = console()
    print_paragraph(out, f"{data['name']} ({data['status']}): {data['description']}", style="bold")
    print_paragraph(out, f"file: {data['file']}")
    match = data["match"]
    print_paragraph(
        out,
        f"matches: {match['vendor']} {', '.join(match['families'])} "
        f"({', '.join(match['products']) or 'any product'}), at least {match['min_gpus']} GPUs",
    )
    for key, value in data["recommended"].items():
        print_paragraph(out, f"recommended {key}: {value}")
    for rule in data["rules"]:
        said = Rule.model_validate(rule).condition()  # the JSON's structure, said in words
        print_paragraph(out, f"rule {rule['id']}: {rule['key']} {said} because {rule['reason']}")
        print_paragraph(out, f"  source: {rule['source']}")
    for kind in ("variants", "profiles"):
        for option, text in data[kind].items():
            marker = " (default)" if kind == "variants" and option == data["default_variant"] else ""
            print_paragraph(out, f"{kind[:-1]} {option}{marker}: {text}")


def validate(path: Path, as_json: bool) -> None:
    """Load a recipe file and resolve every variant x profile; the first error is the answer."""
    recipe, checked = check_recipe_file(path)
    emit(RecipeChecked(path, recipe, list(checked)), as_json)


@text_view(RecipeChecked)
def _checked_text(found: RecipeChecked) -> None:
    console().print(
        f"{found.path}: recipe {found.recipe.recipe} is valid "
        f"({len(found.checked)} variant x profile combinations resolve)",
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
