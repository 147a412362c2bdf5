"""Renders without the Hugging Face hub (issues 51, 53): `render` and `lock` never ask it and never
import huggingface_hub; a render pins the commit the lock, --revision or this machine's cache
names, else it names the revision and says, once, that the download resolves it at deploy time.
The last test proves with the real huggingface_hub that the engine, offline, then serves the
commit that download recorded (docs/decisions.md, "Renders without the hub")."""

from __future__ import annotations

import csv
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CLOSED_HUB, PINNED_COMMIT, ROOT, run_cli, run_cli_process
from tests.support.cli_json import data

REPO = "MiniMaxAI/MiniMax-M3.1-Flash"
OFFLINE = {"HF_ENDPOINT": CLOSED_HUB}
UNPINNED = "is not pinned to a commit"


def _cache(tmp_path: Path, refs: dict[str, str] | None = None) -> Path:
    """A Hugging Face cache (runtime.hf_cache) whose refs/ record `refs` for REPO."""
    cache = tmp_path / "hf"
    folder = cache / "hub" / f"models--{REPO.replace('/', '--')}" / "refs"
    folder.mkdir(parents=True)
    for revision, commit in (refs or {}).items():
        (folder / revision).parent.mkdir(parents=True, exist_ok=True)
        (folder / revision).write_text(commit)
    return cache


