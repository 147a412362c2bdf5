"""Servers on this machine's loopback, with the standard library only: a free port to start one on,
and a request whose answer is its status and body. One copy for the scripts (scripts/pd_group.py,
reached as `loopback` from scripts/) and the tests (tests/ports.py and tests/support/http.py, as
`scripts.loopback`): a script does not import the tests, so what both need lives here.

Ports are picked below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range,
32768-60999 by default), from which the kernel hands out the local port of every outgoing
connection (health polls, vLLM's own internal sockets): between the pick and the server's bind,
such a connection can take a port picked there, and the server fails late (NIXL's side channel
binds only after the engine has loaded, minutes later on a busy machine). No port is handed out
twice by one process.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import urllib.error
import urllib.request
from typing import Any, NamedTuple

_BELOW_EPHEMERAL = range(20000, 32000)
_handed_out: set[int] = set()


def free_port() -> int:
    """A port free on 127.0.0.1 now, outside the ephemeral range, not handed out before."""
    for _ in range(1000):
        port = random.choice(_BELOW_EPHEMERAL)
        if port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port in {_BELOW_EPHEMERAL.start}-{_BELOW_EPHEMERAL.stop - 1}")


def free_ports(count: int) -> list[int]:
    return [free_port() for _ in range(count)]


class Answer(NamedTuple):
    status: int  # 0: no HTTP answer at all (refused, reset)
    body: str

    def json(self) -> Any:
        return json.loads(self.body)


def request(
    url: str, body: dict[str, Any] | None = None, timeout: float = 600.0, key: str | None = None
) -> Answer:
    """GET `url`, or POST `body` as JSON, with `key` as the bearer token when given: the status
    and body, never an exception."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data else {}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Answer(resp.status, resp.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.read().decode("utf-8", "replace"))
    except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException) as exc:
        return Answer(0, str(exc))


def metrics_text(base: str) -> str:
    """A server's Prometheus /metrics text; an error naming the server when it has none."""
    answer = request(f"{base}/metrics", timeout=30)
    if answer.status != 200:
        raise RuntimeError(f"{base}/metrics answered HTTP {answer.status}: {answer.body[:300]}")
    return answer.body
