"""The clients of a rollout rehearsal: a steady load of completions through the Service, one
after another, each written down (sent, ended, answered or why not); and one streamed
completion of a known length, read token by token, to learn whether a stream in flight when its
pod is deleted ends whole (every token asked for and a finish_reason). Answers are read by
served/'s defensive reading (http_answers) with smoke's credentials."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import httpx

from m31ctl import interrupt
from m31ctl.served import http_answers, smoke

PROMPT = "The rehearsal says"
LOAD_TOKENS = 4
# A client's pause before it asks again after a failed request (a refused connection answers at
# once: without a pause the load would be a busy loop).
RETRY_S = 1.0


class LoadRequest(NamedTuple):
    sent: float  # the load's clock when it was sent
    ended: float
    ok: bool  # HTTP 200 with choices
    detail: str  # why not ("" when ok)


class SteadyLoad:
    """Completions one after another through `url` until stopped; `clock` is the kubelet's."""

    def __init__(self, url: str, model: str, timeout: float, clock: Callable[[], float] = time.monotonic):
        self.url, self.model, self.timeout, self.clock = url, model, timeout, clock
        self.requests: list[LoadRequest] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="m31ctl load", daemon=True)

    def start(self) -> SteadyLoad:
        self._thread.start()
        return self

    def _run(self) -> None:
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": LOAD_TOKENS, "temperature": 0}
        while not self._stop.is_set():
            sent = self.clock()
            # A new connection each request: the Service picks an endpoint a connection.
            with httpx.Client(
                base_url=self.url, headers=smoke.auth_headers(), timeout=self.timeout
            ) as client:
                answer = http_answers.fetch(client, "POST", "/v1/completions", body, limit_s=self.timeout)
            choices = http_answers.as_list(http_answers.as_object(answer.data).get("choices"))
            ok = answer.status == 200 and bool(choices)
            detail = "" if ok else (answer.problem or f"HTTP {answer.status}")[:200]
            self.requests.append(LoadRequest(sent, self.clock(), ok, detail))
            if not ok:
                self._stop.wait(RETRY_S)

    def answered_since(self, since: float) -> int:
        return sum(1 for r in list(self.requests) if r.ok and r.sent >= since)

    def stop(self) -> list[LoadRequest]:
        self._stop.set()
        interrupt.join(self._thread, self.timeout + RETRY_S)
        return list(self.requests)


class Streamed(NamedTuple):
    """One streamed completion as its client saw it."""

    asked: int  # max_tokens (ignore_eos: every one of them is due)
    tokens: int  # completion tokens the usage reported (else the chunks counted)
    finish_reason: str | None
    error: str  # how the stream broke ("" when it ended with [DONE])
    first_at: float | None  # the clock at its first token
    ended_at: float

    @property
    def whole(self) -> bool:
        return not self.error and self.tokens == self.asked and bool(self.finish_reason)

    def to_json(self) -> dict[str, object]:
        return {"asked": self.asked, "tokens": self.tokens, "finish_reason": self.finish_reason,
                "error": self.error, "whole": self.whole}  # fmt: skip


def stream(
    url: str,
    model: str,
    max_tokens: int,
    timeout: float,
    first: threading.Event,
    clock: Callable[[], float] = time.monotonic,
) -> Streamed:
    """A streamed completion of exactly `max_tokens` (ignore_eos), its usage asked for; `first`
    is set at its first token."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
    chunks, usage, reason, done, error = 0, None, None, False, ""
    first_at: float | None = None
    try:
        with (
            httpx.Client(base_url=url, headers=smoke.auth_headers(), timeout=timeout) as client,
            client.stream("POST", "/v1/completions", json=body) as response,
        ):
            if response.status_code != 200:
                error = f"HTTP {response.status_code}"
            for payload in [] if error else http_answers.sse_data(response, limit_s=timeout):
                if payload == "[DONE]":
                    done = True
                    continue
                event = http_answers.as_object(json.loads(payload))
                for choice in http_answers.as_list(event.get("choices")):
                    chunks += 1
                    if first_at is None:
                        first_at = clock()
                        first.set()
                    reason = http_answers.as_object(choice).get("finish_reason") or reason
                usage = http_answers.as_object(event.get("usage")).get("completion_tokens", usage)
    except (httpx.HTTPError, http_answers.Unreadable, ValueError) as exc:
        error = f"{type(exc).__name__}: {http_answers.glimpse(str(exc))}"
    first.set()  # a stream that never started must not hold its caller
    if not error and not done:
        error = "the stream ended without [DONE]"
    tokens = http_answers.as_int(usage)
    return Streamed(max_tokens, tokens if tokens is not None else chunks, reason, error, first_at, clock())


class InFlight:
    """A stream run in a thread: `started()` waits for its first token, `result()` for its end."""

    def __init__(self, url: str, model: str, max_tokens: int, timeout: float, clock: Callable[[], float]):
        self._first = threading.Event()
        self._box: list[Streamed] = []
        self.timeout = timeout
        self._thread = threading.Thread(
            target=lambda: self._box.append(stream(url, model, max_tokens, timeout, self._first, clock)),
            name="m31ctl stream",
            daemon=True,
        )
        self._thread.start()

    def started(self) -> bool:
        """Wait for its first token (or its end); whether a token came."""
        deadline = time.monotonic() + self.timeout
        while not self._first.is_set() and time.monotonic() < deadline:
            interrupt.sleep(0.05)  # Ctrl-C and SIGTERM end the wait here
        return self._first.is_set() and (not self._box or self._box[0].first_at is not None)

    def result(self) -> Streamed | None:
        interrupt.join(self._thread, self.timeout)
        return self._box[0] if self._box else None
