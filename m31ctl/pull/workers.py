"""The worker threads of a pull: each runs one piece of blocking work (a HEAD, a transfer, hashing
adopted bytes) and hands itself, with any error, to the one thread that watches them all.

Only the watching thread decides what an error means; a worker never raises past itself.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable

from m31ctl import interrupt
from m31ctl.pull.hub import Transport
from m31ctl.pull.records import Listing, Location, RepoFile


class Worker(threading.Thread):
    def __init__(self, work: Callable[[], None], name: str, finished: queue.Queue[Worker]) -> None:
        super().__init__(name=f"pull {name}", daemon=True)  # never keeps an interrupted pull alive
        self._work, self._finished = work, finished
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._work()
        except BaseException as exc:  # handed to the watching thread, which decides
            self.error = exc
        finally:
            self._finished.put(self)


def locate_all(
    transport: Transport, listing: Listing, files: list[RepoFile], connections: int
) -> list[Location]:
    """Each file's location (HEAD /resolve), `connections` at a time."""
    found: dict[int, Location] = {}
    errors: dict[int, BaseException] = {}
    pending = deque(enumerate(files))
    finished: queue.Queue[Worker] = queue.Queue()
    running: dict[Worker, int] = {}

    def locate(i: int, f: RepoFile) -> Callable[[], None]:
        def work() -> None:
            found[i] = transport.locate(listing.repo, listing.commit, f.path)

        return work

    while pending or running:
        interrupt.check()
        while pending and len(running) < connections:
            i, f = pending.popleft()
            worker = Worker(locate(i, f), f.path, finished)
            running[worker] = i
            worker.start()
        try:
            worker = finished.get(timeout=0.1)  # a timeout: Ctrl-C is heard while waiting
        except queue.Empty:
            continue
        i = running.pop(worker)
        if worker.error is not None:
            errors[i] = worker.error
            pending.clear()
    if errors:
        raise errors[min(errors)]
    return [found[i] for i in range(len(files))]
