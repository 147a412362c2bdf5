"""The stand-in engine (tests/standin_vllm) answering also what `m31ctl verify` reads of vLLM,
so that blue-green's gate (verify's checks) can pass in a second: /v1/models lists the served
model with its max_model_len, /metrics has vllm:cache_config_info (the cache dtype from
--kv-cache-dtype, "auto" by default, as vLLM's), and a chat asking for a JSON-schema answer gets
the schema's first value. Everything else (and FAKE_ENGINE_GENERATION's faults) is the
stand-in's own: it is loaded from its file and its HTTP server class wrapped, not copied. Found
as `python -m vllm.entrypoints.openai.api_server` with this folder's parent on PYTHONPATH."""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

STANDIN = Path(__file__).parents[5] / "standin_vllm" / "vllm" / "entrypoints" / "openai" / "api_server.py"


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-dtype", default="auto")
    return parser.parse_known_args()[0]


def _verified(handler: Any, args: argparse.Namespace) -> Any:
    served = args.served_model_name or args.model
    generation = os.environ.get("FAKE_ENGINE_GENERATION", "ok")

    class Verified(handler):  # type: ignore[misc, valid-type]
        def do_GET(self) -> None:
            if self.path == "/metrics":
                line = f'vllm:cache_config_info{{cache_dtype="{args.kv_cache_dtype}",block_size="16"}} 1.0\n'
                data = line.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            elif self.path == "/v1/models" and self._authorized():
                entry = {"id": served, "object": "model", "max_model_len": args.max_model_len}
                self._json({"object": "list", "data": [entry]})
            elif self.path != "/v1/models":
                super().do_GET()

        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = json.loads(raw or b"{}")
            schema = ((body.get("response_format") or {}).get("json_schema") or {}).get("schema") or {}
            if generation == "ok" and schema.get("enum") and self._authorized():
                message = {"role": "assistant", "content": json.dumps(schema["enum"][0])}
                usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
                choice = {"index": 0, "message": message, "finish_reason": "stop"}
                self._json({"object": "chat.completion", "choices": [choice], "usage": usage})
                return
            self.rfile = io.BytesIO(raw)  # the stand-in reads the body again
            super().do_POST()

    return Verified


def main() -> None:
    spec = importlib.util.spec_from_file_location("standin_api_server", STANDIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = _args()
    module.ThreadingHTTPServer = lambda address, handler: ThreadingHTTPServer(
        address, _verified(handler, args)
    )
    module.main()


if __name__ == "__main__":
    main()