def _render(target: str, cache: Path, *args: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return run_cli(
        "render", "--target", target, "--hardware", "h200x8", "--set", f"runtime.hf_cache={cache}", *args,
        env={**OFFLINE, **(env or {})},
    )  # fmt: skip


def _warnings(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("m31ctl: warning:")]


@pytest.mark.parametrize("target", ["k8s", "compose", "script", "systemd"])
def test_a_render_with_no_hub_and_nothing_cached_names_the_revision_and_says_so_once(target, tmp_path):
    """The README's render on a machine without the hub: it succeeds, the files name `main` for
    the download and the engine (offline), and one warning says it is resolved at deploy time and
    how to pin it, advising neither a pull that cannot reach the hub nor a lock with no commit."""
    done = _render(target, _cache(tmp_path))
    assert done.returncode == 0, done.stderr
    (warning,) = _warnings(done.stderr)
    assert f"{REPO}@main {UNPINNED}" in warning and "at deploy time" in warning
    assert (
        "--revision COMMIT" in warning and "after `m31ctl pull` on a machine that reaches the hub" in warning
    )
    assert "Traceback" not in done.stderr
    words = [w for w in re.findall(r"[\w.@/=-]+", done.stdout) if w != "-"]
    revisions = {words[i + 1] for i, word in enumerate(words[:-1]) if word == "--revision"}
    assert revisions == {"main"} and "HF_HUB_OFFLINE" in done.stdout  # the engine's, served offline
    assert "models--MiniMaxAI--MiniMax-M3.1-Flash@main" in done.stdout  # the download's marker
    assert PINNED_COMMIT not in done.stdout


def test_monitoring_needs_no_commit(tmp_path):
    done = _render("monitoring", _cache(tmp_path))
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_a_render_pins_the_commit_this_machines_cache_recorded(tmp_path):
    """refs/<revision> as `m31ctl pull` or `hf download` wrote it, read with no network; a
    --revision that is a commit, and a lock's commit, pin without reading it."""
    tag = "b" * 40
    cache = _cache(tmp_path, {"main": PINNED_COMMIT + "\n", "v1.0": tag})
    done = _render("compose", cache)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert PINNED_COMMIT in done.stdout and "@main" not in done.stdout
    tagged = _render("compose", cache, "--revision", "v1.0")
    assert tagged.returncode == 0 and tag in tagged.stdout and PINNED_COMMIT not in tagged.stdout
    other = "c" * 40
    given = _render("compose", cache, "--revision", other)
    assert given.returncode == 0 and other in given.stdout and PINNED_COMMIT not in given.stdout
    # A ref that holds no commit (a torn write) is no record.
    (cache / "hub" / f"models--{REPO.replace('/', '--')}" / "refs" / "main").write_text("not a commit")
    torn = _render("compose", cache)
    assert torn.returncode == 0 and len(_warnings(torn.stderr)) == 1


def test_a_revision_that_is_no_ref_name_is_refused(tmp_path):
    for bad in ("../../etc", "-x", "a b", "$(id)"):
        done = _render("compose", _cache(tmp_path / bad.replace("/", "_")), "--revision", bad)
        assert done.returncode == 2 and "is not a branch, tag or commit name" in done.stderr, bad


def test_a_render_imports_no_hub_library(tmp_path):
    """Every target, in one fresh process, with nothing cached: huggingface_hub, httpx and requests
    are never imported (their import is most of what made render slower than a plain typer app)."""
    code = (
        "import json, sys\n"
        "from m31ctl.cli import main\n"
        "codes = [main(['render', '--target', t, '--hardware', 'h200x8', '--set', sys.argv[1], '-o', sys.argv[2] + t])"
        " for t in ('k8s', 'compose', 'script', 'systemd', 'monitoring')]\n"
        "loaded = sorted({m.split('.')[0] for m in sys.modules} & {'huggingface_hub', 'httpx', 'requests'})\n"
        "print(json.dumps([codes, loaded]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, f"runtime.hf_cache={_cache(tmp_path)}", str(tmp_path / "out-")],
        capture_output=True, text=True, cwd=ROOT, env={**os.environ, **OFFLINE}, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    codes, loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert codes == [0] * 5 and loaded == []


def test_lock_says_it_recorded_no_commit_and_how_to_record_one(tmp_path):
    """Exit 0 (a lock without the commit is still a lock of the plan and image), one warning that
    names why and the remedy; --json carries it. With refs/main cached: recorded, no warning."""
    empty = _cache(tmp_path / "empty")
    lock = tmp_path / "m31ctl.lock"
    args = ("lock", "--hardware", "h200x8", "--set", f"runtime.hf_cache={empty}", "-o", str(lock))
    done = run_cli(*args, env=OFFLINE)
    assert done.returncode == 0, done.stderr
    (warning,) = _warnings(done.stderr)
    assert (
        f"checkpoint commit not recorded: {REPO}@main is not in this machine's Hugging Face cache" in warning
    )
    assert "`m31ctl pull` then `m31ctl lock` records it" in warning
    assert json.loads(lock.read_text())["checkpoint"] == {"repo": REPO, "commit": None}
    assert data(run_cli(*args, "--json", env=OFFLINE).stdout)["warnings"] == [warning.split(": ", 2)[2]]
    # A render with that lock: the lock's missing commit is named, --locked of it is not advised.
    rendered = _render("k8s", empty, "--locked", str(lock))
    assert rendered.returncode == 0, rendered.stderr
    (unpinned,) = _warnings(rendered.stderr)
    assert f"{lock} records no checkpoint commit" in unpinned
    cached = _cache(tmp_path / "cached", {"main": PINNED_COMMIT})
    pinned = run_cli("lock", "--hardware", "h200x8", "--set", f"runtime.hf_cache={cached}", "-o", str(lock))
    assert pinned.returncode == 0 and _warnings(pinned.stderr) == [], pinned.stderr
    assert json.loads(lock.read_text())["checkpoint"]["commit"] == PINNED_COMMIT


def test_a_cache_home_that_is_a_file_does_not_stop_a_render(tmp_path):
    """XDG_CACHE_HOME and HF_HOME at a file: render reads neither (exit 0, no traceback, the one
    warning); `pull`, which needs them, says so in one line and exits 6 (HOST_PRECONDITION)."""
    cache_file = tmp_path / "not-a-dir"
    cache_file.write_text("")
    env = {**OFFLINE, "XDG_CACHE_HOME": str(cache_file), "HF_HOME": str(cache_file / "huggingface")}
    out = tmp_path / "deploy"
    sets = ("--hardware", "b300x4", "--set", f"runtime.hf_cache={_cache(tmp_path)}")
    done = run_cli_process("render", "--target", "k8s", *sets, "-o", str(out), env=env)
    assert done.returncode == 0, done.stderr
    assert len(_warnings(done.stderr)) == 1 and "Traceback" not in done.stderr
    assert (out / "k8s.yaml").is_file()
    pulled = run_cli_process("pull", *sets, env=env)
    assert pulled.returncode == 6, pulled.stderr
    (line,) = pulled.stderr.strip().splitlines()
    assert "Not a directory" in line and "point HF_HOME (or XDG_CACHE_HOME) at a directory" in line


def _mount_sources(argv: list[str]) -> list[str]:
    """The source of each --mount as the Docker CLI reads the record (CSV)."""
    sources = []
    for flag, value in itertools.pairwise(argv):
        if flag == "--mount":
            fields = dict(f.split("=", 1) for f in next(csv.reader([value])) if "=" in f)
            sources.append(fields["source"])
    return sources


STUB = """#!/usr/bin/env bash
if [ "$1" = container ]; then exit 1; fi
printf '%s\\0' "$@" >> "$STUB_ARGV"
"""


@pytest.mark.parametrize("hostile", [False, True])
def test_the_script_caches_in_the_home_of_whoever_runs_it(hostile, tmp_path):
    """The built-in ~/.cache/huggingface is expanded by the script's shell on the server, not
    written as the renderer's home; a home with a comma, a quote and a space stays one source."""
    renderer = tmp_path / "renderer-home"
    done = run_cli("render", "--target", "script", "--hardware", "h200x8", "--revision", PINNED_COMMIT,
                   env={**OFFLINE, "HOME": str(renderer)})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert str(renderer) not in done.stdout
    server = tmp_path / ('srv, "odd" home' if hostile else "server-home")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "docker").write_text(STUB)
    (bindir / "docker").chmod(0o755)
    (tmp_path / "run.sh").write_text(done.stdout)
    argv_file = tmp_path / "argv"
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "HOME": str(server), "STUB_ARGV": str(argv_file),
           "M31CTL_ENV_FILE": str(tmp_path / "absent.env")}  # fmt: skip
    subprocess.run(["bash", str(tmp_path / "run.sh")], check=True, env=env, capture_output=True, text=True)
    cache = server / ".cache" / "huggingface"
    assert cache.is_dir()  # the script made it, as the user who ran it
    argv = argv_file.read_bytes().decode().split("\0")
    assert _mount_sources(argv) == [str(cache), str(cache)]  # the download's and the engine's


