"""`m31ctl pull`: the plan's checkpoint, and its DSpark draft when the plan drafts, downloaded into
the plan's Hugging Face cache with huggingface_hub; in parallel (files, and byte ranges of large
files), watched (typed progress events), resumable (partial bytes kept across runs, either tool's),
reusing blobs the cache holds already, pinned to a commit, and verified against the hub's hashes on request.

May import m31ctl.plan and m31ctl.errors; never the runtime, doctor, render or cli packages.
"""

from __future__ import annotations

from m31ctl.pull.records import (
    Corrupt,
    DownloadStalled,
    Fallback,
    FileDone,
    OnEvent,
    PartialDownload,
    Progress,
    PullEvent,
    PullInterrupted,
    PullResult,
    Retry,
    Started,
)
from m31ctl.pull.run import PullOptions, PullTarget, pull, pull_target

__all__ = [
    "Corrupt",
    "DownloadStalled",
    "Fallback",
    "FileDone",
    "OnEvent",
    "PartialDownload",
    "Progress",
    "PullEvent",
    "PullInterrupted",
    "PullOptions",
    "PullResult",
    "PullTarget",
    "Retry",
    "Started",
    "pull",
    "pull_target",
]
