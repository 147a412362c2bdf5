"""One rehearsal's session: its options, its id (the label value on everything it makes), how
Ctrl-C and SIGTERM reach it, and the cleanup of what it made."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

from m31ctl import interrupt
from m31ctl.labels import Label
from m31ctl.rehearsal import docker_verbs
from m31ctl.rehearsal.provision import BASE_IMAGE
from m31ctl.resources import cache_root
from m31ctl.runtime import engine_api

Progress = Callable[[str], None]  # a line for the user while it runs


class Options(NamedTuple):
    target: str = "k8s"
    keep: bool = False
    timeout_s: int = 600
    base_image: str = BASE_IMAGE
    cache_dir: Path | None = None
    # Rehearse at the plan's own clock scaled by this factor, with a load that long injected
    # into every engine (twin.scaled_clock); None: the tiny model's own start, within timeout_s.
    clock_scale: float | None = None
    # Start the leader this many seconds after its workers (a leader still pulling or downloading).
    leader_delay_s: float = 0.0
    # Roll an image change out by the rendered strategy and prove the old pod's drain (rollout_proof.py).
    rollout: bool = False

    @property
    def cache(self) -> Path:
        """Where the tiny models are kept."""
        return self.cache_dir if self.cache_dir is not None else cache_root() / "rehearsal"


def new_session() -> str:
    return uuid.uuid4().hex[:8]


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM (a CI job cancelled, `docker stop` of a runner) stops a rehearsal as Ctrl-C does,
    through the cleanup; by default it would end the process with everything left running. Both
    are recorded and taken at the waits' checks (m31ctl.interrupt), never raised mid-step."""
    with interrupt.handling():
        yield


def clean_up(client: Any, session: str) -> list[str]:
    """Remove everything the session made; what is left behind (empty when all is gone). It runs
    to its end: a second Ctrl-C (or a SIGTERM) while removing would leave things behind, so it
    only asks, and a third abandons the cleanup (m31ctl.interrupt.shielded)."""
    with interrupt.shielded():
        problems = docker_verbs.remove_labelled(client, Label.REHEARSAL, session)
        return engine_api.labelled(client, Label.REHEARSAL, session) + problems
