"""The router's front (engine/router_front.py, issue 49): which paths it forwards and with what
key, run in-process before a stand-in router that streams, and as the rendered text runs it."""

from __future__ import annotations

import ast
import http.client
import http.server
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar

import pytest

from m31ctl.engine import router_front
from m31ctl.engine.router import ROUTER_BEHIND_FRONT_PORT, front_invocation, front_program
from m31ctl.engine.router_front import Config, FrontServer, route

KEY = "s3cret-key"
BEARER = f"Bearer {KEY}"
# vllm-router 0.1.17's routes that are not the OpenAI API (src/server.rs build_app): admin,
# worker management, its own health and info, SGLang's native API.
NOT_THE_API = [
    ("POST", "/add_worker?url=http://evil:8000"),
    ("POST", "/remove_worker?url=http://decode:8000"),
    ("GET", "/list_workers"),
    ("POST", "/workers"),
    ("GET", "/workers"),
    ("GET", "/workers/http://decode:8000"),
    ("DELETE", "/workers/http://decode:8000"),
    ("POST", "/flush_cache"),
    ("GET", "/get_loads"),
    ("POST", "/generate"),
    ("GET", "/get_server_info"),
    ("GET", "/get_model_info"),
    ("GET", "/health_generate"),
    ("GET", "/metrics"),
    ("POST", "/rerank"),
    ("GET", "/"),
]
# Spellings of a management path that must not slip past the allowlist.
SMUGGLED = [
    "/v1/../add_worker",
    "/v1/./../list_workers",
    "/v1/%2e%2e/add_worker",
    "/v1%2F../add_worker",
    "//add_worker",
    "/v1//completions",
    "/v1/..",
    "http://router/add_worker",
    "add_worker",
    "/v1\\..\\add_worker",
]


@pytest.mark.parametrize(("method", "target"), NOT_THE_API)
def test_worker_management_and_every_path_outside_the_api_is_not_found_with_the_key_or_without(
    method, target
):
    for authorization in (None, BEARER):
        assert route(method, target, authorization, KEY) == 404
    assert route(method, target, None, None) == 404  # a plan without a key: still never forwarded


@pytest.mark.parametrize("target", SMUGGLED)
def test_a_path_spelled_to_reach_another_route_is_not_found(target):
    assert route("POST", target, BEARER, KEY) == 404


@pytest.mark.parametrize(
    ("method", "target"),
    [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("POST", "/v1/embeddings"),
        ("POST", "/v1/responses"),
        ("GET", "/v1/responses/resp_1?stream=true"),
    ],
)
def test_the_api_needs_the_key(method, target):
    assert route(method, target, BEARER, KEY) == 0
    assert route(method, target, "bearer " + KEY, KEY) == 0  # the scheme in any case (RFC 9110)
    for wrong in (None, "", "Bearer", "Bearer ", f"Basic {KEY}", "Bearer s3cret", f"Bearer {KEY}x", KEY):
        assert route(method, target, wrong, KEY) == 401, wrong
    assert route(method, target, None, None) == 0  # no key in the plan: the API as vLLM serves it


def test_health_is_open_for_the_probes_and_only_read():
    assert route("GET", "/health", None, KEY) == 0
    assert route("HEAD", "/health", None, KEY) == 0
    assert route("POST", "/health", BEARER, KEY) == 405
    assert route("GET", "/healthz", None, KEY) == 404


# --- in-process: the front before a stand-in router ---------------------------------------------


