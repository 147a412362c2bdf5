"""A Service's endpoints during a rollout, and the ClusterIP in front of them: kube-proxy's part,
in this process, for the rehearsal's own clients. The endpoints controller lists a pod once its
readiness probe passes and drops it the moment the pod is deleted; kube-proxy sends every new
connection to one listed pod and leaves an established connection where it is (conntrack), so a
stream in flight on a deleted pod goes on; with no pod listed, a connection is refused at once
(kube-proxy's REJECT for a Service without endpoints). Every connection is written down with the
pod it went to, the state a proof judges by ("no request after the deletion reached the pod").
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

CHUNK = 1 << 16
CONNECT_S = 5.0


class Connection(NamedTuple):
    at: float  # the Endpoints' clock when the Service took it
    pod: str  # the pod it was sent to; "" when no pod was listed (refused)


class Endpoints:
    """The ready pods behind a Service port, in the order they were listed; new connections take
    them in turn (kube-proxy picks one at random: in turn is one of its choices, and the same
    for a proof that asks which pod got a connection)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # the kubelet's: the times here compare with its deletions
        self._lock = threading.Lock()
        self._ready: dict[str, tuple[str, int]] = {}
        self._turn = 0
        self.connections: list[Connection] = []
        # (time, pods listed after the change): when the Service had no endpoint, and for how long.
        self.changes: list[tuple[float, tuple[str, ...]]] = []

    def add(self, pod: str, address: str, port: int) -> None:
        with self._lock:
            self._ready[pod] = (address, port)
            self.changes.append((self.clock(), tuple(self._ready)))

    def remove(self, pod: str) -> None:
        with self._lock:
            self._ready.pop(pod, None)
            self.changes.append((self.clock(), tuple(self._ready)))

    def listed(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(self._ready)

    def pick(self) -> tuple[str, tuple[str, int] | None]:
        """The pod a new connection goes to, and its address; ("", None): none is listed."""
        with self._lock:
            pods = list(self._ready)
            chosen = pods[self._turn % len(pods)] if pods else ""
            self._turn += 1
            self.connections.append(Connection(self.clock(), chosen))
            return chosen, self._ready.get(chosen)

    def sent_to(self, pod: str, after: float) -> int:
        """How many connections went to `pod` at or after `after`."""
        with self._lock:
            return sum(1 for c in self.connections if c.pod == pod and c.at >= after)

    def gaps(self) -> list[tuple[float, float]]:
        """Each stretch with no endpoint listed, (from, to), between the first and last change."""
        out, empty_since = [], None
        for at, pods in self.changes:
            if not pods and empty_since is None:
                empty_since = at
            elif pods and empty_since is not None:
                out.append((empty_since, at))
                empty_since = None
        return out


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    """Copy one direction until its end, then half-close, so the other direction's answer still
    comes (the forwarder's rule, forwarder.py)."""
    try:
        while data := source.recv(CHUNK):
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)
    except OSError:
        pass


class _Handler(socketserver.BaseRequestHandler):
    server: ServiceAddress

    def handle(self) -> None:
        _, target = self.server.endpoints.pick()
        if target is None:  # no ready endpoint: refused at once
            return
        try:
            upstream = socket.create_connection(target, timeout=CONNECT_S)
        except OSError:
            return
        upstream.settimeout(None)
        back = threading.Thread(target=_pipe, args=(upstream, self.request), daemon=True)
        back.start()
        _pipe(self.request, upstream)
        back.join()
        upstream.close()


class ServiceAddress(socketserver.ThreadingTCPServer):
    """The Service's address on this host's loopback (`url`), in front of `endpoints`; a thread a
    connection. `close()` stops it."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, endpoints: Endpoints):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.endpoints = endpoints
        self._thread = threading.Thread(target=self.serve_forever, name="m31ctl service", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
