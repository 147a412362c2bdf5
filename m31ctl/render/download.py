"""The checkpoint download that every target runs before the engine, with its own budget.

A 250 GB checkpoint downloaded inside the engine's start-up would need a start-up budget that
covers the download at the link's speed (a slow link becomes a restart loop); run first, with its
own budget (timeline.download), it leaves the engine's start-up to loading and compiling. Every
target runs the same command in the engine image, whose huggingface_hub is the library vLLM reads
the cache with (Kubernetes: an init container; Compose: a one-shot service the engine depends on;
the script and systemd: a `docker run --rm` before the engine). It fetches the revision the
deployment names (m31ctl/revision.py): a commit when the render could pin one, else a branch or
tag, which snapshot_download resolves when it runs and records in the cache's refs/<revision>.
The engine then serves offline (engine/adapter.py) with the same --revision: a commit's snapshot,
or the commit refs/<revision> names, the one the download recorded. So a restart never
downloads, and a repo that moves after the download cannot hand a pod other files.

When the download is complete it leaves a marker in the cache, named repo@revision; the other
pods of a group that shares the claim wait for the marker instead of downloading the same bytes
at once (twice the egress, and file locks over NFS).
A marker named after a branch stays from an earlier download: docs/decisions.md ("Renders
without the hub") says what that means when the branch has moved.
"""

from __future__ import annotations

from typing import NamedTuple
from urllib.parse import quote

from m31ctl.checkpoint import repo_folder
from m31ctl.deployment import HF_CACHE_IN_CONTAINER, Deployment
from m31ctl.engine.adapter import ENGINE_ONLY_ENV
from m31ctl.errors import InputError

# SIGALRM ends the download at its budget (os._exit: the download threads would keep the
# interpreter alive past a plain exception); exit 124 as timeout(1) does. SIGTERM (a pod deleted,
# `docker stop`) exits at once: as PID 1 Python would otherwise ignore it until the grace period.
DOWNLOAD_SCRIPT = """\
import os, signal, sys
from huggingface_hub import snapshot_download
repo, commit, budget, marker, skip = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:]
def late(*_):
    print(f"m31ctl: {repo}@{commit} not downloaded within {budget} s (runtime.download_mbps sizes it); "
          "the next start resumes it", file=sys.stderr, flush=True)
    os._exit(124)
signal.signal(signal.SIGALRM, late)
signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
signal.alarm(budget)
path = snapshot_download(repo, revision=commit, ignore_patterns=skip or None)
os.makedirs(os.path.dirname(marker), exist_ok=True)
open(marker, "w").close()
print(f"m31ctl: {repo}@{commit} is in the cache (commit {os.path.basename(path)})", flush=True)
"""

# The other members of a group: wait for the marker, saying so once a minute. Who downloads is
# a multi-node group's leader, or a P/D pair's prefill where the roles share one claim.
WAIT_SCRIPT = """\
import os, signal, sys, time
marker, budget = sys.argv[1], int(sys.argv[2])
signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
start = time.monotonic()
while not os.path.exists(marker):
    waited = time.monotonic() - start
    if waited >= budget:
        print(f"m31ctl: the group's download (its leader's, or prefill's) did not complete within {budget} s ({marker})",
              file=sys.stderr, flush=True)
        sys.exit(124)
    if int(waited) % 60 < 5:
        print(f"m31ctl: waiting for the group's download, its leader's or prefill's ({int(waited)} s of {budget} s)",
              flush=True)
    time.sleep(5)
"""


class DownloadStep(NamedTuple):
    """The download as every target runs it: the command, and the marker it leaves."""

    command: list[str]
    marker: str  # inside the container
    env: tuple[tuple[str, str], ...]  # the engine's environment minus what only the engine reads


def _marker(repo: str, revision: str) -> str:
    """repo@revision: a commit, or a branch or tag name (its `/` kept out of the path: %2F)."""
    return f"{HF_CACHE_IN_CONTAINER}/m31ctl/complete/{repo_folder(repo)}@{quote(revision, safe='')}"


def _named(deployment: Deployment) -> tuple[str, str] | None:
    """The hub repo and the revision the deployment downloads; None for a local checkpoint."""
    repo, revision = deployment.model.repo_id, deployment.model.commit
    if repo is None:
        return None
    if revision is None:
        # A rendered target downloads one revision and serves it offline: refuse a file that would not.
        raise InputError(
            f"{repo} names no revision: a rendered target downloads one and serves it offline",
            hint="render through `m31ctl render` (--revision, --locked, or this machine's cache name it)",
        )
    return repo, revision


def download_step(deployment: Deployment, env: tuple[tuple[str, str], ...]) -> DownloadStep | None:
    """`python3 -c SCRIPT REPO REVISION BUDGET MARKER [SKIP...]` for the plan's hub checkpoint;
    None for a local checkpoint directory (nothing to download). The draft's folder is skipped
    unless the plan drafts with it, as `m31ctl pull` does. `env`: the engine container's."""
    named = _named(deployment)
    if named is None:
        return None
    repo, revision = named
    skipped = deployment.draft.skipped
    budget = str(max(1, deployment.timeline.download_s))
    marker = _marker(repo, revision)
    command = [
        "python3",
        "-c",
        DOWNLOAD_SCRIPT,
        repo,
        revision,
        budget,
        marker,
        *([skipped] if skipped else []),
    ]
    # The engine's alone, and the RDMA fabric's (NCCL's HCAs: the download uses no NCCL).
    rdma = deployment.rdma
    hidden = (*ENGINE_ONLY_ENV, *deployment.vendor.visibility_vars, *(dict(rdma.env) if rdma else ()))
    return DownloadStep(command, marker, tuple((k, v) for k, v in env if k not in hidden))


def wait_command(deployment: Deployment, step: DownloadStep) -> list[str]:
    """What the other pods of a group run instead of downloading: wait for the leader's marker."""
    return ["python3", "-c", WAIT_SCRIPT, step.marker, str(deployment.timeline.checkpoint_wait_s)]
