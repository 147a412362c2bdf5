"""`m31ctl smoke`: one chat completion and one streamed, against any OpenAI-compatible endpoint
m31ctl launched; checks the answers' shape and usage, measures time to first token and
tokens per second. Answers are read defensively (http_answers.py): a broken or hostile server
fails a check, with what it sent, redacted and shortened."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from m31ctl.checks import CheckResult, judged
from m31ctl.errors import CheckFailed, HostPreconditionError, InputError
from m31ctl.redact import API_KEY_ENV, header_safe
from m31ctl.served import http_answers
from m31ctl.served.http_answers import Unreadable, as_int, as_list, as_object, as_str, glimpse

PROMPT = "Say hello to the platform team in one short sentence."
CHAT = "/v1/chat/completions"


@dataclass
class SmokeReport:
    endpoint: str
    model: str
    checks: list[CheckResult] = field(default_factory=list)
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    completion_tokens: int | None = None
    latency_s: float | None = None

    @property
    def ok(self) -> bool:
        return not any(c.failed for c in self.checks)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append(judged(name, ok, detail))

    def to_json(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "model": self.model,
            "ok": self.ok,
            "checks": [c.to_json() for c in self.checks],
            "ttft_s": _round(self.ttft_s),
            "tokens_per_s": _round(self.tokens_per_s),
            "completion_tokens": self.completion_tokens,
            "latency_s": _round(self.latency_s),
        }


def _round(value: float | None) -> float | None:
    return round(value, 3) if value is not None else None


def _usage_ok(usage: Any) -> tuple[bool, str]:
    if not isinstance(usage, dict):
        return False, "no usage object"
    p, c, t = (as_int(usage.get(k)) for k in ("prompt_tokens", "completion_tokens", "total_tokens"))
    if p is None or c is None or t is None:
        return False, f"usage figures are not integers: {glimpse(usage)}"
    return p > 0 and c > 0 and t == p + c, f"prompt {p}, completion {c}, total {t}"


def auth_headers() -> dict[str, str]:
    """The Authorization header for a server that wants the API key (none when it is unset)."""
    key = os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {header_safe(API_KEY_ENV, key)}"} if key else {}


def run(base: str, model: str | None, max_tokens: int = 16, timeout: float = 120.0) -> SmokeReport:
    try:
        client = httpx.Client(base_url=base, headers=auth_headers(), timeout=timeout)
    except httpx.InvalidURL as exc:
        raise InputError(f"bad server URL {base!r}: {exc}", hint="e.g. --url http://127.0.0.1:8000") from None
    try:
        ids = _served(client, base, timeout)
        model = model or (ids[0] if ids else "")
        report = SmokeReport(base, model)
        report.check("models", model in ids, f"served: {glimpse(', '.join(ids)) if ids else 'none'}")
        body = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        if _chat(client, body, report, timeout):
            _stream(
                client, {**body, "stream": True, "stream_options": {"include_usage": True}}, report, timeout
            )
    finally:
        client.close()
    return report


def _served(client: Any, base: str, timeout: float) -> list[str]:
    """The model ids /v1/models lists; a server that cannot list them stops smoke here."""
    try:
        listed = http_answers.read(client, "GET", "/v1/models", limit_s=timeout)
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
        raise InputError(f"bad server URL {base!r}: {exc}", hint="e.g. --url http://127.0.0.1:8000") from None
    except httpx.HTTPError as exc:
        raise HostPreconditionError(
            f"{base} does not answer ({exc})", hint="is the server up? `m31ctl status`"
        ) from None
    if listed.status != 200:
        raise CheckFailed(
            f"{base}/v1/models answered {listed.status}{listed.evidence()}",
            hint="set VLLM_API_KEY if the server has a key",
        )
    served = listed.obj().get("data")
    if not isinstance(served, list):
        raise CheckFailed(
            f"{base}/v1/models did not answer an OpenAI model list{listed.evidence()}",
            hint="is it a vLLM server?",
        )
    ids = (as_str(as_object(m).get("id")) for m in served)
    # An id no terminal can show safely (control characters, a megabyte) names no model of ours.
    return [i for i in ids if i is not None and len(i) <= 512 and i.isprintable()]


def _chat(client: Any, body: dict[str, Any], report: SmokeReport, timeout: float) -> bool:
    """The plain completion's checks; False when no answer came (the stream is not tried)."""
    start = time.perf_counter()
    answer = http_answers.fetch(client, "POST", CHAT, body, limit_s=timeout)
    if answer.status == 0:
        report.check("chat", False, answer.problem)
        return False
    report.latency_s = time.perf_counter() - start
    data = answer.obj() if answer.status == 200 else {}
    choices = as_list(data.get("choices"))
    choice = as_object(choices[0]) if choices else {}
    message = as_object(choice.get("message"))
    ok = (
        answer.status == 200
        and data.get("object") == "chat.completion"
        and message.get("role") == "assistant"
        and isinstance(message.get("content"), str)
    )
    finish = choice.get("finish_reason")
    shown = (
        finish if finish is None or (isinstance(finish, str) and len(finish) <= 40) else glimpse(finish, 40)
    )
    report.check(
        "chat", ok, f"HTTP {answer.status}, finish_reason {shown}" + ("" if ok else answer.evidence())
    )
    usage_ok, detail = _usage_ok(data.get("usage"))
    report.check("chat-usage", usage_ok, detail)
    return True


