"""Every rendered file says the command that makes it again (issue 51): the plan's options as
asked, the host named so a GPU-less workstation needs no probe, the checkpoint's revision where
the target names it. Run as written, in the same folder, that command writes the same bytes."""

from __future__ import annotations

import re
import shlex

import pytest

from tests.conftest import PINNED_COMMIT, run_cli

_MADE_BY = re.compile(r"make it again with `([^`]+)`")


def _remade(tmp_path, target: str, *options: str) -> None:  # type: ignore[no-untyped-def]
    first = run_cli("render", "--target", target, *options, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    (command,) = set(_MADE_BY.findall(first.stdout))
    words = shlex.split(command)
    assert words[:4] == ["m31ctl", "render", "--target", target]
    again = run_cli(*words[1:], cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout


@pytest.mark.parametrize("target", ["k8s", "compose", "script", "systemd", "monitoring"])
def test_the_header_command_makes_the_same_files(tmp_path, target):
    (tmp_path / "site.yaml").write_text("serving:\n  max_model_len: 131072\n")
    _remade(
        tmp_path, target, "--hardware", "b300x4", "--profile", "throughput", "-f", "site.yaml",
        "--set", "runtime.port=9000", "--revision", PINNED_COMMIT,
    )  # fmt: skip


def test_a_prefill_decode_pair_and_an_unpinned_revision_are_made_again(tmp_path):
    _remade(tmp_path, "compose", "--hardware", "b300x8", "--set", "disaggregation.enabled=true")
