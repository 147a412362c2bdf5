"""The rehearsal's layouts and its Docker side, for the tests that rehearse a plan (`m31ctl
rehearse`) or need the rehearsal image: the dense DP layout over two nodes the serving
rehearsals use, the settings as `--set` arguments, whether Docker and the image are there, and
what a rehearsal left behind."""

from __future__ import annotations

import subprocess

import pytest

from m31ctl.rehearsal.runner import BASE_IMAGE

DP = ("parallelism.nodes=2", "parallelism.tensor=1", "parallelism.data=8", "parallelism.expert=true")
# vLLM's CPU build serves DP across nodes but not expert parallelism across DP ranks (no
# all_gatherv for the MoE all2all): the serving rehearsals use DP without EP.
DP_DENSE = (*DP[:3], "parallelism.expert=false")
# A multi-node render refuses a shared cache claim without a storage class that is ReadWriteMany.
RWX = ("kubernetes.hf_cache_storage_class=nfs",)


def docker_ready() -> bool:
    try:
        done = subprocess.run(["docker", "image", "inspect", BASE_IMAGE], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


needs_image = pytest.mark.skipif(not docker_ready(), reason=f"needs Docker and {BASE_IMAGE}")


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
