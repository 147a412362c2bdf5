"""smoke and verify against broken or hostile servers: every bad answer fails a check (exit 1)
with what the server sent, never a crash (exit 70) or unbounded memory; and the API key a
server echoes back never reaches the terminal or the report file. The servers are real HTTP
servers on 127.0.0.1, one behaviour (`mode`) each."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.conftest import run_cli
from tests.support import cli_json

SERVED = "m31ctl-rehearsal"  # the cpu plan's served name
USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
CANARY = "canary-key-7f3a9c1e"
DEEP = b'{"choices": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
METRICS = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",kv_cache_size_tokens="4096",'
    'note="a \\"quoted\\" label, a \\\\ backslash"} 1.0\n'
)


def _message(content: Any = "yes", **extra: Any) -> dict[str, Any]:
    return {
        "object": "chat.completion",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content, **extra},
                "finish_reason": "stop",
            }
        ],
        "usage": USAGE,
    }


class _Server(BaseHTTPRequestHandler):
    mode = "good"
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            if self.mode == "models-deep":
                self._send(200, b'{"data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
            else:
                self._json({"object": "list", "data": [{"id": SERVED, "max_model_len": 2048}]})
        elif self.path == "/metrics":
            self._send(200, METRICS.encode(), "text/plain; version=0.0.4")
        else:
            self._json({"error": "not found"}, 404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.mode == "echo":  # a server that quotes the request back, key and all
            self._json({"error": f"bad request from {self.headers.get('Authorization')}"}, 400)
        elif body.get("stream"):
            self._stream()
        elif self.mode == "deep":
            self._send(200, DEEP)
        elif self.mode == "choice-not-object":
            self._json({"object": "chat.completion", "choices": ["oops"], "usage": USAGE})
        elif self.mode == "tool-function-string":
            self._json(_message(None, tool_calls=[{"type": "function", "function": "get_weather"}]))
        elif self.mode == "endless":
            self._endless(b'{"choices": [' + b'"x", ' * 10)
        else:
            self._json(_message('"yes"' if "response_format" in body else "yes"))

    def _stream(self) -> None:
        if self.mode == "endless":
            self._endless(b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n')
            return
        if self.mode == "endless-line":
            self._endless(b"data: " + b"x" * 1000)
            return
        delta: Any = "hello" if self.mode == "delta-string" else {"content": "hi"}
        choice: Any = "oops" if self.mode == "choice-not-object" else {"index": 0, "delta": delta}
        events = [{"choices": [choice]}, {"choices": [], "usage": USAGE}]
        payload = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self._send(200, payload.encode(), "text/event-stream")

    def _endless(self, chunk: bytes) -> None:
        """A body with no end (no length, no close), until the client hangs up."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.close_connection = True
        with contextlib.suppress(OSError):
            while True:
                self.wfile.write(chunk * 64)

    def _json(self, data: Any, code: int = 200) -> None:
        self._send(code, json.dumps(data).encode())

    def _send(self, code: int, payload: bytes, kind: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        with contextlib.suppress(OSError):
            self.wfile.write(payload)


@contextlib.contextmanager
def hostile(mode: str) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), type("Handler", (_Server,), {"mode": mode}))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _checks(stdout: str) -> dict[str, dict[str, Any]]:
    return {c["id"]: c for c in cli_json.data(stdout)["checks"]}


def _clean(result: Any) -> None:
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr, result.stderr


def test_a_well_behaved_server_passes_smoke_and_verify():
    """The baseline: the same server without a fault passes, so each failure below is the fault's."""
    with hostile("good") as url:
        smoke = run_cli("smoke", "--url", url, "--json")
        verify = run_cli("verify", "--hardware", "cpu", "--url", url, "--no-load", "--json")
    assert smoke.returncode == 0, smoke.stdout + smoke.stderr
    assert verify.returncode == 0, verify.stdout + verify.stderr
    report = cli_json.data(verify.stdout)
    assert report["facts"]["kv_cache_dtype"] == "auto" and report["facts"]["block_size"] == "16"


