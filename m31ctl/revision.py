"""Pinning a hub checkpoint to one commit: the seam where `render` asks the hub.

A rendered target downloads one commit and serves it offline (render/download.py); which commit
is decided once, here, at render time: the lock's (`--locked`), a commit given as `--revision`,
or what the hub says the revision (a branch or tag, `main` by default) points at now.
"""

from __future__ import annotations

import os
import re

from m31ctl.errors import HostPreconditionError, M31Error

COMMIT = re.compile(r"[0-9a-f]{40}")


def is_commit(revision: str) -> bool:
    return COMMIT.fullmatch(revision) is not None


def resolve_commit(repo: str, revision: str) -> str:
    """The commit `revision` of `repo` names (huggingface_hub's model_info: HF_ENDPOINT and
    HF_TOKEN from the environment, as vLLM would read them)."""
    if is_commit(revision):
        return revision
    # Imported here: only a render of a hub checkpoint pays for huggingface_hub's import.
    from huggingface_hub import HfApi

    from m31ctl.pull.hub import hub_errors

    endpoint = os.environ.get("HF_ENDPOINT")
    try:
        # HF_ENDPOINT as it is now (huggingface_hub reads it once, at import), as `pull` does.
        with hub_errors(repo, revision, endpoint):
            info = HfApi(endpoint=endpoint).model_info(repo, revision=revision, timeout=20)
    except M31Error as exc:
        # The hub's refusal in pull's words, its own remedy first, and how to render without asking it.
        pin = "pin it yourself: --revision COMMIT (m31ctl pull prints it), or --locked FILE"
        raise type(exc)(
            f"cannot pin {repo}@{revision} to a commit: {exc.message}",
            hint=f"{exc.hint}; or {pin}" if exc.hint else pin,
        ) from None
    if not info.sha:
        raise HostPreconditionError(f"the hub's answer for {repo}@{revision} names no commit")
    return info.sha
