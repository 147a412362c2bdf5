"""A Docker Engine that is slow to answer, on demand: a unix socket in front of the real engine's
that holds each request matching a pattern for `delay` seconds before passing it on (what a
busy daemon on a fresh, loaded machine does to container starts and removals). Everything else
goes through untouched, so the engine behind it is real.

    with SlowDocker(rb"POST /v[\\d.]+/containers/\\w+/start", 8) as slow:
        env = {"DOCKER_HOST": slow.url}
"""

from __future__ import annotations

import contextlib
import re
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType

UPSTREAM = "/var/run/docker.sock"


class SlowDocker:
    def __init__(self, pattern: bytes, delay: float, upstream: str = UPSTREAM) -> None:
        # A short path of its own (made on entering): a unix socket's path has at most 107 bytes.
        self.path = Path(tempfile.gettempdir())
        self.pattern, self.delay, self.upstream = re.compile(pattern), delay, upstream
        self.held: list[str] = []  # the request lines held back, in order
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._open: list[socket.socket] = []

    @property
    def url(self) -> str:
        return f"unix://{self.path}"

    def __enter__(self) -> SlowDocker:
        self.path = Path(tempfile.mkdtemp(prefix="m31ctl-slowdocker-")) / "docker.sock"
        self._listener.bind(str(self.path))
        self._listener.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sock in [self._listener, *self._open]:
            with contextlib.suppress(OSError):
                sock.close()
        shutil.rmtree(self.path.parent, ignore_errors=True)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            engine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            engine.connect(self.upstream)
            self._open += [client, engine]
            threading.Thread(target=self._pipe, args=(client, engine, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(engine, client, False), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, requests: bool) -> None:
        with contextlib.suppress(OSError):
            while chunk := source.recv(65536):
                found = self.pattern.search(chunk) if requests else None
                if found:
                    self.held.append(found.group(0).decode())
                    time.sleep(self.delay)
                sink.sendall(chunk)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)
