"""The pull: list the repo at a revision and pin its commit, take the cache's inventory (what is in
the snapshot, in blobs/, in partial files), check the disk for what is really missing, link what
blobs/ holds already, fetch the rest in parallel under the watchdog, name the branch's commit in
refs/, and verify on request."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from m31ctl.checkpoint import hub_dir
from m31ctl.errors import CheckFailed, HostPreconditionError, InputError
from m31ctl.pull.cache import RepoCache, free_space_at
from m31ctl.pull.hub import HubTransport, Transport
from m31ctl.pull.integrity import file_problem, index_problems
from m31ctl.pull.inventory import apply_inventory, take_inventory
from m31ctl.pull.records import (
    Corrupt,
    Listing,
    OnEvent,
    PullInterrupted,
    PullResult,
    RepoFile,
    Started,
)
from m31ctl.pull.transfer import Fetcher
from m31ctl.pull.watch import ByteMeter, Tally, Watch

if TYPE_CHECKING:
    from m31ctl.deployment import Deployment

GB = 1e9
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class PullOptions(NamedTuple):
    revision: str = "main"
    verify: bool = False
    stall_timeout_s: float = 60.0
    retries: int = 3
    # The caller's environment: HF_TOKEN (by reference: only ever handed to huggingface_hub),
    # HF_ENDPOINT, HF_HUB_DISABLE_XET.
    environ: Mapping[str, str] | None = None
    connections: int = Watch.connections  # transfers at once: files, or byte ranges of a large file
    part_bytes: int = Watch.part_bytes  # a file larger than this comes in byte ranges of about this size


class PullTarget(NamedTuple):
    repo: str | None  # None: model.path is a local directory
    local: str | None
    cache_dir: Path  # the hub cache under runtime.hf_cache
    draft_dir: str | None  # the model's draft folder ("dspark/"), if it has one
    with_draft: bool  # whether the plan drafts with it (speculative.method == dspark)

    def wanted(self, f: RepoFile) -> bool:
        return self.with_draft or not (self.draft_dir and f.path.startswith(self.draft_dir))


def pull_target(deployment: Deployment) -> PullTarget:
    model = deployment.model
    cache_dir = hub_dir(deployment.hf_cache)
    draft, with_draft = deployment.draft
    if model.repo_id is None:
        return PullTarget(None, model.host_path, cache_dir, draft, with_draft)
    if not _REPO_ID.match(model.repo_id):
        raise InputError(
            f"model.path {model.repo_id!r} is neither a hub repo id (ORG/NAME) nor a local directory",
            hint="--set model.path=ORG/NAME, or a path starting with /, ./ or ~/",
        )
    return PullTarget(model.repo_id, None, cache_dir, draft, with_draft)


def pull(
    deployment: Deployment, options: PullOptions, on_event: OnEvent, transport: Transport | None = None
) -> PullResult:
    """Download the deployment's checkpoint into its cache; a local model.path has nothing to pull."""
    target = pull_target(deployment)
    started = time.monotonic()
    if target.repo is None:
        return _local(target)
    env = options.environ or {}
    try:
        if transport is not None:
            return _pull(target, options, transport, on_event, started)
        token = env.get("HF_TOKEN") or None
        with HubTransport(target.cache_dir, env.get("HF_ENDPOINT"), token, options.stall_timeout_s) as hub:
            return _pull(target, options, hub, on_event, started)
    except KeyboardInterrupt:
        # A transfer thread still inside a request when the session closed retries it and logs so
        # ("Bad file descriptor ... Retrying in 1s") after the one interrupted line: the pull has
        # abandoned those threads, so nothing huggingface_hub says from now on is news.
        logging.getLogger("huggingface_hub").setLevel(logging.CRITICAL)
        raise PullInterrupted(
            "interrupted; complete files and the bytes of the files in flight stay in the cache",
            hint="rerun m31ctl pull to continue where it stopped",
        ) from None


def _local(target: PullTarget) -> PullResult:
    local = target.local or ""
    why = f"model.path is the local directory {local}: nothing to pull"
    if not os.path.isdir(local):
        why = f"model.path is the local path {local}, which does not exist here: nothing to pull"
    return PullResult(None, None, None, local, None, 0, 0, 0, 0, 0, 0, 0.0, False, nothing_to_pull=why)


