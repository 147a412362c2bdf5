"""The checkpoint download that every target runs before the engine, with its own budget.

A 250 GB checkpoint downloaded inside the engine's start-up would need a start-up budget that
covers the download at the link's speed (a slow link becomes a restart loop); run first, with its
own budget (budgets.download_s), it leaves the engine's start-up to loading and compiling. Every
target runs the same command in the engine image, whose huggingface_hub is the library vLLM reads
the cache with (Kubernetes: an init container; the script and systemd: a `docker run --rm` before
the engine). huggingface_hub reads HF_TOKEN itself; a run cut short is resumed by the next.
"""

from __future__ import annotations

from m31ctl.deployment import Deployment

# SIGALRM ends the download at its budget (os._exit: the download threads would keep the
# interpreter alive past a plain exception); exit 124 as timeout(1) does.
DOWNLOAD_SCRIPT = """\
import os, signal, sys
from huggingface_hub import snapshot_download
repo, budget, skip = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def late(*_):
    print(f"m31ctl: {repo} not downloaded within {budget} s (runtime.download_mbps sizes it); "
          "the next start resumes it", file=sys.stderr, flush=True)
    os._exit(124)
signal.signal(signal.SIGALRM, late)
signal.alarm(budget)
snapshot_download(repo, ignore_patterns=skip or None)
"""


def download_command(deployment: Deployment) -> list[str] | None:
    """`python3 -c SCRIPT REPO BUDGET [SKIP...]` for the plan's hub checkpoint; None for a local
    checkpoint directory (nothing to download). The draft's folder is skipped unless the plan
    drafts with it, as `m31ctl pull` does."""
    repo = deployment.model.repo_id
    if repo is None:
        return None
    skipped = deployment.draft.skipped
    skip = [skipped] if skipped else []
    return ["python3", "-c", DOWNLOAD_SCRIPT, repo, str(max(1, deployment.budgets.download_s)), *skip]
