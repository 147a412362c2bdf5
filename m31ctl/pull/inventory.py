"""What the cache holds of a listing before the first byte, read from the disk (stats and lock probes,
no hashing), and what the pull does about it: files complete in the snapshot are left alone; a blob
already in blobs/ at the hub's size (another commit's file, or a run killed between the blob's
rename and its link) is only linked; a copy at the wrong size is removed and fetched again; the
rest is fetched, after the bytes partial files hold.

Partial files of either tool are sorted here: m31ctl's own (`<etag>.incomplete`) are resumed;
huggingface_hub's (`<etag>.<8 hex>.incomplete`, which it never reads again) are resumed when they
hold the most bytes of a file still to fetch (renamed to m31ctl's name; hashed once complete,
since hf_xet may write out of order) and removed otherwise, unless a live process holds their lock.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from m31ctl.pull.cache import ForeignPartial, RepoCache
from m31ctl.pull.records import Corrupt, OnEvent, PartialAction, PartialDownload, RepoFile


@dataclass(frozen=True)
class Inventory:
    cached: tuple[RepoFile, ...]  # in this commit's snapshot, at the hub's size
    reused: tuple[RepoFile, ...]  # blobs/<etag> at the hub's size, not linked here yet: linked
    damaged: tuple[tuple[RepoFile, str], ...]  # a copy at the wrong size: removed, fetched again
    fetch: tuple[RepoFile, ...]  # what is fetched (the damaged among them)
    partials: tuple[PartialDownload, ...]  # every partial file found, and what becomes of it
    adopt: tuple[tuple[Path, RepoFile], ...]  # huggingface_hub's partial file -> the file it resumes
    remove: tuple[Path, ...]

    @property
    def bytes_partial(self) -> int:
        """Bytes on disk the fetches continue after."""
        return sum(p.bytes for p in self.partials if p.action == "resumed")

    @property
    def bytes_removed(self) -> int:
        return sum(p.bytes for p in self.partials if p.action == "removed")

    @property
    def bytes_needed(self) -> int:
        """Each blob once (two files of the same bytes are one blob) less its partial bytes."""
        return sum(f.size for f in _first_per_blob(self.fetch).values()) - self.bytes_partial

    @property
    def adopted(self) -> frozenset[str]:
        return frozenset(f.path for _path, f in self.adopt)


def take_inventory(cache: RepoCache, commit: str, files: Iterable[RepoFile]) -> Inventory:
    cached, reused, fetch = [], [], []
    damaged: list[tuple[RepoFile, str]] = []
    for f in files:
        if cache.complete(commit, f):
            cached.append(f)
        elif (problem := _wrong_size(cache, commit, f)) is not None:
            damaged.append((f, problem))
            fetch.append(f)
        elif cache.has_blob(f):
            reused.append(f)
        else:
            fetch.append(f)
    partials, adopt, remove = _sort_partials(cache, cached + reused, fetch, {f for f, _ in damaged})
    return Inventory(
        tuple(cached),
        tuple(reused),
        tuple(damaged),
        tuple(fetch),
        tuple(partials),
        tuple(adopt),
        tuple(remove),
    )


def apply_inventory(
    cache: RepoCache, commit: str, inventory: Inventory, emit: OnEvent, link: Callable[[Path, Path], None]
) -> None:
    """The inventory's side effects, after the disk check: damaged copies and dead partial files
    removed, huggingface_hub's partial files that resume a file renamed, reused blobs linked."""
    for f, problem in inventory.damaged:
        emit(Corrupt(f.path, problem, refetch=True))
        cache.forget(commit, f)
    for path in inventory.remove:
        path.unlink(missing_ok=True)
    for path, f in inventory.adopt:
        cache.drop_partial(f.etag)
        os.replace(path, cache.partial(f.etag))
    for f in inventory.reused:
        link(cache.blob(f.etag), cache.pointer(commit, f.path))


