"""A stand-in for vLLM's OpenAI-compatible server, for runtime tests that need a process which
answers like vLLM in a second: /health, /v1/models and chat completions (plain and streamed).
The native runtime finds it as `python -m vllm.entrypoints.openai.api_server` through PYTHONPATH.
FAKE_ENGINE_MODE=crash makes it exit while "loading"."""

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
    args, _unknown = parser.parse_known_args()
    served = args.served_model_name or args.model
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

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json({})
            elif self.path == "/v1/models":
                self._json({"object": "list", "data": [{"id": served, "object": "model"}]})
            else:
                self._json({"error": "not found"}, 404)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
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
