"""m31ctl's router front: the one door to vllm-router, which checks no key itself.

vllm-router 0.1.17 authenticates nothing: its `--api-key` is the key it sends to the workers,
and its `authorize_request` admits every request when `api_key_validation_urls` is empty, which
its command line cannot set (docs/decisions.md, "The router's front"). It serves worker
management beside the API (/add_worker, /remove_worker, /list_workers, /workers), so whoever
reaches it could register a URL of their own and receive users' prompts with the roles' key.

So the router listens on its pod's (or container's) loopback alone, and this program listens on
the router's public port in the same network namespace: `/health` without a key (the probes'),
the OpenAI API under /v1/ with `Authorization: Bearer <key>` (the roles' key, read from the
environment variable --key-env names, never from argv or a file), and 404 for every other path,
worker management included, key or not. Responses stream through chunk by chunk (SSE included).

Run as a fixed text (`python3 -c SOURCE ARGS`) by the python3 of the router's image (vllm-router
is a Python console script, so every image that runs it has one): standard library only, nothing
spliced in. On SIGTERM it stops accepting, lets the requests in flight finish and
exits (the pod's grace bounds it).
"""

from __future__ import annotations

import argparse
import hmac
import http.client
import http.server
import json
import os
import signal
import socket
import sys
import threading
from typing import Any, NamedTuple

HEALTH = "/health"
API_PREFIX = "/v1/"
# Not forwarded either way (RFC 9110 7.6.1), and what the front sets itself.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
CHUNK = 65536
# An idle kept-alive connection is closed after this long (uvicorn's default, which vLLM's API
# server runs under); a request in progress gets the router's request timeout instead.
IDLE_S = 5
REASONS = {
    400: "bad request",
    401: "a valid API key is required: Authorization: Bearer <key>",
    404: "not found",
    405: "method not allowed",
    411: "a request body needs Content-Length",
    502: "the router did not answer",
}


def plain(path: str) -> bool:
    """A path the router matches as written: absolute, no empty, `.` or `..` segment, nothing
    percent-encoded or backslashed (so no spelling reaches a route the allowlist did not name)."""
    if not path.startswith("/") or "%" in path or "\\" in path:
        return False
    segments = path[1:].split("/")
    return all(s not in ("", ".", "..") for s in segments[:-1]) and segments[-1] not in (".", "..")


def authorized(header: str | None, key: str) -> bool:
    """`Authorization: Bearer <key>` (the scheme in any case, RFC 9110 11.1), compared in constant time."""
    scheme, _, token = (header or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


def route(method: str, target: str, authorization: str | None, key: str | None) -> int:
    """0: forward the request to the router; else the status to answer it with. `key`: None
    admits the API without one (a plan without runtime.api_key); worker management never."""
    path = target.split("?", 1)[0]
    if not plain(path):
        return 404
    if path == HEALTH:
        return 0 if method in ("GET", "HEAD") else 405
    if not path.startswith(API_PREFIX):
        return 404
    if key is not None and not authorized(authorization, key):
        return 401
    return 0


class Config(NamedTuple):
    upstream_host: str
    upstream_port: int
    key: str | None
    timeout_s: float


class FrontServer(http.server.ThreadingHTTPServer):
    daemon_threads = False  # server_close() waits for the requests in flight
    block_on_close = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], config: Config) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, Front)
        self.config = config
        self.draining = False