def test_a_cache_the_plan_names_stays_as_named_in_the_script(tmp_path):
    done = run_cli("render", "--target", "script", "--hardware", "h200x8", "--revision", PINNED_COMMIT,
                   "--set", "runtime.hf_cache=/data/hf", env=OFFLINE)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "HF_CACHE=" not in done.stdout and "source=/data/hf,target=/root/.cache/huggingface" in done.stdout


@pytest.mark.vllm
def test_a_branch_downloaded_at_deploy_time_is_the_commit_the_offline_engine_resolves(vllm_py, tmp_path):
    """The rendered download of `main` against a hub stand-in, with the real huggingface_hub of the
    vLLM environment; the hub then moves main; a process with HF_HUB_OFFLINE=1 (the engine's
    environment) resolves `main` to the commit the download recorded, for the snapshot and for a
    file. The download's marker is named after main, and the next render here pins that commit."""
    from m31ctl.deployment import derive
    from m31ctl.hardware import simulated
    from m31ctl.plan import PlanRequest, resolve
    from m31ctl.render.download import download_step
    from m31ctl.revision import pin_checkpoint
    from tests.standin_hub import RepoFile, small_checkpoint, standin_hub

    hf = tmp_path / "hf"
    plan = resolve(PlanRequest(hardware=simulated("h200x8"), sets=(f"runtime.hf_cache={hf}",)))
    deployment, warning = pin_checkpoint(derive(plan), "k8s", None, "main")
    assert warning is not None and deployment.model.commit == "main"
    step = download_step(deployment, ())
    assert step is not None
    _python, _c, script, repo, revision, budget, marker, *skip = step.command
    assert (repo, revision) == (REPO, "main") and marker.endswith("@main")
    local_marker = hf / Path(marker).relative_to("/root/.cache/huggingface")
    download = [vllm_py, "-c", script, repo, revision, budget, str(local_marker), *skip]
    with standin_hub(small_checkpoint(REPO, shard_bytes=1 << 12)) as hub:
        first = hub.repo.commit
        env = {**os.environ, "HF_HOME": str(hf), "HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_TELEMETRY": "1"}
        done = subprocess.run(download, env=env, capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr
        assert local_marker.exists()
        assert f"is in the cache (commit {first})" in done.stdout  # the pod's log says what main was
        moved = hub.repo.commit_files({"config.json": RepoFile(b'{"moved": true}', False)})
        assert moved != first
    resolve_offline = (
        "import json, os\n"
        "from huggingface_hub import hf_hub_download, snapshot_download\n"
        f"snapshot = snapshot_download({REPO!r}, revision='main', ignore_patterns=['dspark/*'])\n"
        f"config = hf_hub_download({REPO!r}, 'config.json', revision='main')\n"
        "print(json.dumps([os.path.basename(snapshot), config]))\n"
    )
    offline_env = {**os.environ, "HF_HOME": str(hf), "HF_ENDPOINT": CLOSED_HUB, "HF_HUB_OFFLINE": "1"}
    served = subprocess.run([vllm_py, "-c", resolve_offline], env=offline_env, capture_output=True,
                            text=True, timeout=120, check=False)  # fmt: skip
    assert served.returncode == 0, served.stderr
    snapshot, config = json.loads(served.stdout.strip().splitlines()[-1])
    assert snapshot == first and f"/snapshots/{first}/config.json" in config
    again, warning = pin_checkpoint(derive(plan), "k8s", None, "main")
    assert again.model.commit == first and warning is None
