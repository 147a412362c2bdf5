"""Every command README.md shows runs as written (issue 43, item 1), and so does every command
of the docs that took the README's user material (issue 51: guide, reference, operations,
development; tests/support/readme.py DOCUMENTS).

The commands are read from those files themselves (their ```console blocks' `$ ` lines and their
```bash blocks, continuation lines joined), so an edit is tested as it lands. Each runs through
bash, exactly as written, with `m31ctl` on PATH meaning this checkout's m31ctl, in a scratch
directory (scripts/ commands in the repository root). Quick ones run here; slow ones carry the
suite's markers. A command that cannot run as written is in ALLOW_LIST with the reason, skipped
with that reason printed: the list is what README still owes, and shrinks as README is fixed. A
command that a test of its own runs as written (read from its file here, run by
`run_as_written`), checking more than the exit code, is in RUN_ELSEWHERE: not run twice.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Iterator

import pytest

from tests.conftest import ROOT
from tests.support.readme import (
    DOCUMENTS,
    README,
    Command,
    documented_commands,
    readme_command,
    readme_commands,
    run_as_written,
)

# Commands that cannot run as README writes them, by how they start, and why. Each is skipped
# with its reason printed; fix README (the corrected command is in the reason) and remove it here.
ALLOW_LIST = {
    "scripts/test": "the whole suite, which runs this test: not run from inside itself",
    "m31ctl bench --concurrency": "measures a running server (launch one first); tests/served/test_bench_vllm.py "
    "runs bench against the CPU rehearsal",
    "m31ctl plan -f measured.yaml": "reads measured.yaml, which the bench example before it writes",
    "m31ctl launch -f measured.yaml": "serves the bench example's measured.yaml on the GPU host it measured",
}
# Commands a test of their own runs exactly as README writes them (readme_command, run_as_written),
# with the checks of what they print: here they would run a second time, minutes of CI for nothing.
RUN_ELSEWHERE = {
    "m31ctl rehearse --hardware b300x4 --set parallelism.nodes=2": (
        "tests/rehearsal/test_rehearse_layouts.py::test_two_node_dp_rehearsal_serves"
    ),
    # On the server that test launched with the same plan: one vLLM start in Docker for both.
    "scripts/rehearse --docker": "tests/rehearsal/test_rehearsal.py::test_container_launch_smoke_stop",
}
# Slow ones: the suite's markers (pyproject.toml), as the tests that run the same things carry.
# Each is bounded by run_as_written's 1,800 s, and pytest-timeout's mark lets it get there; those
# marked docker run the rehearsal image and wait for it (tests/conftest.py `rehearsal_image`).
_REAL = (pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(1900))
SLOW = {
    "scripts/rehearse --docker": (*_REAL, pytest.mark.docker),
    "scripts/rehearse": _REAL,
    "m31ctl rehearse": (*_REAL, pytest.mark.docker),
}
# Commands that download the checkpoint: against the stand-in hub, into a scratch home.
PULLS = ("m31ctl pull",)


def _allowed(command: str) -> str | None:
    why = next((why for start, why in ALLOW_LIST.items() if command.startswith(start)), None)
    elsewhere = next((test for start, test in RUN_ELSEWHERE.items() if command.startswith(start)), None)
    return why or (elsewhere and f"run as written by {elsewhere}")


def _params() -> list[object]:
    params = []
    for command in documented_commands():
        marks = next((m for start, m in SLOW.items() if command.text.startswith(start)), ())
        where = f"{command.source}:{command.line}"
        params.append(pytest.param(command, marks=marks, id=f"{where}:{command.text[:60]}"))
    return params


@pytest.fixture(scope="module")
def checkpoint_hub() -> Iterator[str]:
    from tests.standin_hub import small_checkpoint, standin_hub

    with standin_hub(small_checkpoint("MiniMaxAI/MiniMax-M3.1-Flash", shard_bytes=1 << 16)) as hub:
        yield hub.endpoint


@pytest.mark.parametrize("command", _params())
def test_readme_command_runs_as_written(command: Command, tmp_path, request):
    why = _allowed(command.text)
    if why is not None:
        print(f"{command.source}:{command.line}: skipped: {command.text}\n  because {why}")
        pytest.skip(f"{command.source}:{command.line}: {why}")
    if "docker" in request.keywords and "vllm" in request.keywords:
        request.getfixturevalue("rehearsal_image")  # the rehearsal image's commands wait for it
    env: dict[str, str] = {}
    if command.text.startswith(PULLS):
        env |= {"HF_ENDPOINT": request.getfixturevalue("checkpoint_hub"), "HOME": str(tmp_path)}
    done = run_as_written(command, tmp_path, env)
    assert done.returncode == 0, (
        f"{command.source}:{command.line}: {command.text}\nexit {done.returncode}\n{done.stderr[-3000:]}"
    )


def test_the_reader_finds_the_commands_it_should():
    """The reader itself: console prompts, bash lines, continuations, comments."""
    text = (
        "```console\n$ m31ctl plan --x \\\n    --y   # why\nsome output\n```\n"
        "```bash\nscripts/demo     # note\n# a comment\n```\n```yaml\nnot: a command\n```\n"
    )
    assert [c.text for c in readme_commands(text)] == ["m31ctl plan --x --y", "scripts/demo"]


def test_every_allow_list_entry_still_names_a_readme_command():
    """An entry whose command README and the docs no longer show is stale: drop it."""
    shown = [c.text for c in documented_commands()]
    listed = [*ALLOW_LIST, *RUN_ELSEWHERE]
    assert [start for start in listed if not any(c.startswith(start) for c in shown)] == []


def test_a_command_run_elsewhere_is_read_from_readme_and_run_as_written_there():
    """The test named in RUN_ELSEWHERE exists, takes its command from README.md (readme_command,
    the entry's own words) and runs it with run_as_written: README's text is what it proves."""
    for start, where in RUN_ELSEWHERE.items():
        path, name = where.split("::")
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        body = inspect.getsource(getattr(module, name))
        assert "run_as_written(" in body, where
        constant = re.search(r"readme_command\((\w+)\)", body)
        assert constant and getattr(module, constant.group(1)) == start, where
        readme_command(start)  # README or a doc shows it once


def test_the_readme_links_every_document_whose_commands_run():
    """The docs whose examples run here are the ones README sends a reader to, and the guide's
    examples are found: a doc dropped from README, or a reader that misses its blocks, would drop
    their coverage silently."""
    readme = README.read_text()
    for path in DOCUMENTS[1:]:
        assert f"]({path.relative_to(ROOT)}" in readme, path
    assert {c.source for c in documented_commands()} >= {"README.md", "docs/guide.md"}


def test_the_readme_is_a_front_door():
    """Issue 51: under 250 lines, none a reader at 80 columns scrolls sideways (a URL excepted),
    the two set-up commands and CI's test command (.ci/run runs exactly `scripts/test`)."""
    lines = README.read_text().splitlines()
    assert len(lines) < 250
    assert [n for n, line in enumerate(lines, 1) if len(line) > 80 and "://" not in line] == []
    shown = [c.text for c in readme_commands(README.read_text())]
    assert "scripts/demo" in shown and "scripts/test" in shown
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("exec scripts/test")
