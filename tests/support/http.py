"""HTTP with the standard library only, for a test that asks a server it started (the test runs
in .venv, the servers in .venv-vllm): a request whose answer is its status and body, never an
exception, and a server's /metrics text. The same two as scripts/pd_group.py's, which the
benchmark uses: a test does not import scripts."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from typing import Any, NamedTuple


class Answer(NamedTuple):
    status: int  # 0: no HTTP answer at all (refused, reset)
    body: str

    def json(self) -> Any:
        return json.loads(self.body)


def request(url: str, body: dict[str, Any] | None = None, timeout: float = 600.0) -> Answer:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data else {}
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Answer(resp.status, resp.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException) as exc:
        return Answer(0, str(exc))


def metrics_text(base: str) -> str:
    answer = request(f"{base}/metrics", timeout=30)
    if answer.status != 200:
        raise RuntimeError(f"{base}/metrics answered HTTP {answer.status}: {answer.body[:300]}")
    return answer.body
