"""m31ctl pull against a stand-in hub on 127.0.0.1 (tests/standin_hub.py) with the real
huggingface_hub: the cache it lays out, progress, resume after a kill, Ctrl-C, the stall watchdog,
--verify, the disk check. No test reaches the real hub."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, last_json, run_cli
from standin_hub import StandinHub, small_checkpoint, standin_hub

from tests.support import cli_json

CANARY = "hf_PullCanaryToken0123456789abcdefgh"
SHARD = "model-00002-of-00003.safetensors"
MIB = 1 << 20


@pytest.fixture
def hub() -> Iterator[StandinHub]:
    # 4 MiB shards: more than the 1 MiB a transfer writes at a time, so a stop mid-file leaves bytes.
    with standin_hub(small_checkpoint(shard_bytes=4 * MIB)) as server:
        yield server


def _argv(hub: StandinHub, cache: Path, *extra: str, hardware: str = "b300x4") -> list[str]:
    return [
        "pull",
        "--hardware",
        hardware,
        "--set",
        f"model.path={hub.repo.repo_id}",
        "--set",
        f"runtime.hf_cache={cache}",
        *extra,
    ]


def _env(hub: StandinHub) -> dict[str, str]:
    return {"HF_ENDPOINT": hub.endpoint, "HF_TOKEN": CANARY}


def pull(
    hub: StandinHub, cache: Path, *extra: str, hardware: str = "b300x4"
) -> subprocess.CompletedProcess[str]:
    return run_cli(*_argv(hub, cache, *extra, hardware=hardware), env=_env(hub))


def events(stdout: str) -> list[dict[str, Any]]:
    return cli_json.stream(stdout)


def repo_dir(cache: Path, hub: StandinHub) -> Path:
    return cache / "hub" / f"models--{hub.repo.repo_id.replace('/', '--')}"


def test_pull_lays_out_the_cache_vllm_reads_and_a_second_run_fetches_nothing(hub, tmp_path):
    from huggingface_hub import snapshot_download

    cache = tmp_path / "hf"
    done = pull(hub, cache, "--json")
    assert done.returncode == 0, done.stderr
    stream = events(done.stdout)
    assert stream[0]["event"] == "started" and stream[-1]["event"] == "result"
    assert {e["event"] for e in stream} >= {"started", "progress", "file_done", "result"}
    result = stream[-1]
    commit = hub.repo.commit
    assert result["commit"] == commit and result["files_fetched"] == len(hub.repo.files)
    assert result["bytes_fetched"] == hub.repo.size()

    # The layout huggingface_hub writes and vLLM reads: blobs, a snapshot of links, refs/main.
    root = repo_dir(cache, hub)
    assert (root / "refs" / "main").read_text() == commit
    for name, f in hub.repo.files.items():
        link = root / "snapshots" / commit / name
        assert link.is_symlink() and link.resolve().parent == root / "blobs"
        assert link.read_bytes() == f.data
    # What an offline vLLM does for a repo id: huggingface_hub resolves refs/main to this snapshot.
    offline = snapshot_download(hub.repo.repo_id, cache_dir=cache / "hub", local_files_only=True)
    assert Path(offline) == root / "snapshots" / commit

    # The token went to the hub and never to the CDN, and nothing printed it.
    seen = {(server, auth) for server, auth in hub.authorization}
    assert ("hub", f"Bearer {CANARY}") in seen
    assert all(auth is None for server, auth in seen if server == "cdn")
    assert CANARY not in done.stdout + done.stderr

    hub.reset_counts()
    again = pull(hub, cache)
    assert again.returncode == 0, again.stderr
    assert f"commit {commit}" in again.stdout
    assert not hub.bytes_sent and not [r for r in hub.requests if r[0] == "GET"]


def test_a_plan_without_dspark_leaves_the_draft_out(hub, tmp_path):
    cache = tmp_path / "hf"
    done = pull(hub, cache, "--json", hardware="h200x8")  # the Hopper recipe disables DSpark
    assert done.returncode == 0, done.stderr
    snapshot = repo_dir(cache, hub) / "snapshots" / hub.repo.commit
    assert (snapshot / SHARD).is_file() and not (snapshot / "dspark").exists()
    assert last_json(done.stdout)["bytes_total"] == hub.repo.size() - hub.repo.size("dspark/")


def test_a_local_model_path_has_nothing_to_pull(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    done = run_cli("pull", "--hardware", "b300x4", "--set", f"model.path={model}")
    assert done.returncode == 0, done.stderr
    assert "nothing to pull" in done.stdout and str(model) in done.stdout


def test_a_disk_too_small_is_refused_before_the_first_byte(hub, tmp_path, monkeypatch):
    import m31ctl.pull.cache

    # The free-space seam: cache.free_bytes is the only place a pull asks the file system.
    monkeypatch.setattr(m31ctl.pull.cache, "free_bytes", lambda path: 5 * MIB)
    cache = tmp_path / "hf"
    done = pull(hub, cache, "--json")
    assert done.returncode == 6, done.stderr
    error = cli_json.error(done.stdout)  # the stream's last line: the error's envelope
    assert error["type"] == "HostPreconditionError" and error["exit_code"] == 6
    short = (hub.repo.size() - 5 * MIB) / 1e9
    assert f"short by {short:.1f} GB" in error["message"]
    assert not [r for r in hub.requests if r[0] == "GET"] and not hub.bytes_sent
    assert not (repo_dir(cache, hub) / "blobs").exists()


def _spawn(hub: StandinHub, cache: Path) -> subprocess.Popen[str]:
    env = {**os.environ, **_env(hub), "COLUMNS": "200"}
    return subprocess.Popen(
        [sys.executable, "-m", "m31ctl", *_argv(hub, cache, "--json")],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own group: the signal goes to it alone
        # Ctrl-C at a terminal: SIGINT at its default disposition. A test run started in the
        # background of a non-interactive shell (`bash .ci/run &`, nohup) ignores SIGINT and its
        # children inherit that: the pull would never see the interrupt (seen: exit 0, not 130).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _stop_mid_shard(
    hub: StandinHub, cache: Path, how: signal.Signals
) -> tuple[subprocess.Popen[str], dict[str, int]]:
    """Start a throttled pull in a process and stop it with `how` once 1.5 MiB of SHARD are on
    disk; the bytes of each file it left there. 1 MiB/s per response keeps every file partial for
    seconds (a file whole in its .incomplete at the stop but not yet moved into place would be
    neither complete nor partial to the resume's count), and SHARD's response also hangs after
    2 MiB (the stand-in's stall, once), so SHARD's stop lands mid-file however long the signal
    takes to act; the pull writes 1 MiB at a time."""
    hub.knobs.rate = 1 * MIB
    hub.knobs.stall_after[SHARD] = 2 * MIB
    hub.knobs.stalls_left = 1
    partial = repo_dir(cache, hub) / "blobs" / f"{hub.repo.files[SHARD].etag}.incomplete"
    process = _spawn(hub, cache)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        if partial.is_file() and partial.stat().st_size >= 1.5 * MIB:
            break
        time.sleep(0.01)
    assert process.poll() is None, process.communicate()
    process.send_signal(how)
    process.wait(timeout=60)
    hub.knobs.rate = None
    hub.knobs.stall_after.clear()
    hub.wait_idle()  # the killed transfer's last bytes are counted before the counts are reset
    return process, on_disk(hub, cache)


def on_disk(hub: StandinHub, cache: Path) -> dict[str, int]:
    """Bytes of each file the cache holds: whole (in the snapshot, or a blob not linked yet) or a
    partial file's. Files in one piece (the 4 MiB shards are below the size cut into ranges)."""
    blobs, held = repo_dir(cache, hub) / "blobs", {}
    for name, f in hub.repo.files.items():
        blob, partial = blobs / f.etag, blobs / f"{f.etag}.incomplete"
        held[name] = (
            blob.stat().st_size if blob.is_file() else partial.stat().st_size if partial.is_file() else 0
        )
    return held


def _resume_fetches_only_missing_bytes(hub: StandinHub, cache: Path, held: dict[str, int]) -> None:
    """The next pull asks for each file from the bytes on disk (transfers run in parallel: which
    files were complete, partial or untouched at the stop is whatever it was)."""
    sizes = {name: len(f.data) for name, f in hub.repo.files.items()}
    complete = {name for name in sizes if held[name] == sizes[name]}
    kept = sum(n for name, n in held.items() if name not in complete)
    hub.reset_counts()
    done = pull(hub, cache, "--json")
    assert done.returncode == 0, done.stderr
    stream = events(done.stdout)
    assert stream[0]["bytes_partial"] == kept
    assert stream[0]["files_cached"] + stream[0]["files_reused"] == len(complete)
    assert stream[-1]["bytes_resumed"] == kept
    # Only what was missing crossed the wire: each file from where it stopped, none twice.
    for name, size in sizes.items():
        assert hub.gets(name) == ([] if name in complete else [held[name]]), name
        assert hub.bytes_sent[name] == size - held[name], name
    assert (
        sum(hub.bytes_sent.values())
        == sum(sizes.values()) - sum(held.values())
        == stream[-1]["bytes_fetched"]
    )
    snapshot = repo_dir(cache, hub) / "snapshots" / hub.repo.commit
    assert all((snapshot / name).read_bytes() == f.data for name, f in hub.repo.files.items())


@pytest.mark.slow
def test_a_killed_pull_resumes_and_fetches_only_the_missing_bytes(hub, tmp_path):
    cache = tmp_path / "hf"
    process, held = _stop_mid_shard(hub, cache, signal.SIGKILL)
    assert process.returncode == -signal.SIGKILL
    assert 1.5 * MIB <= held[SHARD] < len(hub.repo.files[SHARD].data)
    _resume_fetches_only_missing_bytes(hub, cache, held)


@pytest.mark.slow
def test_ctrl_c_exits_130_and_the_next_pull_resumes(hub, tmp_path):
    cache = tmp_path / "hf"
    process, held = _stop_mid_shard(hub, cache, signal.SIGINT)
    _out, err = process.communicate()
    assert process.returncode == 130, err
    errors = [line for line in err.splitlines() if line.startswith("m31ctl: error:")]
    assert len(errors) == 1 and "interrupted" in errors[0] and "rerun m31ctl pull" in errors[0], err
    assert 1.5 * MIB <= held[SHARD] < len(hub.repo.files[SHARD].data)
    _resume_fetches_only_missing_bytes(hub, cache, held)


@pytest.mark.slow
def test_a_stall_is_retried_with_backoff_then_exit_5_naming_the_file_and_rate(hub, tmp_path):
    cache = tmp_path / "hf"
    hub.knobs.stall_after[SHARD] = int(1.5 * MIB)  # every response for SHARD hangs there
    done = pull(hub, cache, "--json", "--stall-timeout", "1", "--retries", "2")
    assert done.returncode == 5, done.stderr
    stream = events(done.stdout)
    retries = [e for e in stream if e["event"] == "retry"]
    assert [(e["file"], e["attempt"], e["backoff_s"], e["via"]) for e in retries] == [
        (SHARD, 1, 1.0, "http"),
        (SHARD, 2, 2.0, "http"),
    ]
    error = stream[-1]
    assert error["event"] == "error" and error["exit_code"] == 5
    assert SHARD in error["message"] and "last rate" in error["message"]
    # Each retry continued after the bytes kept: every byte before the stall reached the disk.
    kept = int(1.5 * MIB)
    assert hub.gets(SHARD) == [0, kept, kept]
    assert hub.bytes_sent[SHARD] == kept

    hub.knobs.stall_after.clear()
    hub.reset_counts()
    again = pull(hub, cache, "--json")
    assert again.returncode == 0, again.stderr
    assert hub.gets(SHARD) == [kept]
    assert hub.bytes_sent[SHARD] == len(hub.repo.files[SHARD].data) - kept


def test_a_single_stall_is_retried_and_the_pull_completes(hub, tmp_path):
    cache = tmp_path / "hf"
    hub.knobs.stall_after[SHARD] = int(1.5 * MIB)
    hub.knobs.stalls_left = 1
    done = pull(hub, cache, "--json", "--stall-timeout", "1", "--retries", "1")
    assert done.returncode == 0, done.stderr
    stream = events(done.stdout)
    assert [e["file"] for e in stream if e["event"] == "retry"] == [SHARD]
    assert hub.gets(SHARD) == [0, int(1.5 * MIB)]
    # Nothing crossed the wire twice: the retry asked for the bytes after those on disk.
    assert sum(hub.bytes_sent.values()) == stream[-1]["bytes_fetched"] == hub.repo.size()


def test_verify_names_a_corrupt_and_a_truncated_shard_and_fetches_them_again(hub, tmp_path):
    cache = tmp_path / "hf"
    assert pull(hub, cache).returncode == 0
    snapshot = repo_dir(cache, hub) / "snapshots" / hub.repo.commit
    corrupt, truncated = snapshot / SHARD, snapshot / "model-00003-of-00003.safetensors"
    with corrupt.resolve().open("r+b") as stream:  # one byte flipped, the size unchanged
        stream.seek(12345)
        byte = stream.read(1)
        stream.seek(12345)
        stream.write(bytes([byte[0] ^ 0xFF]))
    with truncated.resolve().open("r+b") as stream:
        stream.truncate(MIB)

    hub.reset_counts()
    done = pull(hub, cache, "--verify", "--json")
    assert done.returncode == 0, done.stderr
    stream = events(done.stdout)
    bad = {e["file"]: e["problem"] for e in stream if e["event"] == "corrupt"}
    assert set(bad) == {corrupt.name, truncated.name}
    assert "sha256" in bad[corrupt.name] and "truncated" in bad[truncated.name]
    assert stream[-1]["verified"] is True
    assert sorted(stream[-1]["refetched"]) == sorted(bad)
    assert {name for _method, name, _start in hub.requests if _method == "GET"} == set(bad)
    for name in bad:
        assert (snapshot / name).read_bytes() == hub.repo.files[name].data
    assert any(e["event"] == "progress" and e["phase"] == "verify" for e in stream)

    human = pull(hub, cache, "--verify")
    assert human.returncode == 0 and "verified: every file" in human.stdout


def test_a_revision_or_repo_the_hub_does_not_have_is_bad_input(hub, tmp_path):
    cache = tmp_path / "hf"
    done = pull(hub, cache, "--revision", "no-such-branch")
    assert done.returncode == 2 and "no revision no-such-branch" in done.stderr
    missing = run_cli(
        "pull", "--hardware", "b300x4", "--set", "model.path=nobody/nothing", "--set", f"runtime.hf_cache={cache}",
        env=_env(hub),
    )  # fmt: skip
    assert missing.returncode == 2 and "nobody/nothing is not on" in missing.stderr
    assert CANARY not in done.stderr + missing.stderr


def test_the_revision_is_pinned_to_the_commit_it_resolved_to(hub, tmp_path):
    cache = tmp_path / "hf"
    done = pull(hub, cache, "--revision", hub.repo.commit, "--json")
    assert done.returncode == 0, done.stderr
    assert last_json(done.stdout)["commit"] == hub.repo.commit
    assert not (repo_dir(cache, hub) / "refs").exists()  # a commit needs no ref


# --- the watchdog and the Xet fallback, with a transport standing in for the hub ---------------
class _XetThatStalls:
    """A hub whose Xet transfers never send a byte until aborted, and whose plain HTTP works."""

    xet_available = True

    def __init__(self, data: bytes, cache: Any) -> None:
        self.data, self.cache, self.aborted = data, cache, 0
        self._abort = threading.Event()
        self.linked: list[str] = []

    def locate(self, repo: str, commit: str, path: str) -> Any:
        from m31ctl.pull.records import Location

        return Location("http://cdn.invalid/blob", "e" * 64, len(self.data), xet=True)

    def fetch_xet(self, repo: str, commit: str, path: str, count: Any) -> None:
        from m31ctl.pull.hub import TransientError

        self._abort.wait(10)
        self._abort.clear()
        raise TransientError("aborted")

    def abort_xet(self) -> None:
        self.aborted += 1
        self._abort.set()

    def fetch_http(self, location: Any, sink: Any, first: int, end: int | None) -> None:
        sink.write(self.data[first:end])

    def link(self, blob: Path, pointer: Path) -> None:
        self.linked.append(pointer.name)


def test_xet_that_stalls_falls_back_to_plain_http(tmp_path):
    from m31ctl.pull.cache import RepoCache
    from m31ctl.pull.records import Listing, RepoFile
    from m31ctl.pull.transfer import Fetcher
    from m31ctl.pull.watch import Tally, Watch

    data = b"x" * 3000
    f = RepoFile("model.safetensors", len(data), "e" * 64, None)
    listing = Listing("org/name", "main", "c" * 40, (f,))
    cache = RepoCache(tmp_path, listing.repo)
    transport = _XetThatStalls(data, cache)
    seen: list[Any] = []
    fetcher = Fetcher(transport, cache, listing, Watch(0.3, 1), Tally(1, len(data)), seen.append, xet=True)
    done = fetcher.fetch(f)
    kinds = [type(e).__name__ for e in seen if type(e).__name__ != "Progress"]
    assert kinds == ["Retry", "Fallback", "FileDone"]
    assert done.via == "http" and transport.aborted == 2 and not fetcher.xet
    assert cache.blob("e" * 64).read_bytes() == data and transport.linked == [f.path]


# --- launch pulls first ---------------------------------------------------------------------------
def _deployment(hub: StandinHub, cache: Path, model: str | None = None) -> Any:
    from m31ctl.deployment import derive
    from m31ctl.hardware import simulated
    from m31ctl.plan import PlanRequest, resolve

    sets = (f"model.path={model or hub.repo.repo_id}", f"runtime.hf_cache={cache}")
    return derive(resolve(PlanRequest(simulated("b300x4"), sets=sets)))


def test_launch_pulls_first_and_then_runs_the_engine_offline(hub, tmp_path, monkeypatch):
    from m31ctl import deploy
    from m31ctl.cli import pulling
    from m31ctl.runtime.protocol import LaunchOptions

    started: list[dict[str, str]] = []

    class Runtime:  # the runtime seam: what the engine would be started with
        name, gates = "fake", ()

        def launch(self, deployment: Any, options: LaunchOptions) -> str:
            started.append(dict(options.environ))
            return "started"

        def engine_identity(self, deployment: Any) -> None:
            return None  # not named: the (stubbed) deep checks would run every time

    monkeypatch.setattr(deploy, "get_runtime", lambda name: Runtime())
    monkeypatch.setattr(deploy, "preflight", lambda *args, **kwargs: [])
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    options = LaunchOptions(report=lambda line: None, confirm=lambda question: False, environ={})
    cache = tmp_path / "hf"

    deploy.launch(_deployment(hub, cache), "fake", options, deep=False, fetch=pulling.before_launch(False))
    assert started[-1].get("HF_HUB_OFFLINE") == "1"
    assert (repo_dir(cache, hub) / "snapshots" / hub.repo.commit / SHARD).is_file()

    deploy.launch(_deployment(hub, cache), "fake", options, deep=False, fetch=None)  # --no-pull
    assert "HF_HUB_OFFLINE" not in started[-1]
    local = tmp_path / "model"
    local.mkdir()
    hub.reset_counts()
    deploy.launch(_deployment(hub, cache, str(local)), "fake", options, fetch=pulling.before_launch(False))
    assert "HF_HUB_OFFLINE" not in started[-1] and not hub.requests  # nothing to pull, nothing asked
