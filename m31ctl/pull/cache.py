"""The Hugging Face cache as huggingface_hub lays it out and vLLM reads it, and the free-space seam.

`<cache>/models--ORG--NAME/blobs/<etag>` holds each file once; `snapshots/<commit>/<path>` links to
it; `refs/<branch>` names the commit a branch resolved to (what an offline vLLM reads for a repo id
without a revision). A pull writes plain-HTTP bytes to `blobs/<etag>.incomplete`, a name that stays
the same from one run to the next, so a later run continues after its bytes (huggingface_hub 2.x
downloads to a per-process temporary name and deletes it on failure: it never resumes across runs).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from m31ctl.checkpoint import repo_folder
from m31ctl.pull.model import RepoFile


class RepoCache:
    def __init__(self, cache_dir: Path, repo: str) -> None:
        self.cache_dir = cache_dir
        self.root = cache_dir / repo_folder(repo)

    def blob(self, etag: str) -> Path:
        return self.root / "blobs" / etag

    def partial(self, etag: str) -> Path:
        return self.root / "blobs" / f"{etag}.incomplete"

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

    def partial_bytes(self, f: RepoFile) -> int:
        """Bytes an earlier run left for this file that the next transfer continues after."""
        try:
            size = self.partial(f.etag).stat().st_size
        except OSError:
            return 0
        return size if size <= f.size else 0

    def forget(self, commit: str, f: RepoFile) -> None:
        """Remove a file's blob and partial bytes (a corrupt copy), keeping the snapshot's link."""
        for path in (self.pointer(commit, f.path).resolve(), self.blob(f.etag), self.partial(f.etag)):
            if path.is_file():
                path.unlink()

    def write_ref(self, revision: str, commit: str) -> None:
        """refs/<revision> -> commit, as hf_hub_download writes it, once every file is in place."""
        if revision == commit:
            return
        ref = self.root / "refs" / revision
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f".{ref.name}.tmp")
        tmp.write_text(commit)
        os.replace(tmp, ref)


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