def _first_per_blob(files: Iterable[RepoFile]) -> dict[str, RepoFile]:
    """etag -> the first file with those bytes (a repo may hold the same bytes at two paths)."""
    first: dict[str, RepoFile] = {}
    for f in files:
        first.setdefault(f.etag, f)
    return first


def _wrong_size(cache: RepoCache, commit: str, f: RepoFile) -> str | None:
    """A copy of this file at another size than the hub's (a truncated blob): named, then fetched
    again. A stat each; --verify also reads the contents."""
    size: int | None
    try:
        size = cache.pointer(commit, f.path).stat().st_size
    except OSError:
        size = cache.blob_size(f)
    if size is None or size == f.size:
        return None
    return f"{size} bytes, the hub has {f.size}" + (" (truncated)" if size < f.size else "")


def _sort_partials(
    cache: RepoCache, complete: list[RepoFile], fetch: list[RepoFile], damaged: set[RepoFile]
) -> tuple[list[PartialDownload], list[tuple[Path, RepoFile]], list[Path]]:
    partials: list[PartialDownload] = []
    adopt: list[tuple[Path, RepoFile]] = []
    remove: list[Path] = []
    wanted = _first_per_blob(fetch)
    done_etags = {f.etag for f in complete}

    def ours(f: RepoFile, held: int, action: PartialAction, reason: str) -> PartialDownload:
        return PartialDownload(cache.partial(f.etag).name, f.path, "m31ctl", held, action, reason)

    for have in complete:  # m31ctl's partial of a blob that is complete: never needed again
        if (path := cache.partial(have.etag)).is_file():
            partials.append(ours(have, path.stat().st_size, "removed", "the blob is complete already"))
            remove += [path, cache.parts_record(have.etag)]
    foreign: dict[str, list[ForeignPartial]] = {}
    for found in cache.foreign_partials():
        foreign.setdefault(found.etag, []).append(found)
    for etag, same_blob in sorted(foreign.items()):
        f = wanted.get(etag)
        live = [p for p in same_blob if p.in_use]
        dead = [p for p in same_blob if not p.in_use]
        for p in live:
            partials.append(_hf(p, f, "kept", "a live huggingface_hub download holds its lock"))
        mine = 0 if f is None or f in damaged else cache.partial_bytes(f)
        best = max(
            (p for p in dead if f is not None and p.size <= f.size), key=lambda p: p.size, default=None
        )
        if f is not None and best is not None and best.size > mine and not live:
            adopt.append((best.path, f))
            partials.append(_hf(best, f, "resumed", "huggingface_hub never resumes it; hashed once complete"))
            if mine:
                partials.append(ours(f, mine, "removed", "fewer bytes than huggingface_hub's partial file"))
        else:
            best = None
        for p in dead:
            if p is best:
                continue
            remove.append(p.path)
            partials.append(_hf(p, f, "removed", _why_removed(p, f, etag in done_etags, live != [], mine)))
    adopted = {f.etag for _path, f in adopt}
    for f in wanted.values():  # each blob once, under its first file
        held = 0 if f in damaged else cache.partial_bytes(f)
        if held and f.etag not in adopted:
            partials.append(ours(f, held, "resumed", "the transfer continues after its bytes"))
    return partials, adopt, remove


def _hf(p: ForeignPartial, f: RepoFile | None, action: PartialAction, reason: str) -> PartialDownload:
    return PartialDownload(p.path.name, f.path if f else None, "huggingface_hub", p.size, action, reason)


def _why_removed(p: ForeignPartial, f: RepoFile | None, complete: bool, live: bool, mine: int) -> str:
    if complete:
        return "the blob is complete already"
    if f is None:
        return "no file of this pull; huggingface_hub never resumes its partial files"
    if p.size > f.size:
        return f"{p.size} bytes, longer than the file's {f.size}"
    if live:
        return "another process is downloading this file now"
    if p.size == 0:
        return "it holds no bytes"
    if mine >= p.size:
        return "no more bytes than m31ctl's own partial file"
    return "fewer bytes than another partial file of the same file"
