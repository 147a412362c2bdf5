"""The transfers, in parallel and watched. Each runs in a worker thread (a file, or one byte range
of a large file where the server honours `Range`), at most `Watch.connections` at once, while this
thread counts their bytes, reports one progress view over all of them and watches each for a stall:
no byte for the stall timeout ends that transfer's attempt. A failed attempt (stall, reset, early
close, 5xx) is retried with a doubling backoff, the other transfers running on meanwhile; Xet
transfers that keep failing fall back to plain HTTP for the rest of the pull (what
HF_HUB_DISABLE_XET=1 does); plain HTTP that keeps failing ends the pull (exit 5) naming the file and
the last rate seen.

Plain HTTP writes each range at its offset of a partial file whose name outlives the process
(cache.py), from where it stopped: a retry, a Ctrl-C or a killed process loses at most the chunk in
flight (and, for a file in ranges, the bytes since its record was last written). Memory is bounded
by the connections: a transfer writes each chunk it reads (64 KiB) before it reads the next. Xet
transfers run one at a time (hf_xet runs its own parallel transfers inside one, and its abort
stops every transfer of the process).
"""

from __future__ import annotations

import fcntl
import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from m31ctl import interrupt
from m31ctl.errors import ConflictError
from m31ctl.pull.cache import Part, RepoCache
from m31ctl.pull.hub import RangeIgnored, TransientError, Transport
from m31ctl.pull.integrity import file_problem
from m31ctl.pull.records import (
    Corrupt,
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

MIB = 1 << 20


@dataclass(frozen=True)
class Watch:
    """How transfers are watched and how many run at once."""

    stall_timeout_s: float = 60.0
    retries: int = 3
    progress_every_s: float = 0.5
    # At most this many transfers at once (huggingface_hub's snapshot_download runs 8 files at once;
    # here a large file's ranges count too, so one large file alone still gets them all).
    connections: int = 8
    # A file larger than this comes in ranges of about this size: large enough that a range's own
    # request costs little (one HEAD-free GET), small enough that 4 shards keep 8 connections busy.
    part_bytes: int = 64 * MIB
    record_every_s: float = 1.0  # how often a file in ranges rewrites its record of bytes on disk

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


class ByteMeter:
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
    """Raised into an abandoned transfer thread by its writer."""


class PartialFile:
    """One blob's partial file, open once for all its ranges: locked (flock) against a second pull
    writing it too, written at offsets."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            raise ConflictError(
                f"another process is downloading into {path}", hint="wait for it, or stop it and rerun"
            ) from None
        self._open = True

    def write_at(self, data: bytes, offset: int) -> int:
        return os.pwrite(self._fd, data, offset)

    def truncate(self, size: int) -> None:
        os.ftruncate(self._fd, size)

    def close(self) -> None:
        if self._open:
            self._open = False
            os.close(self._fd)  # also releases the lock on it


class PartWriter:
    """One range's writer (hub.Writer): each write lands after the range's bytes on disk; once
    cancelled it refuses every write, so an abandoned thread never writes after the next attempt began."""

    def __init__(self, partial: PartialFile, part: Part) -> None:
        self.partial, self.part = partial, part
        self.written = 0  # by this attempt: what the watchdog counts
        self.restarted = False  # the server sent the whole file: nothing was resumed after all
        self._lock = threading.Lock()
        self._cancelled = False

    def write(self, data: bytes) -> int:
        with self._lock:
            if self._cancelled:
                raise _Cancelled
            count = self.partial.write_at(data, self.part.start + self.part.done)
            self.part.done += count
            self.written += count
            return count

    def restart(self) -> None:
        """The server ignored the Range of a file in one piece and sends it from its first byte."""
        with self._lock:
            if self._cancelled:
                raise _Cancelled
            self.partial.truncate(0)
            self.part.done = 0
            self.restarted = True

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True


class _Worker(threading.Thread):
    def __init__(self, work: Callable[[], None], name: str, finished: queue.Queue[_Worker]) -> None:
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


@dataclass
class _Job:
    """One file of this pull: where its bytes are, how they come, what is on disk."""

    f: RepoFile
    location: Location
    via: Via
    parts: list[Part]
    check_hash: bool  # bytes adopted from another tool's partial file: hashed before they count
    resumed_from: int = 0
    fetched: int = 0  # bytes this run moved for it
    partial: PartialFile | None = None
    running: int = 0
    failures: dict[int, int] = field(default_factory=dict)  # part index -> failed attempts
    generation: int = 0  # bumped when its ranges are merged: transfers of an older one are ignored
    done: bool = False

    @property
    def ranged(self) -> bool:
        return len(self.parts) > 1


@dataclass
class _Task:
    job: _Job
    part: int  # index into job.parts (0 for a Xet transfer: the whole file)
    not_before: float = 0.0


@dataclass
class _Running:
    task: _Task
    generation: int
    moved: Callable[[], int]
    cancel: Callable[[], None]
    last_byte: float
    seen: int = 0
    writer: PartWriter | None = None  # plain HTTP's

    @property
    def via(self) -> Via:
        return self.task.job.via


class Fetcher:
    """Fetches files of one listing into the cache, in parallel, under the watchdog."""

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
    ) -> None:
        self.transport, self.cache, self.listing = transport, cache, listing
        self.watch, self.tally, self.emit = watch, tally, emit
        self.xet = xet  # False after a fallback: the rest of the pull goes over plain HTTP
        self.clock = clock
        self.meter = ByteMeter(clock())
        self.resumed = 0
        self.most_transfers = 0
        self._last_progress = float("-inf")
        self._last_record = float("-inf")
        self._finished: queue.Queue[_Worker] = queue.Queue()
        self._running: dict[_Worker, _Running] = {}
        self._queue: deque[_Task] = deque()
        self._jobs: list[_Job] = []
        self._twins: dict[str, list[RepoFile]] = {}  # etag -> other files of the same bytes
        self._hashing: dict[_Worker, tuple[_Job, list[str | None]]] = {}  # adopted bytes being hashed

    # --- the pull's entry points ------------------------------------------------------------------
    def fetch(self, f: RepoFile) -> FileDone:
        return self.fetch_all([f])[0]

    def fetch_all(self, files: Iterable[RepoFile], adopted: frozenset[str] = frozenset()) -> list[FileDone]:
        """Fetch these files; `adopted` names files whose partial bytes another tool wrote (hashed
        once complete, fetched again if wrong). Returns each file's FileDone, in listing order."""
        files = list(files)
        done: dict[str, FileDone] = {}
        self._jobs, self._twins = [], {}
        firsts: dict[str, RepoFile] = {}
        for f in files:  # one transfer per blob: files of the same bytes are linked to it
            if f.etag in firsts:
                self._twins.setdefault(f.etag, []).append(f)
            else:
                firsts[f.etag] = f
        unique = list(firsts.values())
        try:
            for f, location in zip(unique, self._locate(unique), strict=True):
                job = self._job(f, location, f.path in adopted)
                self._jobs.append(job)
                self._schedule(job)
            for job in self._jobs:
                if not job.done and job.running == 0 and not self._queued(job):
                    self._finish(job, done)  # nothing left to fetch: only the rename and the link
            while self._queue or self._running or self._hashing:
                interrupt.check()  # Ctrl-C: the except below stops every transfer and keeps its bytes
                self._start_ready()
                self._collect(done)
                self._watchdog()
        except BaseException:  # Ctrl-C, a stall through every retry: stop, keep the bytes on disk
            self._stop_all()
            raise
        return [done[f.path] for f in files]

    # --- planning ---------------------------------------------------------------------------------
    def _locate(self, files: list[RepoFile]) -> list[Location]:
        """Each file's location (HEAD /resolve), `connections` at a time."""
        found: dict[int, Location] = {}
        errors: dict[int, BaseException] = {}
        pending = deque(enumerate(files))
        finished: queue.Queue[_Worker] = queue.Queue()
        running: dict[_Worker, int] = {}

        def locate(i: int, f: RepoFile) -> Callable[[], None]:
            def work() -> None:
                found[i] = self.transport.locate(self.listing.repo, self.listing.commit, f.path)

            return work

        while pending or running:
            interrupt.check()
            while pending and len(running) < self.watch.connections:
                i, f = pending.popleft()
                worker = _Worker(locate(i, f), f.path, finished)
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

    def _job(self, f: RepoFile, location: Location, adopted: bool) -> _Job:
        via: Via = "xet" if location.xet and self.xet else "http"
        if via == "xet":
            return _Job(f, location, via, [Part(0, f.size)], check_hash=False)
        size = location.size if location.size is not None else f.size
        parts = self.cache.parts(f) if size == f.size else [Part(0, size)]
        job = _Job(f, location, via, parts, adopted, resumed_from=sum(p.done for p in parts))
        self._split(job)
        return job

    def _split(self, job: _Job) -> None:
        """Cut what is left of each range into ranges of about part_bytes, recorded before any of
        them gets a byte (the record is what tells the holes from the bytes)."""
        piece = self.watch.part_bytes
        if self.watch.connections < 2 or piece <= 0:
            return
        parts: list[Part] = []
        for part in job.parts:
            left = part.left
            count = math.ceil(left / piece) if left > piece + piece // 2 else 1
            if count == 1:
                parts.append(part)
                continue
            step = math.ceil(left / count)
            at = part.start + part.done
            parts.append(Part(part.start, at + step, part.done))
            for first in range(at + step, part.end, step):
                parts.append(Part(first, min(first + step, part.end)))
        if len(parts) > 1 and parts != job.parts:
            self.cache.write_parts(job.f, parts)
        job.parts = parts

    def _schedule(self, job: _Job, not_before: float = 0.0) -> None:
        for i, part in enumerate(job.parts):
            if job.via == "xet" or part.left > 0:
                self._queue.append(_Task(job, i, not_before))
                if job.via == "xet":
                    return

    def _queued(self, job: _Job) -> bool:
        return any(task.job is job for task in self._queue)

    # --- running ----------------------------------------------------------------------------------
    def _start_ready(self) -> None:
        now = self.clock()
        xet_busy = any(r.via == "xet" for r in self._running.values())
        for task in list(self._queue):
            if len(self._running) >= self.watch.connections:
                break
            if task.not_before > now or (task.job.via == "xet" and xet_busy):
                continue
            self._queue.remove(task)
            self._start(task, now)
            xet_busy = xet_busy or task.job.via == "xet"
        self.most_transfers = max(self.most_transfers, len(self._running))

    def _start(self, task: _Task, now: float) -> None:
        job = task.job
        if job.via == "xet":
            moved = [0]

            def count(n: int) -> None:
                moved[0] += n

            def fetch_xet() -> None:
                self.transport.fetch_xet(self.listing.repo, self.listing.commit, job.f.path, count)

            worker = _Worker(fetch_xet, job.f.path, self._finished)
            running = _Running(task, job.generation, lambda: moved[0], self.transport.abort_xet, now)
        else:
            if job.partial is None:
                self._open_partial(job)
            assert job.partial is not None
            part = job.parts[task.part]
            writer = PartWriter(job.partial, part)
            first = part.start + part.done
            end = part.end if job.ranged else None
            location = job.location

            def fetch_http() -> None:
                self.transport.fetch_http(location, writer, first, end)

            worker = _Worker(fetch_http, job.f.path, self._finished)
            running = _Running(
                task, job.generation, lambda: writer.written, writer.cancel, now, writer=writer
            )
        job.running += 1
        self._running[worker] = running
        worker.start()

    def _collect(self, done: dict[str, FileDone]) -> None:
        """Wait a little for a transfer to end, and act on every one that has."""
        try:
            worker = self._finished.get(timeout=0.1)
        except queue.Empty:
            return
        while True:
            self._ended(worker, done)
            try:
                worker = self._finished.get_nowait()
            except queue.Empty:
                return

    def _ended(self, worker: _Worker, done: dict[str, FileDone]) -> None:
        if worker in self._hashing:
            hashed, problem = self._hashing.pop(worker)
            if worker.error is not None:
                raise worker.error
            self._hashed(hashed, problem[0], done)
            return
        running = self._running.pop(worker, None)
        if running is None:
            return  # abandoned after a stall: its successor is running or done
        self._count(running, self.clock())
        task, job = running.task, running.task.job
        job.running -= 1
        if running.generation != job.generation:
            return  # a range of a file since merged into one piece
        error = worker.error
        if running.writer is not None and running.writer.restarted:
            job.resumed_from = 0
        if error is None:
            if job.running == 0 and not self._queued(job):
                self._finish(job, done)
            return
        if isinstance(error, RangeIgnored):
            self._merge(job)
            return
        if isinstance(error, TransientError):
            self._failed(task, str(error))
            return
        raise error

    def _watchdog(self) -> None:
        now = self.clock()
        for worker, running in list(self._running.items()):
            self._count(running, now)
            if now - running.last_byte >= self.watch.stall_timeout_s:
                running.cancel()
                del self._running[worker]
                running.task.job.running -= 1
                if running.via == "xet":
                    worker.join(self.watch.stall_timeout_s)  # the abort ends it; hf_xet's next start is clean
                self._failed(running.task, f"no bytes for {self.watch.stall_timeout_s:g} s")
        in_flight = self._in_flight()
        self.progress("download", in_flight[0] if in_flight else "")
        if now - self._last_record >= self.watch.record_every_s:
            self._last_record = now
            self._write_records()

    def _count(self, running: _Running, now: float) -> None:
        count = running.moved()
        if count > running.seen:
            self.meter.add(count - running.seen, now)
            running.task.job.fetched += count - running.seen
            running.seen, running.last_byte = count, now

    def _failed(self, task: _Task, problem: str) -> None:
        job = task.job
        failures = job.failures.get(task.part, 0) + 1
        job.failures[task.part] = failures
        part = job.parts[task.part]
        byte_range = (part.start, part.end) if job.ranged else None
        if failures <= self.watch.retries:
            backoff = self.watch.backoff_s * 2 ** (failures - 1)
            self.emit(Retry(job.f.path, failures, self.watch.retries, job.via, problem, backoff, byte_range))
            self._queue.append(_Task(job, task.part, self.clock() + backoff))
        elif job.via == "xet":
            self.emit(Fallback(job.f.path, "xet", "http", f"{problem} ({failures} attempts)"))
            self.xet = False
            for other in [j for j in self._jobs if j.via == "xet" and not j.done]:
                self._queue = deque(t for t in self._queue if t.job is not other)
                self._to_http(other)
        else:
            raise DownloadStalled(
                f"{job.f.path}: {problem}, and again after {self.watch.retries} retries "
                f"(last rate {_rate(self.meter.last_rate)})",
                hint="rerun m31ctl pull to continue where it stopped, or raise --stall-timeout",
            )

    def _to_http(self, job: _Job) -> None:
        """A Xet file not done when Xet was given up on: plain HTTP from what is on disk."""
        fresh = self._job(job.f, job.location, job.check_hash)  # self.xet is False now: plain HTTP
        job.via, job.parts, job.failures = "http", fresh.parts, {}
        job.resumed_from, job.generation, job.running = fresh.resumed_from, job.generation + 1, 0
        self._schedule(job)

    def _merge(self, job: _Job) -> None:
        """The server ignores Range: this file comes in one piece, after the bytes on disk from 0."""
        for worker, running in list(self._running.items()):
            if running.task.job is job:
                running.cancel()
                del self._running[worker]
        self._queue = deque(t for t in self._queue if t.job is not job)
        prefix = 0
        for part in job.parts:
            if part.start != prefix:
                break
            prefix += part.done
            if part.left:
                break
        if job.partial is not None:
            job.partial.truncate(prefix)
        self.cache.drop_parts_record(job.f.etag)
        job.parts, job.running, job.generation = [Part(0, job.f.size, prefix)], 0, job.generation + 1
        job.resumed_from = min(job.resumed_from, prefix)
        self._schedule(job)

    def _finish(self, job: _Job, done: dict[str, FileDone]) -> None:
        """Every byte is on disk: the blob into place, the snapshot's link, the file's event."""
        f = job.f
        if job.via == "http":
            if job.partial is None:
                self._open_partial(job)  # every byte was on disk already, or a file of no bytes
            assert job.partial is not None
            job.partial.close()
            if job.check_hash:  # hashed in a thread of its own: the other transfers stay watched
                job.check_hash = False
                path, problem = job.partial.path, []

                def hash_adopted() -> None:
                    problem.append(file_problem(path, f, lambda n: None))

                worker = _Worker(hash_adopted, f.path, self._finished)
                self._hashing[worker] = (job, problem)
                worker.start()
                return
            os.replace(job.partial.path, self.cache.blob(f.etag))
            self.cache.drop_parts_record(f.etag)
            self.transport.link(self.cache.blob(f.etag), self.cache.pointer(self.listing.commit, f.path))
        job.done = True
        self.resumed += job.resumed_from
        parts = len(job.parts) if job.via == "http" else 1
        events = [FileDone(f.path, f.size, job.fetched, job.resumed_from, job.via, parts)]
        for twin in self._twins.get(f.etag, []):
            self.transport.link(self.cache.blob(f.etag), self.cache.pointer(self.listing.commit, twin.path))
            events.append(FileDone(twin.path, twin.size, 0, 0, job.via, 0))  # no part of its own
        for event in events:
            self.tally.files_done += 1
            done[event.file] = event
            self.emit(event)
        self.progress("download", f.path, force=True)

    def _hashed(self, job: _Job, problem: str | None, done: dict[str, FileDone]) -> None:
        """Adopted bytes hashed: the file is done, or (not a prefix of it) fetched again from 0."""
        if problem is None:
            self._finish(job, done)
            return
        f = job.f
        self.emit(Corrupt(f.path, f"{problem} in huggingface_hub's partial file", refetch=True))
        self.cache.drop_partial(f.etag)
        job.partial, job.resumed_from, job.fetched = None, 0, 0
        job.parts = [Part(0, f.size)]
        self._split(job)
        self._schedule(job)

    def _open_partial(self, job: _Job) -> None:
        """Open (and lock) the file's partial file, cut to what the ranges account for: bytes past
        them are not part of this file (a longer file under its name, a piece's unrecorded tail)."""
        job.partial = PartialFile(self.cache.partial(job.f.etag))
        size = job.partial.path.stat().st_size
        keep = job.parts[-1].end if job.ranged else job.parts[0].done
        if size > keep:
            job.partial.truncate(keep)

    def _write_records(self) -> None:
        for job in self._jobs:
            if job.ranged and job.partial is not None and not job.done:
                self.cache.write_parts(job.f, job.parts)

    def _stop_all(self) -> None:
        """Cancel every transfer; what reached the disk stays, recorded, for the next run (shielded:
        a second Ctrl-C asks before it abandons this)."""
        with interrupt.shielded():
            for running in self._running.values():
                running.cancel()
            self._running.clear()
            self._queue.clear()
            self._hashing.clear()  # a thread reading a file: it ends by itself
            for job in self._jobs:
                if job.partial is not None and not job.done:
                    if job.ranged:
                        self.cache.write_parts(job.f, job.parts)  # after the cancels: the final counts
                    job.partial.close()

    def _in_flight(self) -> list[str]:
        seen: dict[str, None] = {}
        for running in self._running.values():
            seen.setdefault(running.task.job.f.path)
        return list(seen)

    # --- progress ---------------------------------------------------------------------------------
    def progress(
        self,
        phase: str,
        path: str,
        *,
        force: bool = False,
        done: int | None = None,
        meter: ByteMeter | None = None,
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
        in_flight = tuple(self._in_flight()) if phase != "verify" else ()
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
                in_flight,
                len(self._running) if phase != "verify" else 0,
            )
        )


def _rate(bps: float) -> str:
    return f"{bps / 1e6:.2f} MB/s" if bps >= 1e5 else f"{bps / 1e3:.1f} kB/s"