class _Upstream(http.server.BaseHTTPRequestHandler):
    """A stand-in router: /v1/completions streams three SSE events, the second only once the test
    has read the first (so a front that buffers the stream hangs instead of passing)."""

    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[tuple[str, str, str | None, bytes]]] = []
    first_read: ClassVar[threading.Event] = threading.Event()

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append((self.command, self.path, self.headers.get("Authorization"), body))
        if self.path != "/v1/completions":
            payload = json.dumps({"echo": body.decode()}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for index, event in enumerate((b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n")):
            if index == 1:
                self.first_read.wait(10)
            self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    do_GET = do_POST

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def front() -> Iterator[int]:
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    _Upstream.seen.clear()
    _Upstream.first_read.clear()
    server = FrontServer(("127.0.0.1", 0), Config("127.0.0.1", upstream.server_address[1], KEY, 30))
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in (upstream, server)]
    for thread in threads:
        thread.start()
    yield server.server_address[1]
    _Upstream.first_read.set()
    for s in (server, upstream):
        s.shutdown()
        s.server_close()


def _post(port: int, path: str, headers: dict[str, str], body: bytes = b"{}") -> http.client.HTTPResponse:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.request("POST", path, body=body, headers={"Content-Type": "application/json", **headers})
    return connection.getresponse()


def test_the_front_streams_each_event_as_the_router_writes_it_with_the_key(front):
    answer = _post(front, "/v1/completions", {"Authorization": BEARER}, b'{"stream": true}')
    assert answer.status == 200 and answer.getheader("Content-Type") == "text/event-stream"
    first = answer.read1(65536)
    assert first == b'data: {"n": 1}\n\n'  # before the router wrote the rest: nothing buffered
    _Upstream.first_read.set()
    rest = answer.read()
    assert rest == b'data: {"n": 2}\n\ndata: [DONE]\n\n'
    ((method, path, authorization, body),) = _Upstream.seen
    assert (method, path, authorization, body) == ("POST", "/v1/completions", BEARER, b'{"stream": true}')


def test_refused_requests_never_reach_the_router_and_a_kept_connection_serves_again(front):
    assert _post(front, "/v1/completions", {}).status == 401
    assert _post(front, "/v1/completions", {"Authorization": "Bearer nope"}).status == 401
    refused = _post(front, "/add_worker?url=http://evil:9", {"Authorization": BEARER})
    assert refused.status == 404
    assert json.loads(refused.read())["error"]["code"] == 404
    assert _Upstream.seen == []
    connection = http.client.HTTPConnection("127.0.0.1", front, timeout=10)
    for n in range(2):  # one connection, two requests: kept alive between them
        connection.request("POST", "/v1/embeddings", body=f"{n}", headers={"Authorization": BEARER})
        answer = connection.getresponse()
        assert answer.status == 200 and json.loads(answer.read()) == {"echo": f"{n}"}
    assert len(_Upstream.seen) == 2


def test_the_front_answers_502_when_the_router_is_not_there():
    server = FrontServer(("127.0.0.1", 0), Config("127.0.0.1", 9, KEY, 5))  # port 9: nothing listens
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert _post(server.server_address[1], "/v1/completions", {"Authorization": BEARER}).status == 502
    finally:
        server.shutdown()
        server.server_close()


# --- the shipped text ---------------------------------------------------------------------------


def test_the_rendered_program_is_the_module_and_uses_the_standard_library_only():
    source = front_program()
    assert source == Path(router_front.__file__).read_text(encoding="utf-8")
    imported = {
        (node.module or "").split(".")[0] if isinstance(node, ast.ImportFrom) else alias.name.split(".")[0]
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
    assert "$" not in source  # nothing Compose or the kubelet would expand


def test_the_front_runs_as_rendered_reads_its_key_by_name_and_refuses_to_start_without_it(tmp_path):
    argv = list(
        front_invocation("img", host="127.0.0.1", port=0, request_timeout_s=5, key_env="VLLM_API_KEY").argv
    )
    assert argv[:2] == ["python3", "-c"] and argv[argv.index("--upstream-port") + 1] == str(
        ROUTER_BEHIND_FRONT_PORT
    )
    assert KEY not in " ".join(argv)
    environ = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    done = subprocess.run(
        [sys.executable, *argv[1:]], env=environ, capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 1
    assert "VLLM_API_KEY is empty or unset: the plan requires an API key" in done.stderr
    # With the key it serves: SIGTERM ends it once nothing is in flight.
    argv[argv.index("--port") + 1] = "0"
    started = subprocess.Popen(
        [sys.executable, *argv[1:]],
        env={**environ, "VLLM_API_KEY": KEY},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert started.stdout is not None
        line = started.stdout.readline()
        assert "/v1/ with the key in VLLM_API_KEY, /health open" in line and KEY not in line
        time.sleep(0.2)
        started.terminate()
        assert started.wait(timeout=20) == 0
    finally:
        if started.poll() is None:
            started.kill()
