"""Reading a server's answers defensively, for smoke and verify.

The server under test may be broken or hostile: an endless body, JSON nested thousands deep,
objects of the wrong shape, bytes that drive a terminal, or our own API key echoed back. Bodies
are read as a stream with a byte cap and a wall-clock limit (httpx's timeout is per read, so a
slow trickle would pass it), JSON is refused past a nesting depth, and what a check shows of the
answer is redacted, escaped and shortened.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from m31ctl.redact import redact

# Far above any answer smoke or verify asks for (a few hundred tokens, a model list, vLLM's
# /metrics of a few hundred kB), far below what would hurt the machine.
MAX_BODY = 4 * 1024 * 1024
MAX_DEPTH = 64  # OpenAI answers nest about 6 deep
SHOWN = 160  # characters of a server's answer a check message quotes
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


class Unreadable(Exception):
    """An answer that cannot be used: too large, too slow, or of the wrong shape."""


@dataclass(frozen=True)
class Answer:
    status: int  # the HTTP status; 0 when no answer came
    body: bytes  # what came, up to the cap
    data: Any  # the parsed JSON (None when not asked for, or when it did not parse)
    problem: str = ""  # why the body cannot be used, or ""

    def obj(self) -> dict[str, Any]:
        """The JSON object, or {} for anything else (an HTML error page, a list, nothing)."""
        return self.data if isinstance(self.data, dict) else {}

    def evidence(self) -> str:
        """What the server did, for a failed check's message: the problem and its first bytes."""
        parts = [self.problem] if self.problem else []
        if self.body:
            parts.append(f"sent {glimpse(self.body)}")
        return "; " + "; ".join(parts) if parts else ""


def glimpse(raw: object, limit: int = SHOWN) -> str:
    """A short, printable, redacted quote of what a server sent (bytes, text, or a JSON value)."""
    if isinstance(raw, bytes):
        size, unit = len(raw), "bytes"
        text = raw[: limit * 4 + 4096].decode("utf-8", "replace")
    else:
        text = raw if isinstance(raw, str) else repr(raw)
        size, unit = len(text), "characters"
    # Redact before cutting, so that a cut never leaves part of a secret in view: 4096
    # characters past the quote cover any key.
    cut = len(text) > limit
    text = redact(text[: limit + 4096])
    # Control characters escaped: a server's bytes must not drive the terminal.
    text = "".join(ch if ch.isprintable() else _ESCAPES.get(ch, f"\\x{ord(ch):02x}") for ch in text[:limit])
    return f"'{text}'... ({size} {unit})" if cut else f"'{text}'"


def parse_json(raw: bytes) -> tuple[Any, str]:
    """(data, "") or (None, why not)."""
    try:
        data = json.loads(raw)
    except RecursionError:
        return None, f"JSON nested too deep to read (over {MAX_DEPTH} levels)"
    except ValueError as exc:
        return None, f"not JSON ({exc})"
    if not _shallow(data, MAX_DEPTH):
        return None, f"JSON nested deeper than {MAX_DEPTH} levels"
    return data, ""


def _shallow(data: Any, limit: int) -> bool:
    """Whether no container is nested deeper than `limit` (without recursion, which such JSON
    would exhaust in whatever walks it next: redaction, json.dumps)."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        if children and depth > limit:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True


def read(
    client: Any,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    *,
    parse: bool = True,
    limit_s: float = 120.0,
) -> Answer:
    """One request, its body read up to MAX_BODY bytes within `limit_s`. Raises httpx.HTTPError
    when no answer came (no connection, no headers); a body that breaks is the answer's problem."""
    with client.stream(method, path, json=body) as response:
        return drain(response, parse=parse, limit_s=limit_s)


def fetch(
    client: Any,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    *,
    parse: bool = True,
    limit_s: float = 120.0,
) -> Answer:
    """`read`, with no answer at all as an Answer of status 0."""
    try:
        return read(client, method, path, body, parse=parse, limit_s=limit_s)
    except httpx.HTTPError as exc:
        return Answer(0, b"", None, f"no answer: {type(exc).__name__}: {glimpse(str(exc))}")


def drain(response: Any, *, parse: bool = True, limit_s: float = 120.0) -> Answer:
    got = bytearray()
    problem = ""
    deadline = time.monotonic() + limit_s
    try:
        for chunk in response.iter_bytes():
            got += chunk
            if len(got) > MAX_BODY:
                problem = f"the body runs past {MAX_BODY} bytes"
                break
            if time.monotonic() > deadline:
                problem = f"the body took longer than {limit_s:g} s"
                break
    except httpx.HTTPError as exc:  # cut short, or a bad encoding
        problem = f"the body broke: {type(exc).__name__}: {glimpse(str(exc))}"
    raw = bytes(got[:MAX_BODY])
    if problem or not parse:
        return Answer(response.status_code, raw, None, problem)
    data, problem = parse_json(raw)
    return Answer(response.status_code, raw, data, problem)


def sse_data(response: Any, *, limit_s: float = 120.0) -> Iterator[str]:
    """The `data:` payloads of a server-sent event stream, within MAX_BODY bytes and `limit_s`
    (raises Unreadable past either). Lines are split here, not by httpx, whose line reader
    would hold an endless line whole."""
    buffer = bytearray()
    total = 0
    deadline = time.monotonic() + limit_s
    for chunk in response.iter_bytes():
        total += len(chunk)
        if total > MAX_BODY:
            raise Unreadable(
                f"the stream runs past {MAX_BODY} bytes; it ended {glimpse(bytes(buffer[-80:]), 80)}"
            )
        if time.monotonic() > deadline:
            raise Unreadable(f"the stream took longer than {limit_s:g} s")
        buffer += chunk
        while (cut := buffer.find(b"\n")) >= 0:
            line = bytes(buffer[:cut]).rstrip(b"\r")
            del buffer[: cut + 1]
            if line.startswith(b"data:"):
                yield line[len(b"data:") :].strip().decode("utf-8", "replace")


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def as_object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def as_int(value: Any) -> int | None:
    """An integer the server sent (not a bool, which JSON keeps apart but Python does not)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def as_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None
