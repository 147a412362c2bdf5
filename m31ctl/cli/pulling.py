"""What `m31ctl pull` shows while the core works and when it is done: a rich progress display on a
terminal (stderr), one JSON line per event with --json (the last line the result, or the error),
plain lines on stderr otherwise (CI logs). The summary names the commit that was downloaded."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from m31ctl.cli.output import console, emit, emit_error, emit_event, text_view
from m31ctl.cli.screen import for_stderr
from m31ctl.errors import ExitCode, InputError, M31Error
from m31ctl.interrupt import StoppedAsAsked
from m31ctl.pull import (
    Corrupt,
    Fallback,
    FileDone,
    PartialDownload,
    Progress,
    PullEvent,
    PullOptions,
    PullResult,
    Retry,
    Started,
    pull,
)
from m31ctl.redact import redact

if TYPE_CHECKING:
    from m31ctl.deployment import Deployment


def run_pull(
    deployment: Deployment, revision: str, verify: bool, stall_timeout: float, retries: int, as_json: bool
) -> int:
    if not (0 < stall_timeout < math.inf):
        raise InputError(f"--stall-timeout {stall_timeout:g} is not a positive number of seconds")
    if retries < 0:
        raise InputError(f"--retries {retries} is negative", hint="0 gives up after the first stall")
    options = PullOptions(revision, verify, stall_timeout, retries, dict(os.environ))
    view: _View = _JsonView() if as_json else _LiveView() if sys.stderr.isatty() else _PlainView()
    try:
        result = pull(deployment, options, view.on_event)
    except M31Error as exc:
        view.close()
        if as_json:  # the stream stays JSON Lines: the error is its last line, as a result would be
            code = _json_error(exc)
            if exc.exit_code == ExitCode.INTERRUPTED:
                # Its one line is written; a command that returns 130 would get the general
                # interruption line as well (cli's reading of click's Ctrl-C at a prompt).
                raise StoppedAsAsked from None
            return code
        raise
    finally:
        view.close()
    emit(PullShown(result), as_json, line=True)
    return 0


@dataclasses.dataclass(frozen=True)
class PullShown:
    """pull's result: under --json the last line of its event stream."""

    result: PullResult

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self.result)


@text_view(PullShown)
def _pull_text(shown: PullShown) -> None:
    sys.stdout.write(summary(shown.result))


def before_launch(as_json: bool) -> Callable[[Deployment], bool]:
    """launch's pull step: the same pull, its events as lines on stderr (launch shows its own
    status line) or JSON lines among launch's; True when a hub checkpoint is now in the cache."""

    def fetch(deployment: Deployment) -> bool:
        if deployment.model.repo_id is None:
            return False  # a local directory: nothing to pull, and the engine never asks the hub
        view: _View = _JsonView() if as_json else _PlainView()
        result = pull(deployment, PullOptions(environ=dict(os.environ)), view.on_event)
        sys.stderr.write(f"m31ctl: pulled {result.repo} at {result.revision}: commit {result.commit}\n")
        return True

    return fetch


def summary(result: PullResult) -> str:
    if result.nothing_to_pull:
        return result.nothing_to_pull + "\n"
    rate = result.bytes_fetched / result.elapsed_s if result.elapsed_s > 0 else 0.0
    lines = [
        f"pulled {result.repo} at {result.revision}: commit {result.commit}",
        f"  {result.files_total} files, {size(result.bytes_total)}, in {result.snapshot}",
        f"  fetched {size(result.bytes_fetched)} in {result.elapsed_s:.1f} s ({size(rate)}/s"
        + (f", up to {result.connections} transfers at once" if result.connections > 1 else "")
        + f"); {result.files_cached} files were complete already"
        + (
            f"; {result.files_reused} linked from blobs the cache held ({size(result.bytes_reused)})"
            if result.files_reused
            else ""
        )
        + (f"; {size(result.bytes_resumed)} resumed from partial files" if result.bytes_resumed else ""),
    ]
    lines += [f"  {partial_line(p)}" for p in result.partial_files]
    if result.verified:
        again = f"; fetched again: {', '.join(result.refetched)}" if result.refetched else ""
        lines.append(f"  verified: every file at the hub's size and hash{again}")
    return "\n".join(lines) + "\n"


def partial_line(p: PartialDownload) -> str:
    """What became of one partial file found in blobs/."""
    of = f" (part of {p.file})" if p.file else ""
    return f"partial file {p.name} of {p.tool}{of}, {size(p.bytes)}: {p.action}, {p.reason}"