def _stream(client: Any, body: dict[str, Any], report: SmokeReport, timeout: float) -> None:
    try:
        _read_stream(client, body, report, timeout)
    except (httpx.HTTPError, Unreadable) as exc:  # a stream cut short, too long, or of another shape
        report.check("stream", False, f"the stream broke: {type(exc).__name__}: {glimpse(str(exc), 400)}")


def _content(payload: str) -> tuple[bool, Any]:
    """(whether the event carries generated text, its usage object or None); raises Unreadable
    for an event that is not an OpenAI chat chunk."""
    event, problem = http_answers.parse_json(payload.encode())
    if problem or not isinstance(event, dict):
        raise Unreadable(
            f"a stream event is not a JSON object ({problem or 'another JSON value'}): {glimpse(payload)}"
        )
    choices = event.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise Unreadable(f"a stream event's choices are not a list of objects: {glimpse(payload)}")
    deltas = [c.get("delta") or {} for c in choices]
    if not all(isinstance(d, dict) for d in deltas):
        raise Unreadable(f"a stream event's delta is not an object: {glimpse(payload)}")
    return any(isinstance(d.get("content"), str) and d["content"] for d in deltas), event.get("usage") or None


def _read_stream(client: Any, body: dict[str, Any], report: SmokeReport, timeout: float) -> None:
    start = time.perf_counter()
    first: float | None = None
    last: float | None = None
    chunks = 0
    usage = None
    done = False
    with client.stream("POST", CHAT, json=body) as response:
        status = response.status_code
        if status != 200:
            refused = http_answers.drain(response, limit_s=timeout)
            report.check("stream", False, f"HTTP {status}{refused.evidence()}")
            return
        for payload in http_answers.sse_data(response, limit_s=timeout):
            if payload == "[DONE]":
                done = True
                break
            has_text, event_usage = _content(payload)
            usage = event_usage or usage
            if has_text:
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                chunks += 1
    report.check(
        "stream",
        status == 200 and done and chunks > 0,
        f"HTTP {status}, {chunks} content chunks, {'ended with [DONE]' if done else 'no [DONE]'}",
    )
    ok, detail = _usage_ok(usage)
    report.check("stream-usage", ok, detail)
    if first is not None:
        report.ttft_s = first - start
        report.completion_tokens = as_int(usage.get("completion_tokens")) if isinstance(usage, dict) else None
        if last is not None and last > first and report.completion_tokens:
            report.tokens_per_s = (report.completion_tokens - 1) / (last - first)
