"""One file of a pull as the transfers see it: where its bytes are, how they come, its byte ranges
and their failed attempts (`Job`); one transfer to start (`Task`) and one running (`Running`).

A large file is cut into ranges of about `Watch.part_bytes` (`split_parts`) so that one file alone
keeps every connection busy; the cut is pure, and the Fetcher records it before a byte arrives.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from m31ctl.pull.cache import Part
from m31ctl.pull.partial_file import PartialFile, PartWriter
from m31ctl.pull.records import Location, RepoFile, Via
from m31ctl.pull.watch import Watch


@dataclass
class Job:
    """One file of this pull: where its bytes are, how they come, what is on disk."""

    f: RepoFile
    location: Location
    via: Via
    parts: list[Part]
    check_hash: bool  # bytes adopted from another tool's partial file: hashed before they count
    resumed_from: int = 0
    fetched: int = 0  # bytes this run moved for it
    partial: PartialFile | None = None
    running: int = 0
    failures: dict[int, int] = field(default_factory=dict)  # part index -> failed attempts
    generation: int = 0  # bumped when its ranges are merged: transfers of an older one are ignored
    done: bool = False

    @property
    def ranged(self) -> bool:
        return len(self.parts) > 1


@dataclass
class Task:
    job: Job
    part: int  # index into job.parts (0 for a Xet transfer: the whole file)
    not_before: float = 0.0


@dataclass
class Running:
    task: Task
    generation: int
    moved: Callable[[], int]
    cancel: Callable[[], None]
    last_byte: float
    seen: int = 0
    writer: PartWriter | None = None  # plain HTTP's

    @property
    def via(self) -> Via:
        return self.task.job.via


def split_parts(parts: list[Part], watch: Watch) -> list[Part]:
    """What is left of each range cut into ranges of about part_bytes (`parts` itself where the
    watch runs one connection or cuts nothing)."""
    piece = watch.part_bytes
    if watch.connections < 2 or piece <= 0:
        return parts
    cut: list[Part] = []
    for part in parts:
        left = part.left
        count = math.ceil(left / piece) if left > piece + piece // 2 else 1
        if count == 1:
            cut.append(part)
            continue
        step = math.ceil(left / count)
        at = part.start + part.done
        cut.append(Part(part.start, at + step, part.done))
        for first in range(at + step, part.end, step):
            cut.append(Part(first, min(first + step, part.end)))
    return cut
