"""`m31ctl smoke`: one chat completion and one streamed, against any OpenAI-compatible endpoint
m31ctl launched; checks the answers' shape and usage, measures time to first token and
tokens per second."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

from m31ctl.errors import CheckFailed, HostPreconditionError, InputError

PROMPT = "Say hello to the platform team in one short sentence."


@dataclass
class SmokeReport:
    endpoint: str
    model: str
    checks: list[dict[str, Any]] = field(default_factory=list)
    ttft_s: float | None = None
    tokens_per_s: float | None = None
    completion_tokens: int | None = None
    latency_s: float | None = None

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.checks)

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail})

    def to_json(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "model": self.model,
            "ok": self.ok,
            "checks": self.checks,
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
    p, c, t = usage.get("prompt_tokens"), usage.get("completion_tokens"), usage.get("total_tokens")
    if not (isinstance(p, int) and isinstance(c, int) and isinstance(t, int)):
        return False, f"usage figures are not integers: {usage}"
    return p > 0 and c > 0 and t == p + c, f"prompt {p}, completion {c}, total {t}"


def auth_headers() -> dict[str, str]:
    """The Authorization header for a server that wants VLLM_API_KEY (none when it is unset)."""
    key = os.environ.get("VLLM_API_KEY")
    if key and ("\r" in key or "\n" in key):
        raise InputError(
            "VLLM_API_KEY holds a line break, which no HTTP header can carry", hint="fix the variable's value"
        )
    return {"Authorization": f"Bearer {key}"} if key else {}


def run(base: str, model: str | None, max_tokens: int = 16, timeout: float = 120.0) -> SmokeReport:
    import httpx

    try:
        client = httpx.Client(base_url=base, headers=auth_headers(), timeout=timeout)
    except httpx.InvalidURL as exc:
        raise InputError(f"bad server URL {base!r}: {exc}", hint="e.g. --url http://127.0.0.1:8000") from None
    try:
        listed = client.get("/v1/models")
    except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
        client.close()
        raise InputError(f"bad server URL {base!r}: {exc}", hint="e.g. --url http://127.0.0.1:8000") from None
    except httpx.HTTPError as exc:
        client.close()
        raise HostPreconditionError(
            f"{base} does not answer ({exc})", hint="is the server up? `m31ctl status`"
        ) from None
    try:
        if listed.status_code != 200:
            raise CheckFailed(
                f"{base}/v1/models answered {listed.status_code}",
                hint="set VLLM_API_KEY if the server has a key",
            )
        served = _object(listed).get("data")
        if not isinstance(served, list):
            raise CheckFailed(
                f"{base}/v1/models did not answer an OpenAI model list", hint="is it a vLLM server?"
            )
        ids = [str(m.get("id")) for m in served if isinstance(m, dict)]
        model = model or (ids[0] if ids else "")
        report = SmokeReport(base, model)
        report.check("models", model in ids, f"served: {', '.join(ids) or 'none'}")
        body = {
            "model": model,
            "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": max_tokens,
            "temperature": 0,
        }
        start = time.perf_counter()
        try:
            response = client.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as exc:
            report.check("chat", False, f"no answer: {exc}")
            return report
        report.latency_s = time.perf_counter() - start
        data = _object(response) if response.status_code == 200 else {}
        choices = data.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        found = choice.get("message")
        message: dict[str, Any] = found if isinstance(found, dict) else {}
        report.check(
            "chat",
            response.status_code == 200
            and data.get("object") == "chat.completion"
            and message.get("role") == "assistant"
            and isinstance(message.get("content"), str),
            f"HTTP {response.status_code}, finish_reason {choice.get('finish_reason')}",
        )
        ok, detail = _usage_ok(data.get("usage"))
        report.check("chat-usage", ok, detail)
        _stream(client, {**body, "stream": True, "stream_options": {"include_usage": True}}, report)
    finally:
        client.close()
    return report


def _object(response: Any) -> dict[str, Any]:
    """The response's JSON object, or {} for a body that is not one (an HTML error page, a proxy)."""
    try:
        data = response.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _stream(client: Any, body: dict[str, Any], report: SmokeReport) -> None:
    import httpx

    try:
        _read_stream(client, body, report)
    except (httpx.HTTPError, ValueError) as exc:  # a stream cut short, or a line that is not JSON
        report.check("stream", False, f"the stream broke: {type(exc).__name__}: {exc}")


def _read_stream(client: Any, body: dict[str, Any], report: SmokeReport) -> None:
    start = time.perf_counter()
    first: float | None = None
    last: float | None = None
    chunks = 0
    usage = None
    done = False
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        status = response.status_code
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                done = True
                break
            event = json.loads(payload)
            if not isinstance(event, dict):
                raise ValueError(f"a stream event is not a JSON object: {payload[:80]}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
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
        report.completion_tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
        if last is not None and last > first and report.completion_tokens:
            report.tokens_per_s = (report.completion_tokens - 1) / (last - first)
