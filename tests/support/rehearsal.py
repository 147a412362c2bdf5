"""The rehearsal's layouts and its Docker side, for the tests that rehearse a plan (`m31ctl
rehearse`) or need the rehearsal image: the dense DP layout over two nodes the serving
rehearsals use, the settings as `--set` arguments, whether Docker and the image are there, and
what a rehearsal left behind."""

from __future__ import annotations

import subprocess
import time

import pytest

DP = ("parallelism.nodes=2", "parallelism.tensor=1", "parallelism.data=8", "parallelism.expert=true")
# vLLM's CPU build serves DP across nodes but not expert parallelism across DP ranks (no
# all_gatherv for the MoE all2all): the serving rehearsals use DP without EP.
DP_DENSE = (*DP[:3], "parallelism.expert=false")
# A multi-node render refuses a shared cache claim without a storage class that is ReadWriteMany.
RWX = ("kubernetes.hf_cache_storage_class=nfs",)


# The rehearsal image, through the session fixture (tests/conftest.py `rehearsal_image`): it waits
# for scripts/test's background build, and under CI=true a missing image fails the test rather than
# skipping it. (A skip decided at collection skipped about ten real tests in CI when the image was
# not built yet.)
needs_image = pytest.mark.usefixtures("rehearsal_image")


def set_flags(*items: str) -> list[str]:
    return [word for item in items for word in ("--set", item)]


def leftovers() -> list[str]:
    found = []
    for listing in (["ps", "-aq"], ["network", "ls", "-q"], ["volume", "ls", "-q"]):
        done = subprocess.run(
            ["docker", *listing, "--filter", "label=io.m31ctl.rehearsal"], capture_output=True, text=True
        )
        found += done.stdout.split()
    return found


# How long a kept session's removal may keep finding what it removed (a busy Engine answers
# `docker rm -f` before the volume it held is free to go).
REMOVE_BOUND_S = 120.0
_LISTINGS = (
    (["ps", "-aq"], ["rm", "-f"]),
    (["network", "ls", "-q"], ["network", "rm"]),
    (["volume", "ls", "-q"], ["volume", "rm"]),
)


def remove_session(session: str) -> list[str]:
    """Remove what the rehearsal of `session` kept (--keep) and nothing else (another rehearsal on
    this host is not a test's to remove): containers, then networks, then volumes, again while
    something is left, within REMOVE_BOUND_S. What Docker said of anything still there at the
    end (empty when all is gone), so a failure names its cause instead of leaking into the next
    test's `leftovers()`."""
    if not session:
        return []
    deadline = time.monotonic() + REMOVE_BOUND_S
    while True:
        said: list[str] = []
        for listing, remove in _LISTINGS:
            found = subprocess.run(
                ["docker", *listing, "--filter", f"label=io.m31ctl.rehearsal={session}"],
                capture_output=True, text=True, check=False,
            ).stdout.split()  # fmt: skip
            if found:
                done = subprocess.run(
                    ["docker", *remove, *found], capture_output=True, text=True, check=False
                )
                said += [f"{' '.join(remove)} {' '.join(found)}: {done.stderr.strip() or 'listed again'}"]
        if not said or time.monotonic() > deadline:
            return said
        time.sleep(2)
