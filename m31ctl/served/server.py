"""The running server as the sweep sees it (sweep.Server): vLLM's /tokenize and /metrics over
HTTP, with the API key header smoke and verify send."""

from __future__ import annotations

from typing import Any

import httpx

from m31ctl.served.smoke import auth_headers


class HttpServer:
    def __init__(
        self, base: str, served_name: str, timeout: float = 120.0, engine_base: str | None = None
    ) -> None:
        """`engine_base`: where the engine's own /metrics are, when not at `base` (a P/D group's
        decode role behind its router: Target.engine_base)."""
        self._httpx = httpx
        self._client = httpx.Client(base_url=base, headers=auth_headers(), timeout=timeout)
        self._engine = (
            httpx.Client(base_url=engine_base, headers=auth_headers(), timeout=timeout)
            if engine_base not in (None, base)
            else self._client
        )
        self._model = served_name

    def tokens(self, text: str) -> int | None:
        """vLLM's POST /tokenize with chat messages: the prompt tokens the chat endpoint will
        count for `text` as one user message, template included."""
        body: dict[str, Any] = {
            "model": self._model,
            "messages": [{"role": "user", "content": text}],
            "add_generation_prompt": True,
        }
        try:
            response = self._client.post("/tokenize", json=body)
            count = response.json().get("count") if response.status_code == 200 else None
        except (self._httpx.HTTPError, ValueError, AttributeError):
            return None
        return count if isinstance(count, int) else None

    def metrics(self) -> str:
        try:
            response = self._engine.get("/metrics")
        except self._httpx.HTTPError:
            return ""
        return response.text if response.status_code == 200 else ""

    def close(self) -> None:
        self._client.close()
        self._engine.close()
