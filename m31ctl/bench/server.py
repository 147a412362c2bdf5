"""The running server as the sweep sees it (sweep.Server): vLLM's /tokenize and /metrics over
HTTP, with the API key header smoke and verify send."""

from __future__ import annotations

from typing import Any

from m31ctl.runtime.smoke import auth_headers


class HttpServer:
    def __init__(self, base: str, served_name: str, timeout: float = 120.0) -> None:
        import httpx

        self._httpx = httpx
        self._client = httpx.Client(base_url=base, headers=auth_headers(), timeout=timeout)
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
            response = self._client.get("/metrics")
        except self._httpx.HTTPError:
            return ""
        return response.text if response.status_code == 200 else ""

    def close(self) -> None:
        self._client.close()
