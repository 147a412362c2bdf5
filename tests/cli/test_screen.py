"""Screens that fit 80 columns and up (issue 51): every table of the README's path, rendered by the
real commands at COLUMNS=80 and 100, has no line wider than the screen, and every setting name,
`file:line` source, report name, date and command in it stands whole on one line, so it can be
read and copied; a command line broken over lines still pastes as the same command. Piped with
COLUMNS unset, as machine readers and logs get it, the output is laid out as before."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from m31ctl.cli.screen import command_lines, phrases, wrap
from tests.conftest import FIXTURES, ROOT, run_cli
from tests.support import cli_json
from tests.support.terminal import on_a_terminal

WIDTHS = (80, 100)
FILE_LINE = re.compile(r"[\w./-]+\.ya?ml:\d+")
REPORTS = (
    FIXTURES / "bench" / "report-max-num-seqs-1.json",
    FIXTURES / "bench" / "report-max-num-seqs-4.json",
)


def _shown(width: int, *argv: str) -> str:
    result = run_cli(*argv, env={"COLUMNS": str(width)})
    assert result.returncode in (0, 1), result.stderr  # doctor exits 1 where a check fails
    return result.stdout


def _one_argument(line: str) -> bool:
    """One shell argument (an option and its value) wider than any screen has a line to itself."""
    try:
        words = shlex.split(line.strip().removesuffix(" \\"))
    except ValueError:
        return False
    return len(words) == 1 or (len(words) == 2 and words[0].startswith("-"))


def _assert_fits(text: str, width: int) -> None:
    wide = [line for line in text.splitlines() if len(line) > width and not _one_argument(line)]
    assert wide == [], "\n".join(wide)


def _assert_whole(text: str, things: set[str]) -> None:
    """Each of `things` on one line, not glued to more of a name (cache.kv_dtype is not
    cache.kv_dtype_x)."""
    lines = text.splitlines()
    broken = {
        thing
        for thing in things
        if not any(re.search(rf"(?<![\w.-]){re.escape(thing)}(?![\w-])", line) for line in lines)
    }
    assert broken == set(), (broken, text)


def _value(settings: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        settings = settings[part]
    return settings


def _command(text: str, first: str) -> list[str]:
    """The command whose first line holds `first`, its continuation lines joined as the shell
    joins them (a backslash before the newline), split into its words."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if first in line)
    taken = [lines[start]]
    while taken[-1].endswith(" \\"):
        taken[-1] = taken[-1][:-2]
        taken.append(lines[start + len(taken)])
    return shlex.split(" ".join(taken))


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("explain", [True, False], ids=["explain", "plan"])
def test_plan_keeps_each_setting_source_and_the_command_whole(width, explain):
    plan = cli_json.data(run_cli("plan", "--hardware", "b300x4", "--json").stdout)
    text = _shown(width, "plan", "--hardware", "b300x4", *(["--explain"] if explain else []))
    _assert_fits(text, width)
    shown = [
        key for key in plan["provenance"] if explain or _value(plan["settings"], key) not in (None, [], {})
    ]
    sources = {found for source in plan["provenance"].values() for found in FILE_LINE.findall(source)}
    assert len(shown) > 20
    _assert_whole(text, set(shown) | (sources if explain else set()))
    if explain:
        assert sources and all(source in text for source in sources)
    env = [f"{key}={value}" for key, value in plan["env"].items()]
    command = _command(text, "vllm serve")
    assert sorted(command[: len(env)]) == sorted(env)
    assert command[len(env) :] == ["vllm", "serve", *plan["argv"]]
    for word in plan["argv"]:
        assert any(shlex.quote(word) in line for line in text.splitlines()), word


@pytest.mark.parametrize("width", WIDTHS)
def test_doctor_keeps_each_command_of_a_remedy_whole(width):
    report = cli_json.data(run_cli("doctor", "--hardware", "b300x4", "--json").stdout)
    text = _shown(width, "doctor", "--hardware", "b300x4")
    _assert_fits(text, width)
    remedies = " ".join(check["remedy"] for check in report["checks"])
    commands = set(
        re.findall(r"`[^`]+`|\(--set [^)]+\)|--set \S+|\((?:systemctl|nvidia-smi)[^)]*\)", remedies)
    )
    assert commands, remedies  # the b300x4 plan on a host without its GPUs has remedies to give
    lines = text.splitlines()
    assert all(any(command in line for line in lines) for command in commands), (commands, text)


@pytest.mark.parametrize("width", WIDTHS)
def test_capacity_keeps_each_model_and_layout_name_whole(width):
    found = cli_json.data(run_cli("capacity", "--hardware", "b300x4", "--json").stdout)
    text = _shown(width, "capacity", "--hardware", "b300x4")
    _assert_fits(text, width)
    _assert_whole(text, {row["model"] for row in found["comparison"]})
    _assert_whole(text, {"recipes/models.yaml"})


