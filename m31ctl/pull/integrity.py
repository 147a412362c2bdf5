"""What `pull --verify` checks in the snapshot: every file the hub lists, at the hub's size, with the
content hash the hub publishes (sha256 for LFS files, the git blob id for the others); and every shard
that a `*.safetensors.index.json` names, listed by the hub (so present once the files are)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path

from m31ctl.pull.records import RepoFile

CHUNK = 8 << 20


def file_problem(path: Path, f: RepoFile, hashed: Callable[[int], None]) -> str | None:
    """What is wrong with the local copy of `f` at `path`, or None; `hashed` hears bytes as they are read."""
    try:
        size = path.stat().st_size
    except OSError:
        return "missing"
    if size != f.size:
        return f"{size} bytes, the hub has {f.size}" + (" (truncated)" if size < f.size else "")
    if f.sha256:
        found = _digest(path, hashlib.sha256(), hashed)
        return None if found == f.sha256 else f"sha256 {found[:12]}..., the hub has {f.sha256[:12]}..."
    if f.blob_id:
        found = _digest(path, hashlib.sha1(b"blob %d\0" % size), hashed)
        return None if found == f.blob_id else f"git blob id {found[:12]}..., the hub has {f.blob_id[:12]}..."
    return None


def index_problems(snapshot: Path, files: Iterable[RepoFile]) -> list[tuple[str, str]]:
    """(shard, problem) for each shard an index in the snapshot names that the hub does not list."""
    listed = {f.path for f in files}
    problems: list[tuple[str, str]] = []
    for index in sorted(p for p in listed if p.endswith(".safetensors.index.json")):
        try:
            weight_map = json.loads((snapshot / index).read_text()).get("weight_map") or {}
        except (OSError, ValueError, AttributeError):
            problems.append((index, "unreadable"))
            continue
        folder = index.rpartition("/")[0]
        for shard in sorted(set(weight_map.values())):
            path = f"{folder}/{shard}" if folder else shard
            if path not in listed:
                problems.append((path, f"named by {index} but not in the repo"))
    return problems


def _digest(path: Path, digest: hashlib._Hash, hashed: Callable[[int], None]) -> str:
    with path.open("rb") as stream:
        while chunk := stream.read(CHUNK):
            digest.update(chunk)
            hashed(len(chunk))
    return digest.hexdigest()
