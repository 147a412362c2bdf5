"""The one output path (m31ctl/cli/output.py emit): a result's JSON is its to_json(), redacted and
canonical; its text is the view registered for its type (or a base type's)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from m31ctl.cli import output
from m31ctl.cli.output import emit, text_view
from tests.support import cli_json


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


def test_json_is_to_json_in_its_envelope_sorted_and_indented(capsys, monkeypatch):
    monkeypatch.setattr(output, "COMMAND", "plan")
    emit(_Found("x"), as_json=True)
    out = capsys.readouterr().out
    envelope = {"m31ctl": 1, "command": "plan", "ok": True, "data": {"a": "1", "b": "2", "name": "x"}}
    assert out == json.dumps(envelope, indent=2, sort_keys=True) + "\n"
    assert cli_json.data(out) == {"a": "1", "b": "2", "name": "x"}


def test_a_json_line_is_one_compact_line(capsys, monkeypatch):
    monkeypatch.setattr(output, "COMMAND", "launch")
    emit(_Found("x"), as_json=True, line=True)
    out = capsys.readouterr().out
    assert out == '{"command":"launch","data":{"a":"1","b":"2","name":"x"},"m31ctl":1,"ok":true}\n'


def test_a_stream_is_events_then_its_result_each_an_envelope(capsys, monkeypatch):
    monkeypatch.setattr(output, "COMMAND", "launch")
    output.emit_event("phase", {"phase": "loading weights", "elapsed_s": 1.5})
    emit(_Found("x"), as_json=True, line=True)
    out = capsys.readouterr().out
    first, last = out.splitlines()
    assert json.loads(first) == {
        "m31ctl": 1,
        "command": "launch",
        "event": "phase",
        "data": {"phase": "loading weights", "elapsed_s": 1.5},
    }
    assert cli_json.events(out) == [{"event": "phase", "phase": "loading weights", "elapsed_s": 1.5}]
    assert cli_json.data(out) == {"a": "1", "b": "2", "name": "x"} and json.loads(last)["ok"] is True


def test_an_error_under_json_is_its_envelope_with_the_exit_code(tmp_path):
    from tests.conftest import run_cli

    done = run_cli("plan", "--hardware", "bogus9", "--json")
    (line,) = done.stdout.splitlines()  # one line, as a stream's last line would be
    assert done.returncode == 2 and json.loads(line)["command"] == "plan"
    error = cli_json.error(done.stdout)
    assert error["type"] == "InputError" and error["exit_code"] == 2 and "bogus9" in error["message"]


def test_every_command_names_itself_in_the_envelope():
    assert output.command_name(["--quiet", "plan", "--hardware", "b300x4"]) == "plan"
    assert output.command_name(["recipes", "show", "hopper"]) == "recipes show"
    assert output.command_name(["bench", "compare", "a.json"]) == "bench compare"
    assert output.command_name(["bench", "--url", "http://x"]) == "bench"
    assert output.command_name(["--help"]) is None


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