def size(count: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count:.0f} B"


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def event_line(event: PullEvent) -> str | None:
    """One line for people, for the events worth a line of their own."""
    if isinstance(event, Started):
        return (
            f"pulling {event.repo} at {event.revision} (commit {event.commit[:12]}) into {event.cache_dir}: "
            f"{event.files_total} files, {size(event.bytes_total)}; {event.files_cached} complete already, "
            + (f"{event.files_reused} in blobs/ already (linked), " if event.files_reused else "")
            + f"{size(event.bytes_partial)} in partial files, {size(event.bytes_needed)} to fetch, "
            f"{size(event.free_bytes)} free; up to {event.connections} transfers at once"
        ) + "".join(f"\n{partial_line(p)}" for p in event.partial_files)
    if isinstance(event, Retry):
        return (
            f"{event.file}: {event.reason}; retry {event.attempt} of {event.retries} over {event.via} "
            f"in {event.backoff_s:g} s"
        )
    if isinstance(event, Fallback):
        return (
            f"{event.file}: {event.from_via} keeps failing ({event.reason}); falling back to {event.to_via}"
        )
    if isinstance(event, Corrupt):
        then = "fetching it again" if event.refetch else "cannot be fetched"
        return f"{event.file}: {event.problem}; {then}"
    return None


class _View:
    def on_event(self, event: PullEvent) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _JsonView(_View):
    def on_event(self, event: PullEvent) -> None:
        payload: dict[str, Any] = dataclasses.asdict(event)
        if isinstance(event, Progress):
            payload["rate_bps"] = round(event.rate_bps)
            payload["eta_s"] = None if event.eta_s is None else round(event.eta_s, 1)
        emit_event(event.kind, payload)


class _PlainView(_View):
    """Lines on stderr: every notable event, each file done, and the totals every 30 s."""

    EVERY_S = 30.0

    def __init__(self) -> None:
        self._last = time.monotonic()

    def on_event(self, event: PullEvent) -> None:
        line = event_line(event)
        if isinstance(event, FileDone):
            line = f"{event.file}: {size(event.size)} done over {event.via}" + (
                f", in {event.parts} byte ranges at once" if event.parts > 1 else ""
            )
        elif isinstance(event, Progress) and time.monotonic() - self._last >= self.EVERY_S:
            self._last = time.monotonic()
            line = (
                f"{event.phase}: {size(event.bytes_done)} of {size(event.bytes_total)}, "
                f"{size(event.rate_bps)}/s, ETA {_eta(event.eta_s)}, files {event.files_done}/{event.files_total}"
            )
        if line:
            sys.stderr.write("".join(f"m31ctl: {text}\n" for text in line.splitlines()))
            sys.stderr.flush()


class _LiveView(_View):
    """A rich progress bar on stderr: bytes, rate, ETA and files from the core's events; other
    events print above it."""

    def __init__(self) -> None:
        self._progress: Any = None
        self._task: Any = None

    def on_event(self, event: PullEvent) -> None:
        line = event_line(event)
        if isinstance(event, Started):
            self._start(event)
        elif isinstance(event, Progress) and self._progress is not None:
            self._progress.update(
                self._task,
                completed=event.bytes_done,
                total=event.bytes_total,
                description=_in_flight(event),
                phase=event.phase,
                rate=f"{size(event.rate_bps)}/s",
                eta=_eta(event.eta_s),
                files=f"{event.files_done}/{event.files_total}",
            )
        if line and self._progress is not None:
            self._progress.console.print(line, markup=False, highlight=False)

    def _start(self, event: Started) -> None:
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn  # lazy: a terminal's only

        self._progress = Progress(
            TextColumn("{task.fields[phase]}"),
            BarColumn(),
            DownloadColumn(),
            TextColumn("{task.fields[rate]}"),
            TextColumn("ETA {task.fields[eta]}"),
            TextColumn("files {task.fields[files]}"),
            TextColumn("{task.description}"),
            console=console(stderr=True),
            transient=False,
        )
        self._task = self._progress.add_task(
            "",
            total=event.bytes_total,
            completed=event.bytes_total - event.bytes_needed,
            phase="download",
            rate="--",
            eta="--:--",
            files=f"{event.files_cached}/{event.files_total}",
        )
        self._progress.start()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _in_flight(event: Progress) -> str:
    """The file in flight, or the first of several and how many more."""
    more = len(event.in_flight) - 1
    return _short(event.file) + (f" (+{more} more)" if more > 0 else "")


def _short(path: str, width: int = 40) -> str:
    return path if len(path) <= width else "..." + path[-(width - 3) :]


def _json_error(exc: M31Error) -> int:
    emit_error(exc.to_json())
    for line in exc.details:
        sys.stderr.write(for_stderr(f"m31ctl: {redact(line)}") + "\n")
    sys.stderr.write(for_stderr(f"m31ctl: error: {redact(exc.one_line())}") + "\n")
    return int(exc.exit_code)