def _pull(
    target: PullTarget, options: PullOptions, hub: Transport, on_event: OnEvent, started: float
) -> PullResult:
    assert target.repo is not None
    listing = hub.listing(target.repo, options.revision)
    files = tuple(f for f in listing.files if target.wanted(f))
    cache = RepoCache(target.cache_dir, target.repo)
    found = take_inventory(cache, listing.commit, files)
    total, needed = sum(f.size for f in files), found.bytes_needed
    free = _check_disk(target.cache_dir, needed, found.bytes_removed)
    connections = max(1, options.connections)
    on_event(
        Started(
            listing.repo,
            listing.revision,
            listing.commit,
            str(target.cache_dir),
            len(files),
            len(found.cached),
            total,
            sum(f.size for f in found.cached),
            found.bytes_partial,
            needed,
            free,
            len(found.reused),
            sum(f.size for f in found.reused),
            found.partials,
            connections,
        )
    )
    apply_inventory(cache, listing.commit, found, on_event, hub.link)
    tally = Tally(len(files), total, len(found.cached) + len(found.reused), total - needed)
    xet = hub.xet_available and (options.environ or {}).get("HF_HUB_DISABLE_XET", "") in ("", "0")
    watch = Watch(
        options.stall_timeout_s, options.retries, connections=connections, part_bytes=options.part_bytes
    )
    fetcher = Fetcher(hub, cache, listing, watch, tally, on_event, xet=xet)
    fetcher.fetch_all(found.fetch, found.adopted)
    cache.write_ref(listing.revision, listing.commit)
    refetched = tuple(f.path for f, _problem in found.damaged)
    if options.verify:
        refetched += _verify(fetcher, cache, listing, files)
    return PullResult(
        listing.repo,
        listing.revision,
        listing.commit,
        str(cache.snapshot(listing.commit)),
        str(target.cache_dir),
        len(files),
        len(found.cached),
        len(found.fetch),
        total,
        fetcher.meter.total,
        fetcher.resumed,
        round(time.monotonic() - started, 3),
        options.verify,
        refetched,
        files_reused=len(found.reused),
        bytes_reused=sum(f.size for f in found.reused),
        partial_files=found.partials,
        connections=fetcher.most_transfers,
    )


def _check_disk(cache_dir: Path, needed: int, freed: int) -> int:
    """Refuse before the first byte when the cache's disk cannot hold what is left to fetch (the
    dead partial files the pull removes count as free)."""
    where, free = free_space_at(cache_dir)
    free += freed
    if needed > free:
        raise HostPreconditionError(
            f"not enough disk for the download at {where}: {needed / GB:.1f} GB still to fetch, "
            f"{free / GB:.1f} GB free (short by {(needed - free) / GB:.1f} GB)",
            hint="free space, or point the cache at a larger disk: --set runtime.hf_cache=/data/hf",
        )
    return free


def _verify(
    fetcher: Fetcher, cache: RepoCache, listing: Listing, files: tuple[RepoFile, ...]
) -> tuple[str, ...]:
    """Check every file against the hub's size and hash; fetch a bad one again, once. Raises
    CheckFailed (exit 1) for what a second fetch does not mend, or an index naming an absent shard."""
    emit, commit = fetcher.emit, listing.commit
    broken = index_problems(cache.snapshot(commit), files)
    for shard, why in broken:
        emit(Corrupt(shard, why, refetch=False))
    tally = fetcher.tally
    tally.files_done = 0
    meter, hashed, current = ByteMeter(fetcher.clock()), [0], [""]

    def on_hashed(n: int) -> None:
        hashed[0] += n
        meter.add(n, fetcher.clock())
        fetcher.progress("verify", current[0], done=hashed[0], meter=meter)

    refetched: list[str] = []
    for f in files:
        current[0] = f.path
        problem = file_problem(cache.pointer(commit, f.path), f, on_hashed)
        if problem is not None:
            emit(Corrupt(f.path, problem, refetch=True))
            cache.forget(commit, f)
            fetcher.fetch(f)
            tally.files_done -= 1  # counted again below, as verified
            refetched.append(f.path)
            again = file_problem(cache.pointer(commit, f.path), f, lambda n: None)
            if again is not None:
                broken.append((f.path, f"{again} after fetching it again"))
        tally.files_done += 1
    fetcher.progress("verify", "", done=hashed[0], meter=meter, force=True)
    if broken:
        raise CheckFailed(
            "verify failed: " + "; ".join(f"{path}: {problem}" for path, problem in broken),
            hint="the hub's copy disagrees with its own listing: report it, or pin another --revision",
        )
    return tuple(refetched)