@pytest.mark.parametrize("width", WIDTHS)
def test_bench_compare_keeps_report_names_images_and_dates_whole(width):
    found = cli_json.data(run_cli("bench", "compare", *map(str, REPORTS), "--json").stdout)
    text = _shown(width, "bench", "compare", *map(str, REPORTS))
    _assert_fits(text, width)
    reports = found["reports"]
    whole = (
        {r["report"] for r in reports} | {r["image"] for r in reports} | {r["measured_at"] for r in reports}
    )
    _assert_whole(text, {str(thing) for thing in whole if thing})


def test_a_pipe_without_columns_keeps_the_command_on_one_line():
    """Machine readers and logs: no COLUMNS, no terminal, the layout of before (one line a
    command, whatever its length)."""
    env = {key: value for key, value in os.environ.items() if key != "COLUMNS"}
    done = subprocess.run(
        [sys.executable, "-m", "m31ctl", "plan", "--hardware", "b300x4"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120, check=False,
    )  # fmt: skip
    plan = cli_json.data(run_cli("plan", "--hardware", "b300x4", "--json").stdout)
    (line,) = [line for line in done.stdout.splitlines() if "vllm serve" in line]
    assert line.endswith(shlex.join(["vllm", "serve", *plan["argv"]])) and not line.endswith("\\")


def _on_a_terminal(argv: list[str], stream: str, cwd: Path = ROOT) -> tuple[int, str]:
    """m31ctl with its `stream` on an 80-column pty and COLUMNS unset."""
    env = {key: value for key, value in os.environ.items() if key != "COLUMNS"}
    return on_a_terminal(argv, stream, 80, cwd=cwd, env=env)


def test_a_terminal_of_80_columns_is_measured_without_columns():
    """On a terminal the width is the terminal's own: COLUMNS is a shell variable a shell does not
    export."""
    code, text = _on_a_terminal(["plan", "--hardware", "b300x4", "--explain"], "stdout")
    assert code == 0 and "cache.block_size" in text
    _assert_fits(text, 80)
    assert any(line.endswith(" \\") for line in text.splitlines())  # the command, broken to fit


def test_a_warning_on_a_terminal_wraps_between_phrases(tmp_path):
    """render's warning of an unpinned checkpoint (several hundred characters) on an 80-column
    terminal: wrapped, `m31ctl lock` and --revision COMMIT whole (the terminal cut "th" / "is")."""
    argv = ["render", "--target", "k8s", "--hardware", "h200x8", "-o", str(tmp_path / "deploy")]
    code, text = _on_a_terminal(argv, "stderr", cwd=tmp_path)
    warning = [line for line in text.split("m31ctl: ") if line.startswith("warning:")]
    if not warning:
        pytest.skip("the checkpoint is pinned on this machine: no warning to wrap")
    lines = text.strip("\n").splitlines()
    # "written: PATH" is one path, as long as the test's temporary directory makes it.
    assert code == 0 and all(len(line) <= 80 for line in lines if not line.startswith("written: ")), text
    assert any("--revision COMMIT" in line for line in lines), text
    assert any("`m31ctl lock`" in line for line in lines), text


def test_phrases_keep_what_is_read_or_copied_together():
    assert phrases("start the daemon (systemctl start docker) or set DOCKER_HOST") == [
        *("start", "the", "daemon", "(systemctl start docker)", "or", "set", "DOCKER_HOST"),
    ]
    assert phrases("lower --set runtime.shm_size") == ["lower", "--set runtime.shm_size"]
    assert phrases("pass --hardware to plan") == ["pass", "--hardware", "to", "plan"]  # an English word
    assert phrases("run `m31ctl lock` then --locked FILE") == [
        "run",
        "`m31ctl lock`",
        "then",
        "--locked FILE",
    ]
    assert phrases("248.2 (-72%) / 5 (+1%)") == ["248.2 (-72%)", "/", "5 (+1%)"]
    # A long bracketed aside is prose, broken between its words.
    assert "(main" in phrases("(main attention 8,640 + indexer 4,320), 3.40 GB")


def test_wrap_breaks_only_between_phrases_and_indents_what_follows():
    text = (
        "warning: engine.image is a tag: `m31ctl lock` records its digest (--set engine.image=NAME@sha256:D)"
    )
    lines = wrap(text, 30)
    assert all(len(line) <= 30 for line in lines[:-1]) and all(line.startswith("  ") for line in lines[1:])
    assert " ".join(line.strip() for line in lines) == text
    assert any("`m31ctl lock`" in line for line in lines)


def test_a_command_breaks_between_arguments_and_pastes_as_one():
    words = ["A=1", "vllm", "serve", "M", "--max-model-len", "262144", "--attention-config", "'{\"a\":1}'"]
    lines = command_lines(words, 30)
    assert all(line.endswith(" \\") for line in lines[:-1]) and not lines[-1].endswith("\\")
    assert "--max-model-len 262144" in "\n".join(lines)  # an option stays with its value
    joined = " ".join(line.removesuffix(" \\") for line in lines)
    assert shlex.split(joined) == shlex.split(" ".join(words))
