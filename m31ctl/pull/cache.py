"""The Hugging Face cache as huggingface_hub lays it out and vLLM reads it, and the free-space seam.

`<cache>/models--ORG--NAME/blobs/<etag>` holds each file once; `snapshots/<commit>/<path>` links to
it; `refs/<branch>` names the commit a branch resolved to (what an offline vLLM reads for a repo id
without a revision). A pull writes plain-HTTP bytes to `blobs/<etag>.incomplete`, a name that stays
the same from one run to the next, so a later run continues after its bytes.

A file fetched in one piece is written in order: the partial file's size is the bytes it holds. A
file fetched in several byte ranges at once is written at their offsets, with holes between them;
`blobs/<etag>.incomplete.parts` then records each range and how many of its bytes are on disk (it
is written before the first byte of a second range, and after bytes arrive: a kill loses at most
the bytes since its last write, which the next run fetches again).

huggingface_hub 2.x (file_download.py `_download_to_tmp_and_move`) downloads to a per-process name,
`blobs/<etag>.<8 hex>.incomplete`, deletes it when its download fails and never reads it again: a
killed process leaves it behind for good. It holds `.locks/<repo folder>/<etag>.lock` (flock) while
it writes, which tells a live download from a dead one.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from m31ctl.checkpoint import repo_folder
from m31ctl.pull.records import RepoFile

# huggingface_hub 2.x's per-process partial file (uuid4().hex[:8] between the etag and the suffix).
_HF_PARTIAL = re.compile(r"^(?P<etag>[0-9A-Za-z]+)\.[0-9a-f]{8}\.incomplete$")


@dataclass
class Part:
    """Bytes [start, end) of a file, of which the first `done` are on disk."""

    start: int
    end: int
    done: int = 0

    @property
    def left(self) -> int:
        return self.end - self.start - self.done


@dataclass(frozen=True)
class ForeignPartial:
    """huggingface_hub's partial file in blobs/: whose blob, how many bytes, whether a live process
    writes it."""

    path: Path
    etag: str
    size: int
    in_use: bool


class RepoCache:
    def __init__(self, cache_dir: Path, repo: str) -> None:
        self.cache_dir = cache_dir
        self.root = cache_dir / repo_folder(repo)

    def blob(self, etag: str) -> Path:
        return self.root / "blobs" / etag

    def partial(self, etag: str) -> Path:
        return self.root / "blobs" / f"{etag}.incomplete"

    def parts_record(self, etag: str) -> Path:
        return self.root / "blobs" / f"{etag}.incomplete.parts"

    def snapshot(self, commit: str) -> Path:
        return self.root / "snapshots" / commit

    def pointer(self, commit: str, path: str) -> Path:
        return self.snapshot(commit).joinpath(*path.split("/"))

    def complete(self, commit: str, f: RepoFile) -> bool:
        """In the snapshot, resolving to a blob of the hub's size (a stat, no hashing)."""
        try:
            return self.pointer(commit, f.path).stat().st_size == f.size
        except OSError:
            return False

    def has_blob(self, f: RepoFile) -> bool:
        """blobs/<etag> is there at the hub's size: this file's bytes, whichever commit fetched them."""
        try:
            return self.blob(f.etag).stat().st_size == f.size
        except OSError:
            return False

    def blob_size(self, f: RepoFile) -> int | None:
        try:
            return self.blob(f.etag).stat().st_size
        except OSError:
            return None

    def parts(self, f: RepoFile) -> list[Part]:
        """What an earlier run left of this file: its ranges and the bytes of each on disk. One
        range from 0 when nothing is there (or what is there cannot be part of this file)."""
        try:
            on_disk = self.partial(f.etag).stat().st_size
        except OSError:
            self.drop_parts_record(f.etag)
            return [Part(0, f.size)]
        try:
            record = json.loads(self.parts_record(f.etag).read_text())
        except (OSError, ValueError):
            record = None
        if isinstance(record, dict) and record.get("size") == f.size:
            parts = _read_parts(record.get("parts"), f.size, on_disk)
            if parts:
                return parts
        return [Part(0, f.size, on_disk if on_disk <= f.size else 0)]

    def write_parts(self, f: RepoFile, parts: list[Part]) -> None:
        """Record the ranges (written before a second range's first byte, then as bytes arrive)."""
        record = self.parts_record(f.etag)
        record.parent.mkdir(parents=True, exist_ok=True)
        tmp = record.with_name(f".{record.name}.tmp")
        tmp.write_text(json.dumps({"size": f.size, "parts": [[p.start, p.end, p.done] for p in parts]}))
        os.replace(tmp, record)

    def drop_parts_record(self, etag: str) -> None:
        self.parts_record(etag).unlink(missing_ok=True)

    def partial_bytes(self, f: RepoFile) -> int:
        """Bytes an earlier run left for this file that the next transfer continues after."""
        return sum(p.done for p in self.parts(f))

    def drop_partial(self, etag: str) -> None:
        self.partial(etag).unlink(missing_ok=True)
        self.drop_parts_record(etag)

    def forget(self, commit: str, f: RepoFile) -> None:
        """Remove a file's blob and partial bytes (a corrupt copy), keeping the snapshot's link."""
        for path in (self.pointer(commit, f.path).resolve(), self.blob(f.etag)):
            if path.is_file():
                path.unlink()
        self.drop_partial(f.etag)

    def foreign_partials(self) -> list[ForeignPartial]:
        """huggingface_hub's partial files in blobs/, each with whether its writer still runs."""
        found = []
        blobs = self.root / "blobs"
        for path in sorted(blobs.iterdir()) if blobs.is_dir() else []:
            match = _HF_PARTIAL.match(path.name)
            if not match:
                continue
            try:
                size = path.stat().st_size
            except OSError:
                continue
            etag = match["etag"]
            found.append(ForeignPartial(path, etag, size, self._locked(etag)))
        return found

    def _locked(self, etag: str) -> bool:
        """Whether a process holds huggingface_hub's lock on this blob (it is downloading it now)."""
        lock = self.cache_dir / ".locks" / self.root.name / f"{etag}.lock"
        try:
            fd = os.open(lock, os.O_RDONLY)
        except OSError:
            return False  # no lock file: nobody has ever waited on it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        finally:
            os.close(fd)

    def write_ref(self, revision: str, commit: str) -> None:
        """refs/<revision> -> commit, as hf_hub_download writes it, once every file is in place."""
        if revision == commit:
            return
        ref = self.root / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f".{ref.name}.tmp")
        tmp.write_text(commit)
        os.replace(tmp, ref)


def _read_parts(raw: object, size: int, on_disk: int) -> list[Part]:
    """The recorded ranges, if they tile [0, size) in order; each range's done bytes no more than
    the partial file can hold (it may be shorter than recorded after a crash of the machine)."""
    if not isinstance(raw, list):
        return []
    parts, at = [], 0
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3 and all(isinstance(n, int) for n in item)):
            return []
        start, end, done = item
        if start != at or end <= start or not 0 <= done <= end - start:
            return []
        parts.append(Part(start, end, max(0, min(done, on_disk - start))))
        at = end
    return parts if at == size else []


def free_bytes(path: Path) -> int:
    """Free bytes on the file system holding `path`. The seam for the disk check: tests replace this
    function (m31ctl.pull.cache.free_bytes) to simulate a small disk."""
    return shutil.disk_usage(path).free


def free_space_at(path: Path) -> tuple[Path, int]:
    """The nearest existing directory at or above `path` (the cache may not exist yet) and its free bytes."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe, free_bytes(probe)