@pytest.mark.parametrize(
    ("mode", "check", "said"),
    [
        ("deep", "chat", "nested too deep"),
        ("choice-not-object", "chat", '["oops"]'),
        ("choice-not-object", "stream", "choices are not a list of objects"),
        ("delta-string", "stream", "delta is not an object"),
        ("endless", "chat", "runs past"),
        ("endless", "stream", "runs past"),
        ("endless-line", "stream", "runs past"),
    ],
)
def test_smoke_fails_a_check_on_a_bad_answer(mode, check, said):
    start = time.monotonic()
    with hostile(mode) as url:
        result = run_cli("smoke", "--url", url, "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    _clean(result)
    found = _checks(result.stdout)[check]
    assert found["status"] == "fail" and said in found["message"], found
    assert len(found["message"]) < 700  # quoted, shortened
    assert time.monotonic() - start < 60  # an endless body is cut at its cap, not read forever


def test_smoke_refuses_a_model_list_nested_too_deep():
    with hostile("models-deep") as url:
        result = run_cli("smoke", "--url", url)
    assert result.returncode == 1
    _clean(result)
    assert "did not answer an OpenAI model list" in result.stderr and "nested too deep" in result.stderr


@pytest.mark.parametrize(
    ("mode", "check", "said"),
    [
        ("tool-function-string", "tool-call", "get_weather"),
        ("deep", "structured-output", "nested too deep"),
        ("deep", "tool-call", "nested too deep"),
        ("choice-not-object", "reasoning", '["oops"]'),
        ("delta-string", "stream", "delta is not an object"),
        ("endless", "reasoning", "runs past"),
        ("models-deep", "models", "nested too deep"),
    ],
)
def test_verify_fails_a_check_on_a_bad_answer(mode, check, said, tmp_path):
    with hostile(mode) as url:
        result = run_cli(
            "verify", "--hardware", "cpu", "--url", url, "--no-load", "--json", "-o", str(tmp_path / "r.json"),
            "--set", "serving.tool_call_parser=hermes", "--set", "serving.reasoning_parser=deepseek_r1",
        )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    _clean(result)
    found = _checks(result.stdout)[check]
    assert found["status"] == "fail" and said in found["message"], found
    assert json.loads((tmp_path / "r.json").read_text())["failed"] == cli_json.data(result.stdout)["failed"]


@pytest.mark.parametrize("as_json", [False, True])
def test_an_echoed_api_key_reaches_neither_terminal_nor_report(as_json, tmp_path):
    report = tmp_path / "verify.json"
    env = {"VLLM_API_KEY": CANARY, "COLUMNS": "400"}
    with hostile("echo") as url:
        smoke = run_cli("smoke", "--url", url, *(["--json"] if as_json else []), env=env)
        verify = run_cli(
            "verify", "--hardware", "cpu", "--url", url, "--no-load", "-o", str(report),
            *(["--json"] if as_json else []), env=env,
        )  # fmt: skip
    for result in (smoke, verify):
        assert result.returncode == 1, result.stdout + result.stderr
        _clean(result)
        assert CANARY not in result.stdout + result.stderr
    assert "Bearer ***" in smoke.stdout + verify.stdout  # the echo was quoted, masked
    assert CANARY not in report.read_text() and "Bearer ***" in report.read_text()


def test_metrics_labels_with_escaped_quotes():
    from m31ctl.served.prometheus import parse

    metrics = parse(
        METRICS
        + 'vllm:spec_decode_num_drafts_total{engine="0"} 4\nvllm:spec_decode_num_drafts_total{engine="1"} 6\n'
    )
    labels = metrics.labels("vllm:cache_config_info")
    assert labels["note"] == 'a "quoted" label, a \\ backslash'
    assert labels["cache_dtype"] == "auto" and labels["kv_cache_size_tokens"] == "4096"
    assert metrics.total("vllm:spec_decode_num_drafts_total") == 10
    assert not metrics.problem


def test_metrics_that_are_not_prometheus_text_keep_what_came_before():
    from m31ctl.served.prometheus import parse

    metrics = parse(METRICS + 'broken{label="unterminated} 1\n')
    assert metrics.labels("vllm:cache_config_info")["cache_dtype"] == "auto"
    assert "not Prometheus text" in metrics.problem


def test_a_trickling_body_is_cut_at_the_time_limit():
    """httpx's timeout is per read: a server sending a byte a second would never trip it."""
    import httpx

    from m31ctl.served import http_answers

    sent: list[int] = []  # bytes of the body written, one entry each

    class Trickle(_Server):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.close_connection = True
            with contextlib.suppress(OSError):
                for _ in range(600):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    sent.append(1)
                    time.sleep(0.05)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{server.server_address[1]}", timeout=5) as client:
            answer = http_answers.fetch(client, "GET", "/slow", limit_s=0.5)
        # Cut while the server was still sending (its 600 bytes take 30 s at least): the proof
        # by the server's own count, where a wall-clock bound failed on a slow machine.
        assert len(sent) < 600
        assert "longer than 0.5 s" in answer.problem and answer.data is None
    finally:
        server.shutdown()
        server.server_close()


def test_glimpse_escapes_redacts_and_shortens(monkeypatch):
    from m31ctl.served.http_answers import glimpse

    monkeypatch.setenv("VLLM_API_KEY", CANARY)
    shown = glimpse(b"\x1b[2J" + f"Bearer {CANARY} ".encode() + b"x" * 1000)
    assert "\x1b" not in shown and "\\x1b[2J" in shown
    assert CANARY not in shown and "Bearer ***" in shown
    assert len(shown) < 200 and shown.endswith("bytes)")
