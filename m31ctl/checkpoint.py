"""Where a checkpoint is: `model.path` read as vLLM reads it, and the Hugging Face cache's layout.

Both the plan's engine rules (which read the checkpoint's config.json before any Deployment
exists) and the Deployment (which every stage that acts reads) need these answers; they are
spelled here once. Expanding `~` reads the caller's home and working directory, which are
parameters (default: this process's), so the functions stay pure given them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

from m31ctl.errors import InputError


class ModelSource(NamedTuple):
    """Where the checkpoint comes from: a Hugging Face repo id, or a directory on the host.

    A local directory is mounted at the same absolute path inside a container, so `reference`
    (vLLM's first argument) is right both natively and in every container target."""

    reference: str
    local: bool
    # The hub revision a rendered target downloads, then serves offline: a commit when the render
    # pinned one, else a branch or tag name the download resolves at deploy time (m31ctl/
    # revision.py; the engine adapter passes it as --revision). None: a local directory, or
    # launch, which pulls and then serves the pulled snapshot offline.
    commit: str | None = None

    @property
    def host_path(self) -> str | None:
        return self.reference if self.local else None

    @property
    def repo_id(self) -> str | None:
        return None if self.local else self.reference


def _home(home: str | None) -> str:
    return home if home is not None else os.path.expanduser("~")


def model_source(path: str, home: str | None = None, cwd: str | None = None) -> ModelSource:
    """`model.path` read once: `~` and relative paths become one absolute path; anything else is
    a hub repo id (vLLM itself reads a path that does not start like a directory as a repo id)."""
    if path == "~" or path.startswith("~/"):
        return ModelSource(os.path.normpath(_home(home) + path[1:]), True)
    if path.startswith("~"):
        raise InputError(
            f"model.path={path!r}: only the current user's home (~/) is expanded",
            hint="write the absolute path",
        )
    if path in (".", "..") or path.startswith(("./", "../")):
        return ModelSource(
            os.path.normpath(os.path.join(cwd if cwd is not None else os.getcwd(), path)), True
        )
    if os.path.isabs(path):
        return ModelSource(os.path.normpath(path), True)
    return ModelSource(path, False)


def host_path(path: str, setting: str, home: str | None = None) -> str:
    """A host directory setting (runtime.hf_cache) as one absolute path."""
    if path == "~" or path.startswith("~/"):
        return os.path.normpath(_home(home) + path[1:])
    if not os.path.isabs(path):
        raise InputError(
            f"{setting}={path!r} must be an absolute path or start with ~/",
            hint=f"--set {setting}=/data/huggingface",
        )
    return os.path.normpath(path)


def hub_dir(hf_cache: str | Path) -> Path:
    """The hub cache under HF_HOME (runtime.hf_cache: the container mounts it whole)."""
    return Path(hf_cache) / "hub"


def repo_folder(repo: str) -> str:
    """A hub repo's folder name in the hub cache (huggingface_hub's layout, which vLLM reads):
    blobs/, snapshots/<commit>/, refs/<branch> inside it."""
    return f"models--{repo.replace('/', '--')}"


def repo_cache(hf_cache: str | Path, repo: str) -> Path:
    return hub_dir(hf_cache) / repo_folder(repo)


def cached_commit(hf_cache: str | Path, repo: str, revision: str = "main") -> str | None:
    """The commit `revision` resolved to when it was last downloaded (refs/<revision>), or None."""
    try:
        commit = (repo_cache(hf_cache, repo) / "refs" / revision).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return commit if commit.isalnum() and len(commit) <= 64 else None


def cached_snapshot(hf_cache: str | Path, repo: str) -> Path | None:
    """The snapshot an offline vLLM reads for `repo` without a revision: the commit refs/main
    names, else (no ref written) the newest snapshot; None when nothing is cached."""
    snapshots = repo_cache(hf_cache, repo) / "snapshots"
    commit = cached_commit(hf_cache, repo)
    if commit and (snapshots / commit).is_dir():
        return snapshots / commit
    found = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime) if snapshots.is_dir() else []
    return found[-1] if found else None
