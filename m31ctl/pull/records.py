"""What a pull works with and what it reports: the repo's files as the hub lists them, the typed
events it streams while it works (the CLI draws or prints them), its result and its errors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Literal

from m31ctl.errors import ExitCode, M31Error, NotReadyError

Via = Literal["xet", "http"]
Tool = Literal["m31ctl", "huggingface_hub"]
PartialAction = Literal["resumed", "removed", "kept"]


@dataclass(frozen=True)
class RepoFile:
    """One file of the repo at the pinned commit, as the hub's model info lists it."""

    path: str
    size: int
    sha256: str | None  # LFS files: the hub publishes the content's sha256 (and names the blob by it)
    blob_id: str | None  # the git blob id: of the content for a regular file, of the LFS pointer otherwise

    @property
    def etag(self) -> str:
        """The name huggingface_hub gives the file's blob in the cache (its ETag on the hub)."""
        return self.sha256 or self.blob_id or ""


@dataclass(frozen=True)
class Listing:
    repo: str
    revision: str
    commit: str  # what `revision` pointed at when listed: every file is fetched at this commit
    files: tuple[RepoFile, ...]


@dataclass(frozen=True)
class Location:
    """Where a file's bytes are, as HEAD /resolve answers: the URL (a CDN for LFS files), the blob
    name, the size, and whether the hub offers the file through Xet."""

    url: str
    etag: str
    size: int | None
    xet: bool


@dataclass(frozen=True)
class PartialDownload:
    """A partial download found in blobs/ before the first byte, by either tool, and what this pull
    did with it: resumed (its bytes kept, the transfer continues after them), removed (it can never
    complete: the blob is there already, or huggingface_hub's process that wrote it is gone), or
    kept (a live process holds it)."""

    name: str  # its name in blobs/
    file: str | None  # the repo file it is a part of, when this pull lists it
    tool: Tool
    bytes: int
    action: PartialAction
    reason: str


# --- events: what the CLI shows while the pull works ----------------------------------------------
@dataclass(frozen=True)
class Started:
    kind: ClassVar[str] = "started"
    repo: str
    revision: str
    commit: str
    cache_dir: str
    files_total: int
    files_cached: int  # complete in this commit's snapshot already: never fetched again
    bytes_total: int
    bytes_cached: int
    bytes_partial: int  # in partial files from an earlier run: the transfer continues after them
    bytes_needed: int  # what this run still has to fetch
    free_bytes: int
    # Added after the fields above (JSON consumers read them by name): blobs already in blobs/
    # (another commit's, or a run killed before its link) that are only linked, the partial files
    # found and what became of them, and the most transfers this pull runs at once.
    files_reused: int = 0
    bytes_reused: int = 0
    partial_files: tuple[PartialDownload, ...] = ()
    connections: int = 1


@dataclass(frozen=True)
class Progress:
    kind: ClassVar[str] = "progress"
    phase: Literal["download", "verify"]
    file: str
    files_done: int
    files_total: int
    bytes_done: int
    bytes_total: int
    rate_bps: float  # bytes per second over the last seconds
    eta_s: float | None  # None until a rate is known
    in_flight: tuple[str, ...] = ()  # files with a transfer running now (`file` is the first of them)
    transfers: int = 0  # transfers running now: files, or byte ranges of one file


@dataclass(frozen=True)
class FileDone:
    kind: ClassVar[str] = "file_done"
    file: str
    size: int
    fetched_bytes: int  # transferred by this run
    resumed_from: int  # bytes already on disk from an earlier run
    via: Via
    parts: int = 1  # the byte ranges it was fetched in, each over its own connection


@dataclass(frozen=True)
class Retry:
    kind: ClassVar[str] = "retry"
    file: str
    attempt: int  # 1 for the first retry
    retries: int
    via: Via
    reason: str
    backoff_s: float
    byte_range: tuple[int, int] | None = None  # [first, end) of the part retried; None: the whole file


@dataclass(frozen=True)
class Fallback:
    kind: ClassVar[str] = "fallback"
    file: str
    from_via: Via
    to_via: Via
    reason: str


@dataclass(frozen=True)
class Corrupt:
    kind: ClassVar[str] = "corrupt"
    file: str
    problem: str
    refetch: bool  # whether the pull fetches it again (a file the hub does not list cannot be)


PullEvent = Started | Progress | FileDone | Retry | Fallback | Corrupt
OnEvent = Callable[[PullEvent], None]


@dataclass(frozen=True)
class PullResult:
    repo: str | None
    revision: str | None
    commit: str | None  # the commit that was downloaded: pin it
    snapshot: str  # the directory vLLM reads (or the local checkpoint)
    cache_dir: str | None
    files_total: int
    files_cached: int
    files_fetched: int
    bytes_total: int
    bytes_fetched: int  # transferred by this run
    bytes_resumed: int  # found in partial files and not fetched again
    elapsed_s: float
    verified: bool
    refetched: tuple[str, ...] = ()
    nothing_to_pull: str | None = None  # why, when model.path is a local directory
    files_reused: int = 0  # blobs already in the cache, linked into this snapshot, not fetched
    bytes_reused: int = 0
    partial_files: tuple[PartialDownload, ...] = ()  # found before the first byte: resumed, removed or kept
    connections: int = 1  # the most transfers at once


class DownloadStalled(NotReadyError):
    """No bytes for the stall timeout, through every retry and the HTTP fallback (exit 5)."""


class PullInterrupted(M31Error):
    exit_code = ExitCode.INTERRUPTED
