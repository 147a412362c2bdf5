"""Reading what `m31ctl ... --json` printed: every test reads a command's JSON through here, so
the output's shape (the envelope of docs/json.md) is spelled in one place, and checked each time.

- `data(text)`: a command's result (a single JSON document, or a JSON Lines stream's last line);
- `error(text)`: the error it ended with (`{"type", "message", "hint", "exit_code", ...}`);
- `events(text)`: a stream's events, each as `{"event": KIND, **its data}`;
- `stream(text)`: those events, then `{"event": "result", **data}` or `{"event": "error", **error}`;
- `captured(text)`, `captured_lines(text)`: what a device run recorded, in the envelope or from
  before it (files under tests/fixtures that a script captured with the old shape stay readable).
"""

from __future__ import annotations

import json
from typing import Any

VERSION = 1
_HEAD = {"m31ctl", "command"}


def envelopes(text: str) -> list[dict[str, Any]]:
    """Every envelope printed: one pretty-printed document, or one per line (JSON Lines)."""
    try:
        found = [json.loads(text)]
    except json.JSONDecodeError:
        found = [json.loads(line) for line in text.splitlines() if line.strip()]
    for one in found:
        _check(one)
    return found


def _check(one: Any) -> None:
    assert isinstance(one, dict) and one.get("m31ctl") == VERSION, one
    assert isinstance(one["command"], (str, type(None))), one
    if "event" in one:
        assert set(one) == {*_HEAD, "event", "data"} and isinstance(one["event"], str), one
    elif one.get("ok") is True:
        assert set(one) == {*_HEAD, "ok", "data"}, one
    else:
        assert one.get("ok") is False and set(one) == {*_HEAD, "ok", "error"}, one
        assert {"type", "message", "hint", "exit_code"} <= set(one["error"]), one


def _last(text: str) -> dict[str, Any]:
    found = envelopes(text)
    assert found and "ok" in found[-1], text[-2000:]
    assert all("ok" not in one for one in found[:-1]), "a result before the end of the stream"
    return found[-1]


def data(text: str) -> Any:
    """The result a command printed with --json (a stream's last line)."""
    last = _last(text)
    assert last["ok"] is True, last
    return last["data"]


def error(text: str) -> dict[str, Any]:
    """The error a command ended with under --json."""
    last = _last(text)
    assert last["ok"] is False, last
    error: dict[str, Any] = last["error"]
    return error


def events(text: str) -> list[dict[str, Any]]:
    """A JSON Lines stream's events, each as {"event": KIND, **data} (launch's phases, pull's
    progress, bench's points); the result's line is left out."""
    return [{"event": one["event"], **one["data"]} for one in envelopes(text) if "event" in one]


def stream(text: str) -> list[dict[str, Any]]:
    """A JSON Lines stream as one list: its events ({"event": KIND, **data}), then its end:
    {"event": "result", **data} or {"event": "error", **error}."""
    last = _last(text)
    end = {"event": "result", **last["data"]} if last["ok"] else {"event": "error", **last["error"]}
    return [*events(text), end]


def captured(text: str) -> Any:
    """What a device run recorded of a command's --json: unwrapped when it has the envelope, as it
    is otherwise (captured before the envelope, or a report written with -o, which has none)."""
    return _unwrapped(json.loads(text))


def captured_lines(text: str) -> list[Any]:
    """A recorded JSON Lines stream (its lines that start with "{"), each line as captured() reads
    it, events as {"event": KIND, **data}: the shape the stream had before the envelope."""
    return [_unwrapped(json.loads(line)) for line in text.splitlines() if line.startswith("{")]


def _unwrapped(found: Any) -> Any:
    if not (isinstance(found, dict) and "m31ctl" in found and "command" in found):
        return found
    _check(found)
    if "event" in found:
        return {"event": found["event"], **found["data"]}
    return found["data"] if found["ok"] else found["error"]
