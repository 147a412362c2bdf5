"""One file's transfer, watched. It runs in a worker thread while this thread counts its bytes,
reports progress and watches for a stall: no byte for the stall timeout ends the attempt. A failed
attempt (stall, reset, early close, 5xx) is retried with a doubling backoff; Xet transfers that keep
failing fall back to plain HTTP for the rest of the pull (what HF_HUB_DISABLE_XET=1 does: the
library's http_get on the file's resolved location); plain HTTP that keeps failing ends the pull
(exit 5) naming the file and the last rate seen.

Plain HTTP writes to a partial file whose name outlives the process (cache.py), from where it
stopped: a retry, a Ctrl-C or a killed process loses at most the chunk in flight.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from m31ctl.errors import ConflictError
from m31ctl.pull.cache import RepoCache
from m31ctl.pull.hub import TransientError, Transport
from m31ctl.pull.model import (
    DownloadStalled,
    Fallback,
    FileDone,
    Listing,
    Location,
    OnEvent,
    Progress,
    RepoFile,
    Retry,
    Via,
)


@dataclass(frozen=True)
class Watch:
    stall_timeout_s: float = 60.0
    retries: int = 3
    progress_every_s: float = 0.5

    @property
    def backoff_s(self) -> float:
        """The first pause before a retry (then doubled): short enough to matter little against a
        stall timeout, never longer than five seconds."""
        return min(5.0, self.stall_timeout_s)


@dataclass
class Tally:
    """The whole pull's counts, for progress events."""

    files_total: int
    bytes_total: int
    files_done: int = 0
    bytes_before: int = 0  # complete or partial before this run's first byte


class Meter:
    """Bytes this run moved, and the rate over the last WINDOW_S seconds."""

    WINDOW_S = 10.0

    def __init__(self, now: float) -> None:
        self.total = 0
        self.last_rate = 0.0  # the rate when bytes last arrived: what a stall message quotes
        self._samples: deque[tuple[float, int]] = deque([(now, 0)])

    def add(self, moved: int, now: float) -> None:
        self.total += moved
        self._samples.append((now, self.total))
        while len(self._samples) > 2 and self._samples[1][0] < now - self.WINDOW_S:
            self._samples.popleft()
        self.last_rate = self.rate(now)

    def rate(self, now: float) -> float:
        start, before = self._samples[0]
        span = now - start
        return (self.total - before) / span if span > 0 else 0.0


class _Cancelled(Exception):
    """Raised into an abandoned transfer thread by its sink."""


class Sink:
    """The partial file, as http_get uses it (write, tell, seek, truncate). It counts the bytes
    written for the watchdog, holds a lock on the file against a second pull writing it too, and
    once cancelled refuses every write: an abandoned thread never writes after the next attempt began."""

    def __init__(self, path: Path, size: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o666), "r+b")
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.close()
            raise ConflictError(
                f"another process is downloading into {path}", hint="wait for it, or stop it and rerun"
            ) from None
        end = self._file.seek(0, os.SEEK_END)
        if end > size:  # longer than the file it is part of: not a prefix of it
            self._file.truncate(0)
            end = self._file.seek(0)
        self.start = end  # bytes an earlier run left: the transfer asks for the rest
        self.written = 0
        self._lock = threading.Lock()
        self._cancelled = False

    def write(self, data: bytes) -> int:
        with self._lock:
            if self._cancelled:
                raise _Cancelled
            count = self._file.write(data)
            self.written += count
            return count

    def tell(self) -> int:
        return self._file.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._file.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        # http_get truncates when a server ignores the Range and sends the whole file again.
        with self._lock:
            kept = self._file.truncate(size)
            self.start = min(self.start, kept)
            return kept

    def flush(self) -> None:
        self._file.flush()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True

    def close(self) -> None:
        self.cancel()
        with self._lock:
            self._file.close()  # also releases the lock on it


class _Worker(threading.Thread):
    def __init__(self, work: Callable[[], None], name: str) -> None:
        super().__init__(name=f"pull {name}", daemon=True)  # never keeps an interrupted pull alive
        self._work = work
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self._work()
        except BaseException as exc:  # handed to the watching thread, which decides
            self.error = exc


