"""How a pull's transfers are watched (stall timeout, retries, connections, range size) and what
it counts: the files and bytes of the whole pull, and the rate bytes arrive at.

Apart from the transfers (transfer.py) because the pull (run.py) sets the watch and the tally and
meters its own verify pass with a ByteMeter of its own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class Watch:
    """How transfers are watched and how many run at once."""

    stall_timeout_s: float = 60.0
    retries: int = 3
    progress_every_s: float = 0.5
    # At most this many transfers at once (huggingface_hub's snapshot_download runs 8 files at once;
    # here a large file's ranges count too, so one large file alone still gets them all).
    connections: int = 8
    # A file larger than this comes in ranges of about this size: large enough that a range's own
    # request costs little (one HEAD-free GET), small enough that 4 shards keep 8 connections busy.
    part_bytes: int = 64 * MIB
    record_every_s: float = 1.0  # how often a file in ranges rewrites its record of bytes on disk

    @property
    def backoff_s(self) -> float:
        """The first pause before a retry (then doubled): short enough to matter little against a
        stall timeout, never longer than five seconds."""
        return min(5.0, self.stall_timeout_s)


@dataclass
class Tally:
    """The whole pull's counts, for progress events."""

    files_total: int
    bytes_total: int
    files_done: int = 0
    bytes_before: int = 0  # complete or partial before this run's first byte


class ByteMeter:
    """Bytes this run moved, and the rate over the last WINDOW_S seconds."""

    WINDOW_S = 10.0

    def __init__(self, now: float) -> None:
        self.total = 0
        self.last_rate = 0.0  # the rate when bytes last arrived: what a stall message quotes
        self._samples: deque[tuple[float, int]] = deque([(now, 0)])

    def add(self, moved: int, now: float) -> None:
        self.total += moved
        self._samples.append((now, self.total))
        while len(self._samples) > 2 and self._samples[1][0] < now - self.WINDOW_S:
            self._samples.popleft()
        self.last_rate = self.rate(now)

    def rate(self, now: float) -> float:
        start, before = self._samples[0]
        span = now - start
        return (self.total - before) / span if span > 0 else 0.0


def rate_text(bps: float) -> str:
    """A rate as a stall message quotes it."""
    return f"{bps / 1e6:.2f} MB/s" if bps >= 1e5 else f"{bps / 1e3:.1f} kB/s"
