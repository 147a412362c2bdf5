"""The one output path (m31ctl/cli/output.py emit): a result's JSON is its to_json(), redacted and
canonical; its text is the view registered for its type (or a base type's)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from m31ctl.cli import output
from m31ctl.cli.output import emit, text_view


@dataclass(frozen=True)
class _Found:
    name: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "b": "2", "a": "1"}


class _FoundLater(_Found):
    """A subclass with no view of its own: its base's view prints it."""


@dataclass(frozen=True)
class _Unviewed:
    def to_json(self) -> dict[str, str]:
        return {}


@text_view(_Found)
def _found_text(found: _Found) -> None:
    print(f"found {found.name}")


def test_json_is_to_json_sorted_and_indented(capsys):
    emit(_Found("x"), as_json=True)
    out = capsys.readouterr().out
    assert out == json.dumps({"a": "1", "b": "2", "name": "x"}, indent=2, sort_keys=True) + "\n"


def test_a_json_line_is_one_compact_line(capsys):
    emit(_Found("x"), as_json=True, line=True)
    assert capsys.readouterr().out == '{"a":"1","b":"2","name":"x"}\n'


def test_json_is_redacted(capsys, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "sk-secret-value-123")
    emit(_Found("key sk-secret-value-123"), as_json=True)
    assert "sk-secret-value-123" not in capsys.readouterr().out


def test_text_is_the_registered_view_also_for_a_subclass(capsys):
    emit(_Found("x"), as_json=False)
    emit(_FoundLater("y"), as_json=False)
    assert capsys.readouterr().out == "found x\nfound y\n"


def test_a_result_without_a_view_is_a_bug_not_silence():
    with pytest.raises(TypeError, match="_Unviewed"):
        emit(_Unviewed(), as_json=False)


def test_every_command_result_type_has_a_text_view():
    """Each result class the CLI modules define (a class with to_json) is registered."""
    from m31ctl.cli import (  # noqa: F401  (imported for their registrations)
        app,
        bench,
        bench_compare,
        capacity,
        doctoring,
        launch_views,
        locking,
        pulling,
        recipes,
        rehearsing,
        smoking,
        verifying,
        views,
    )

    modules = [bench, bench_compare, capacity, doctoring, launch_views, locking, pulling, recipes, views, app]
    results = [
        cls
        for module in modules
        for cls in vars(module).values()
        if isinstance(cls, type) and cls.__module__ == module.__name__ and hasattr(cls, "to_json")
    ]
    assert results, "no result types found"
    assert [c.__name__ for c in results if c not in output._TEXT_VIEWS] == []