class Fetcher:
    """Fetches files of one listing into the cache, one at a time, under the watchdog."""

    def __init__(
        self,
        transport: Transport,
        cache: RepoCache,
        listing: Listing,
        watch: Watch,
        tally: Tally,
        emit: OnEvent,
        *,
        xet: bool,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.transport, self.cache, self.listing = transport, cache, listing
        self.watch, self.tally, self.emit = watch, tally, emit
        self.xet = xet  # False after a fallback: the rest of the pull goes over plain HTTP
        self.clock, self.sleep = clock, sleep
        self.meter = Meter(clock())
        self.resumed = 0
        self._last_progress = float("-inf")

    def fetch(self, f: RepoFile) -> FileDone:
        location = self.transport.locate(self.listing.repo, self.listing.commit, f.path)
        via: Via = "xet" if location.xet and self.xet else "http"
        before = self.meter.total
        resumed_from = self.cache.partial_bytes(f) if via == "http" else 0
        failures = 0
        while True:
            problem = self._xet(f, location) if via == "xet" else self._http(f, location)
            if problem is None:
                self.resumed += resumed_from
                self.tally.files_done += 1
                done = FileDone(f.path, f.size, self.meter.total - before, resumed_from, via)
                self.emit(done)
                self.progress("download", f.path, force=True)
                return done
            failures += 1
            if failures <= self.watch.retries:
                backoff = self.watch.backoff_s * 2 ** (failures - 1)
                self.emit(Retry(f.path, failures, self.watch.retries, via, problem, backoff))
                self.sleep(backoff)
            elif via == "xet":
                self.emit(Fallback(f.path, "xet", "http", f"{problem} ({failures} attempts)"))
                via, self.xet, failures = "http", False, 0
            else:
                raise DownloadStalled(
                    f"{f.path}: {problem}, and again after {self.watch.retries} retries "
                    f"(last rate {_rate(self.meter.last_rate)})",
                    hint="rerun m31ctl pull to continue where it stopped, or raise --stall-timeout",
                )

    def progress(
        self,
        phase: str,
        path: str,
        *,
        force: bool = False,
        done: int | None = None,
        meter: Meter | None = None,
    ) -> None:
        """A Progress event, at most every progress_every_s unless forced; `done` and `meter` stand
        in for the download's own counts in another phase (verify's hashing)."""
        now = self.clock()
        if not force and now - self._last_progress < self.watch.progress_every_s:
            return
        self._last_progress = now
        rate = (meter or self.meter).rate(now)
        bytes_done = self.tally.bytes_before + self.meter.total if done is None else done
        left = max(self.tally.bytes_total - bytes_done, 0)
        eta = left / rate if rate > 0 else None
        self.emit(
            Progress(
                "verify" if phase == "verify" else "download",
                path,
                self.tally.files_done,
                self.tally.files_total,
                bytes_done,
                self.tally.bytes_total,
                rate,
                eta,
            )
        )

    def _http(self, f: RepoFile, location: Location) -> str | None:
        size = location.size if location.size is not None else f.size
        partial = self.cache.partial(location.etag)
        sink = Sink(partial, size)
        try:
            if sink.start < size:
                start = sink.start
                work = lambda: self.transport.fetch_http(location, sink, start)  # noqa: E731
                problem = self._watched(f, work, lambda: sink.written, sink.cancel)
                if problem is not None:
                    return problem
        finally:
            sink.close()
        blob = self.cache.blob(location.etag)
        os.replace(partial, blob)
        self.transport.link(self.listing.repo, self.listing.commit, f.path)
        return None

    def _xet(self, f: RepoFile, location: Location) -> str | None:
        moved = [0]

        def count(n: int) -> None:
            moved[0] += n

        def work() -> None:
            self.transport.fetch_xet(self.listing.repo, self.listing.commit, f.path, count)

        return self._watched(f, work, lambda: moved[0], self.transport.abort_xet)

    def _watched(
        self, f: RepoFile, work: Callable[[], None], moved: Callable[[], int], cancel: Callable[[], None]
    ) -> str | None:
        """Run `work` in a thread and watch it: None when it finished, else what went wrong."""
        worker = _Worker(work, f.path)
        worker.start()
        seen, last_byte = 0, self.clock()
        try:
            while worker.is_alive():
                worker.join(0.1)
                now, count = self.clock(), moved()
                if count > seen:
                    self.meter.add(count - seen, now)
                    seen, last_byte = count, now
                self.progress("download", f.path)
                if now - last_byte >= self.watch.stall_timeout_s:
                    cancel()
                    worker.join(self.watch.stall_timeout_s)  # a read timeout ends it by then
                    return f"no bytes for {self.watch.stall_timeout_s:g} s"
        except BaseException:  # Ctrl-C: stop the transfer; its bytes so far stay for the next run
            cancel()
            raise
        if count := moved() - seen:
            self.meter.add(count, self.clock())
        error = worker.error
        if error is None:
            return None
        if isinstance(error, TransientError):
            return str(error)
        raise error


def _rate(bps: float) -> str:
    return f"{bps / 1e6:.2f} MB/s" if bps >= 1e5 else f"{bps / 1e3:.1f} kB/s"
