"""Which revision of a hub checkpoint a rendered target downloads and serves, decided without the hub.

A rendered target downloads the checkpoint before the engine and serves it offline
(render/download.py). The revision it names is decided here, at render time, from what this
machine already knows, in order: the lock's commit (`--locked`, when it recorded one), `--revision`
when it is a commit, or the commit this machine's Hugging Face cache recorded for the revision
(<runtime.hf_cache>/hub/models--ORG--NAME/refs/<revision>, which `m31ctl pull` and `hf download`
write), read as a plain file. When none names a commit, the rendered files carry the revision's
name: the download resolves it when it runs, at deploy time, and the engine serves offline what
the download recorded in refs/ (docs/decisions.md, "Renders without the hub (issues 51, 53)").

Nothing here asks the hub or imports huggingface_hub: a render works where the hub cannot be
reached, and pays for neither the library's import nor a round trip.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from m31ctl.errors import InputError

if TYPE_CHECKING:
    from m31ctl.deployment import Deployment

COMMIT = re.compile(r"[0-9a-f]{40}")
# A branch or tag name as it may land in a rendered file and a path under the cache: git's ref
# characters less those a shell, a path or a YAML scalar reads specially; no `.`/`..` component.
REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._+-]*(/[A-Za-z0-9_][A-Za-z0-9._+-]*)*")

# The targets that never download or name the checkpoint (monitoring reads the engines' metrics).
CHECKPOINT_FREE = frozenset({"monitoring"})


def is_commit(revision: str) -> bool:
    return COMMIT.fullmatch(revision) is not None


def checked_revision(revision: str) -> str:
    """`revision` when it can be written into a rendered file and a cache path; else exit 2."""
    if REVISION.fullmatch(revision) is None or ".." in revision:
        raise InputError(
            f"--revision {revision!r} is not a branch, tag or commit name",
            hint="--revision main, a tag, or a 40-hex commit",
        )
    return revision


class Pinned(NamedTuple):
    """The deployment as a target renders it, and the one warning to print (None: pinned)."""

    deployment: Deployment
    warning: str | None = None


def pin_checkpoint(deployment: Deployment, target: str, locked: Path | None, revision: str) -> Pinned:
    """The deployment with its hub checkpoint's revision for `target`: a commit (the lock's,
    `revision` itself, or what this machine's cache recorded for it), else `revision`'s name,
    resolved at deploy time, with a warning that says so and how to pin it. A local checkpoint
    and a target that never names the checkpoint (monitoring) are returned as they are."""
    repo = deployment.model.repo_id
    if repo is None or (target in CHECKPOINT_FREE and deployment.model.commit is not None):
        return Pinned(deployment)
    # lazy: the cache's layout only for a hub checkpoint, and the lock's model (pydantic models,
    # the image facts: a third of render's start) only when a lock is given
    from m31ctl.checkpoint import cached_commit, hub_dir
    from m31ctl.deployment import derive

    checked_revision(revision)
    if target in CHECKPOINT_FREE:
        # Its files name no checkpoint, so nothing is looked up and nothing warned; but its
        # k8s-monitoring.yaml selects the pods the k8s target's own documents make, and those
        # download one named revision: the name given is enough (its value is in no file).
        return Pinned(derive(deployment.plan, commit=revision))
    recorded = None
    if locked is not None:
        from m31ctl import lockfile  # lazy: see above, only with a lock

        recorded = lockfile.read(locked).checkpoint
    if recorded is not None and recorded.commit:
        commit: str | None = recorded.commit
    elif is_commit(revision):
        commit = revision
    else:
        # A cache path that is a file, or unreadable, records nothing (cached_commit: None).
        commit = cached_commit(deployment.hf_cache, repo, revision)
    if commit is not None and is_commit(commit):
        return Pinned(derive(deployment.plan, commit=commit))
    # The rendered files name the revision: the download resolves it, the engine serves offline
    # what the download recorded (the adapter's --revision and HF_HUB_OFFLINE read model.commit).
    warning = unpinned_warning(repo, revision, hub_dir(deployment.hf_cache), locked)
    return Pinned(derive(deployment.plan, commit=revision), warning)


def unpinned_warning(repo: str, revision: str, hub_cache: Path, locked: Path | None = None) -> str:
    """What an unpinned render says once: the revision is resolved at deploy time, why, and the
    two ways to pin it (neither needs the hub where the render runs)."""
    lock = f"{locked} records no checkpoint commit and " if locked is not None else ""
    return (
        f"{repo}@{revision} is not pinned to a commit: {lock}this machine's Hugging Face cache "
        f"({hub_cache}) has no refs/{revision} for it, so the rendered download resolves it when it "
        f"runs, at deploy time, and the engine serves offline the commit that download recorded; "
        "to pin it, render with --revision COMMIT, or with --locked FILE from `m31ctl lock` run "
        "after `m31ctl pull` on a machine that reaches the hub"
    )