class Front(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "m31ctl-router-front"
    sys_version = ""
    server: FrontServer

    def handle_one_request(self) -> None:
        self.connection.settimeout(IDLE_S)
        super().handle_one_request()

    def do_GET(self) -> None:
        config = self.server.config
        status = route(self.command, self.path, self.headers.get("Authorization"), config.key)
        length = self.headers.get("Content-Length") or "0"
        if not status and self.headers.get("Transfer-Encoding"):
            status = 411
        elif not status and not length.isdigit():
            status = 400
        if status:
            self.answer(status)
            return
        self.connection.settimeout(config.timeout_s)
        upstream = http.client.HTTPConnection(
            config.upstream_host, config.upstream_port, timeout=config.timeout_s
        )
        try:
            try:
                self.send_upstream(upstream, int(length))
                reply = upstream.getresponse()
            except (OSError, http.client.HTTPException) as error:
                self.log_message("upstream: %s", error)
                self.answer(502)
                return
            self.relay(reply)
        finally:
            upstream.close()

    do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = do_OPTIONS = do_GET

    def send_upstream(self, upstream: http.client.HTTPConnection, length: int) -> None:
        upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
        upstream.putheader("Host", f"{upstream.host}:{upstream.port}")
        for name, value in self.headers.items():
            if name.lower() not in HOP_BY_HOP:
                upstream.putheader(name, value)
        if length or self.command in ("POST", "PUT", "PATCH"):
            upstream.putheader("Content-Length", str(length))
        upstream.endheaders()
        while length:
            piece = self.rfile.read(min(CHUNK, length))
            if not piece:
                raise ConnectionError("the client closed its request body early")
            upstream.send(piece)
            length -= len(piece)

    def relay(self, reply: http.client.HTTPResponse) -> None:
        """The router's answer as it comes: its length kept, or chunked piece by piece (an SSE
        stream's events reach the client as the router writes them)."""
        self.send_response_only(reply.status, reply.reason)
        self.log_request(reply.status)
        for name, value in reply.getheaders():
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        length = reply.getheader("Content-Length")
        bodyless = self.command == "HEAD" or reply.status in (204, 304) or reply.status < 200
        chunked = length is None and not bodyless and self.request_version == "HTTP/1.1"
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        elif length is not None:
            self.send_header("Content-Length", length)
        if self.server.draining or (length is None and not chunked and not bodyless):
            self.close_connection = True  # an HTTP/1.0 client's body ends with the connection
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        if bodyless:
            return
        try:
            while piece := reply.read1(CHUNK):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
        except (OSError, http.client.HTTPException) as error:  # the client or the router went away
            self.log_message("stream cut: %s", error)
            self.close_connection = True
            return
        if chunked:
            self.wfile.write(b"0\r\n\r\n")

    def answer(self, status: int) -> None:
        """The front's own answer, in the OpenAI API's error shape; the connection closed after
        it (a refused request's body is never read)."""
        body = json.dumps(
            {"error": {"message": REASONS[status], "type": "m31ctl_router_front", "code": status}}
        )
        self.close_connection = True
        self.send_response(status)
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body.encode())

    def log_message(self, format: str, *args: Any) -> None:
        sys.stderr.write(f"m31ctl router front: {self.address_string()} {format % args}\n")


def arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="m31ctl-router-front")
    parser.add_argument("--host", required=True, help="where clients reach the router")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream-host", default="127.0.0.1", help="vllm-router, on loopback")
    parser.add_argument("--upstream-port", type=int, required=True)
    parser.add_argument("--timeout-s", type=float, required=True, help="the router's request timeout")
    parser.add_argument("--key-env", help="the variable holding the API key (its name, never its value)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = arguments(argv)
    key = None
    if args.key_env:
        key = os.environ.get(args.key_env) or None
        if key is None:  # never a front that admits everyone because its secret went missing
            sys.exit(f"m31ctl router front: {args.key_env} is empty or unset: the plan requires an API key")
    server = FrontServer(
        (args.host, args.port), Config(args.upstream_host, args.upstream_port, key, args.timeout_s)
    )

    def drain(*_: Any) -> None:
        server.draining = True
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, drain)
    signal.signal(signal.SIGINT, drain)
    upstream = f"{args.upstream_host}:{args.upstream_port}"
    guard = f"with the key in {args.key_env}" if key else "without a key (the plan sets no runtime.api_key)"
    print(
        f"m31ctl router front: {args.host}:{args.port} -> {upstream}: /v1/ {guard}, /health open", flush=True
    )
    server.serve_forever()
    server.server_close()  # the requests in flight end first
    print("m31ctl router front: stopped", flush=True)


if __name__ == "__main__":
    main()
