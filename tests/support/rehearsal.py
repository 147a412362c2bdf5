"""The rehearsal's layouts and its Docker side, for the tests that rehearse a plan (`m31ctl
rehearse`) or need the rehearsal image: the dense DP layout over two nodes the serving
rehearsals use, the settings as `--set` arguments, whether Docker and the image are there, and
what a rehearsal left behind."""

from __future__ import annotations

import subprocess

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
