"""A stand-in for vLLM's OpenAI-compatible server, for runtime tests that need a process which
answers like vLLM in a second: /health, /v1/models and chat completions (plain and streamed).
The native runtime finds it as `python -m vllm.entrypoints.openai.api_server` through PYTHONPATH.
FAKE_ENGINE_MODE=crash makes it exit while "loading". FAKE_ENGINE_GENERATION says what generation
does while /health answers 200, as a wedged vLLM engine's does (vllm-project/vllm#39863): `ok`
(the default), `fail` (500, vLLM's answer once the engine core is dead), `empty` (200 without a
token) or `hang` (the request is taken and never answered). As vLLM does, a key in VLLM_API_KEY or
--api-key guards /v1 (401 without `Authorization: Bearer KEY`), and /v1/completions answers 404
for a model it does not serve."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None)
    args, _unknown = parser.parse_known_args()
    served = args.served_model_name or args.model
    api_key = args.api_key or os.environ.get("VLLM_API_KEY") or None
    generation = os.environ.get("FAKE_ENGINE_GENERATION", "ok")
    print("INFO vLLM API server version 0.0.0-standin", flush=True)
    print("INFO Loading weights took 0.01 GB", flush=True)
    if os.environ.get("FAKE_ENGINE_MODE") == "crash":
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", flush=True)
        sys.exit(1)
    time.sleep(float(os.environ.get("FAKE_ENGINE_DELAY", "0.2")))

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *a: object) -> None:
            pass

        def _json(self, body: object, status: int = 200) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            """vLLM's key check: /v1 routes only; a 401 is sent here."""
            if (
                not api_key
                or not self.path.startswith("/v1")
                or self.headers.get("Authorization") == f"Bearer {api_key}"
            ):
                return True
            self._json({"error": "Unauthorized"}, 401)
            return False

        def _completion(self, body: dict) -> None:
            if body.get("model") != served:
                self._json({"error": {"message": f"The model `{body.get('model')}` does not exist."}}, 404)
                return
            tokens = 0 if generation == "empty" else min(int(body.get("max_tokens") or 16), 3)
            usage = {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": 1 + tokens}
            choices = [{"index": 0, "text": " hi" * tokens, "finish_reason": "length"}] if tokens else []
            self._json({"object": "text_completion", "model": served, "choices": choices, "usage": usage})

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json({})
            elif not self._authorized():
                return
            elif self.path == "/v1/models":
                self._json({"object": "list", "data": [{"id": served, "object": "model"}]})
            else:
                self._json({"error": "not found"}, 404)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if not self._authorized():
                return
            if generation == "hang":
                time.sleep(3600)  # taken, never answered: the client's own deadline must end it
                return
            if generation == "fail":
                self._json({"error": {"message": "EngineCore encountered an issue", "code": 500}}, 500)
                return
            if self.path == "/v1/completions":
                self._completion(body)
                return
            usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
            if not body.get("stream"):
                self._json(
                    {
                        "object": "chat.completion",
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": "hi all"},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": usage,
                    }
                )
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for word in ("hi", " all", "!"):
                chunk = {
                    "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": {"content": word}}],
                }
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                self.wfile.flush()
                time.sleep(0.01)
            self.wfile.write(
                f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode()
            )

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"INFO Application startup complete. Uvicorn running on http://{args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
