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

import os
import queue
import time
from collections import deque
from collections.abc import Callable, Iterable

from m31ctl import interrupt
from m31ctl.pull.cache import Part, RepoCache
from m31ctl.pull.hub import RangeIgnored, TransientError, Transport
from m31ctl.pull.integrity import file_problem
from m31ctl.pull.jobs import Job, Running, Task, split_parts
from m31ctl.pull.partial_file import PartialFile, PartWriter
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
from m31ctl.pull.watch import ByteMeter, Tally, Watch, rate_text
from m31ctl.pull.workers import Worker, locate_all


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
        self._finished: queue.Queue[Worker] = queue.Queue()
        self._running: dict[Worker, Running] = {}
        self._queue: deque[Task] = deque()
        self._jobs: list[Job] = []
        self._twins: dict[str, list[RepoFile]] = {}  # etag -> other files of the same bytes
        self._hashing: dict[Worker, tuple[Job, list[str | None]]] = {}  # adopted bytes being hashed

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
            locations = locate_all(self.transport, self.listing, unique, self.watch.connections)
            for f, location in zip(unique, locations, strict=True):
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
    def _job(self, f: RepoFile, location: Location, adopted: bool) -> Job:
        via: Via = "xet" if location.xet and self.xet else "http"
        if via == "xet":
            return Job(f, location, via, [Part(0, f.size)], check_hash=False)
        size = location.size if location.size is not None else f.size
        parts = self.cache.parts(f) if size == f.size else [Part(0, size)]
        job = Job(f, location, via, parts, adopted, resumed_from=sum(p.done for p in parts))
        self._split(job)
        return job

    def _split(self, job: Job) -> None:
        """Cut what is left of each range into ranges of about part_bytes, recorded before any of
        them gets a byte (the record is what tells the holes from the bytes)."""
        parts = split_parts(job.parts, self.watch)
        if len(parts) > 1 and parts != job.parts:
            self.cache.write_parts(job.f, parts)
        job.parts = parts

    def _schedule(self, job: Job, not_before: float = 0.0) -> None:
        for i, part in enumerate(job.parts):
            if job.via == "xet" or part.left > 0:
                self._queue.append(Task(job, i, not_before))
                if job.via == "xet":
                    return

    def _queued(self, job: Job) -> bool:
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

    def _start(self, task: Task, now: float) -> None:
        job = task.job
        if job.via == "xet":
            moved = [0]

            def count(n: int) -> None:
                moved[0] += n

            def fetch_xet() -> None:
                self.transport.fetch_xet(self.listing.repo, self.listing.commit, job.f.path, count)

            worker = Worker(fetch_xet, job.f.path, self._finished)
            running = Running(task, job.generation, lambda: moved[0], self.transport.abort_xet, now)
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

            worker = Worker(fetch_http, job.f.path, self._finished)
            running = Running(task, job.generation, lambda: writer.written, writer.cancel, now, writer=writer)
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

    def _ended(self, worker: Worker, done: dict[str, FileDone]) -> None:
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

    def _count(self, running: Running, now: float) -> None:
        count = running.moved()
        if count > running.seen:
            self.meter.add(count - running.seen, now)
            running.task.job.fetched += count - running.seen
            running.seen, running.last_byte = count, now

    def _failed(self, task: Task, problem: str) -> None:
        job = task.job
        failures = job.failures.get(task.part, 0) + 1
        job.failures[task.part] = failures
        part = job.parts[task.part]
        byte_range = (part.start, part.end) if job.ranged else None
        if failures <= self.watch.retries:
            backoff = self.watch.backoff_s * 2 ** (failures - 1)
            self.emit(Retry(job.f.path, failures, self.watch.retries, job.via, problem, backoff, byte_range))
            self._queue.append(Task(job, task.part, self.clock() + backoff))
        elif job.via == "xet":
            self.emit(Fallback(job.f.path, "xet", "http", f"{problem} ({failures} attempts)"))
            self.xet = False
            for other in [j for j in self._jobs if j.via == "xet" and not j.done]:
                self._queue = deque(t for t in self._queue if t.job is not other)
                self._to_http(other)
        else:
            raise DownloadStalled(
                f"{job.f.path}: {problem}, and again after {self.watch.retries} retries "
                f"(last rate {rate_text(self.meter.last_rate)})",
                hint="rerun m31ctl pull to continue where it stopped, or raise --stall-timeout",
            )

    def _to_http(self, job: Job) -> None:
        """A Xet file not done when Xet was given up on: plain HTTP from what is on disk."""
        fresh = self._job(job.f, job.location, job.check_hash)  # self.xet is False now: plain HTTP
        job.via, job.parts, job.failures = "http", fresh.parts, {}
        job.resumed_from, job.generation, job.running = fresh.resumed_from, job.generation + 1, 0
        self._schedule(job)

    def _merge(self, job: Job) -> None:
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

    def _finish(self, job: Job, done: dict[str, FileDone]) -> None:
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

                worker = Worker(hash_adopted, f.path, self._finished)
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

    def _hashed(self, job: Job, problem: str | None, done: dict[str, FileDone]) -> None:
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

    def _open_partial(self, job: Job) -> None:
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
