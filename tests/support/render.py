"""What the render tests share: a served name hostile to every quoting layer, the tools that
check a rendered file (from .venv's bin/ first), the words systemd makes of an Exec line, and the
two prefill/decode plans with their deployments and rendered files (the goldens under
REFERENCE)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from m31ctl.deployment import Deployment, derive
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.render import Artifact, get_target
from tests.conftest import PINNED_COMMIT

REFERENCE = Path(__file__).parent.parent / "reference_files" / "render"
HOSTILE = 'x\'; rm -rf / $(touch /tmp/pwned) `id` "q" \\ \nnext line'
VENV_BIN = Path(sys.executable).parent


def tool(name: str) -> str:
    path = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if path is None:
        pytest.fail(f"{name} is not installed; scripts/bootstrap installs it")
    return path


def unit_lines(unit: str) -> list[str]:
    """A unit file's lines as systemd reads them: a line ending in a backslash is joined with
    the next, the backslash read as a space (systemd.syntax(7)); the Exec lines are folded so."""
    lines: list[str] = []
    pending = ""
    for line in unit.splitlines():
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    return lines + ([pending] if pending else [])


def shlex_split_systemd(line: str) -> list[str]:
    """The words systemd makes of an Exec line: quotes removed, C escapes read (`\\n` is a line
    break), `$$` a literal `$`, `%%` a literal `%` (systemd.service, "Command lines")."""
    words: list[str] = []
    word: list[str] | None = None
    quote = ""
    escapes = {"n": "\n", "t": "\t", "\\": "\\", '"': '"', "'": "'", "s": " "}
    i = 0
    while i < len(line):
        c = line[i]
        if c == "\\" and i + 1 < len(line):
            word = (word or []) + [escapes.get(line[i + 1], line[i + 1])]
            i += 2
            continue
        if quote and c == quote:
            quote = ""
        elif not quote and c in "\"'":
            quote, word = c, word or []
        elif not quote and c == " ":
            if word is not None:
                words.append("".join(word))
            word = None
        else:
            word = (word or []) + [c]
        i += 1
    if word is not None:
        words.append("".join(word))
    return [w.replace("$$", "$").replace("%%", "%") for w in words]


# The two P/D plans the brief names: the CPU rehearsal's pd variant, and B300x8 split 4 + 4; and
# that pair over an RDMA fabric (fabric.rdma, issue 49), whose pods need the privileged level.
RDMA = ('fabric.rdma.devices=["mlx5_0:1","mlx5_1:1"]', "kubernetes.pod_security=privileged")
PLANS = {
    "pd-cpu": ("cpu", {"variant": "pd"}),
    "pd-b300x8": ("b300x8", {"sets": ("disaggregation.enabled=true",)}),
    "pd-b300x8-rdma": ("b300x8", {"sets": ("disaggregation.enabled=true", *RDMA)}),
}


def pd_plan(key: str, extra: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    hw, kw = PLANS[key]
    sets = (*kw.get("sets", ()), *extra)
    return resolve(PlanRequest(hardware=simulated(hw), variant=kw.get("variant"), sets=sets))


def pd_deployment(key: str, extra: tuple[str, ...] = ()) -> Deployment:
    return derive(pd_plan(key, extra), commit=PINNED_COMMIT)


def render(key: str, target: str, extra: tuple[str, ...] = ()) -> list[Artifact]:
    return get_target(target)(pd_deployment(key, extra))
