"""Blob-level reuse and partial files of either tool, against the stand-in hub with the real
huggingface_hub: a commit that changes one file fetches that file; a blob left by a kill between
its rename and its snapshot link is linked, not fetched; huggingface_hub's partial files left by a
killed snapshot_download are resumed (and hashed) or removed, and the result says which."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from standin_hub import RepoFile, StandinHub, small_checkpoint, standin_hub
from test_pull import MIB, SHARD, events, pull, repo_dir


@pytest.fixture
def hub() -> Iterator[StandinHub]:
    with standin_hub(small_checkpoint(shard_bytes=4 * MIB)) as server:
        yield server


def _gets(hub: StandinHub) -> list[str]:
    return sorted({name for method, name, _start in hub.requests if method == "GET"})


def test_a_commit_that_changes_only_config_json_fetches_only_that_file(hub, tmp_path):
    cache = tmp_path / "hf"
    first = pull(hub, cache, "--json")
    assert first.returncode == 0, first.stderr
    old = hub.repo.commit
    config = json.dumps(
        {"architectures": ["MiniMaxM3ForCausalLM"], "transformers_version": "4.99.0"}
    ).encode()
    new = hub.repo.commit_files({"config.json": RepoFile(config, False)})
    assert new != old

    hub.reset_counts()
    done = pull(hub, cache, "--json")
    assert done.returncode == 0, done.stderr
    stream = events(done.stdout)
    started, result = stream[0], stream[-1]
    others = len(hub.repo.files) - 1
    assert started["commit"] == new and started["files_cached"] == 0
    assert started["files_reused"] == others and started["bytes_reused"] == hub.repo.size() - len(config)
    assert started["bytes_needed"] == len(config)  # what the disk check weighed
    assert _gets(hub) == ["config.json"] and sum(hub.bytes_sent.values()) == len(config)
    assert result["files_fetched"] == 1 and result["bytes_fetched"] == len(config)
    assert result["files_reused"] == others
    root = repo_dir(cache, hub)
    for name, f in hub.repo.files.items():  # the new snapshot, whole, sharing the old one's blobs
        link = root / "snapshots" / new / name
        assert link.is_symlink() and link.read_bytes() == f.data
    assert (root / "snapshots" / old / "config.json").read_bytes() != config  # the old one intact
    assert (root / "refs" / "main").read_text() == new

    human = pull(hub, cache)
    assert human.returncode == 0 and "files were complete already" in human.stdout


def test_a_blob_left_by_a_kill_between_its_rename_and_its_link_is_linked_not_fetched(hub, tmp_path):
    """A kill there leaves, on disk: blobs/<etag> whole, no partial file (it was renamed), no
    snapshot link for that file, and no refs/main (written when every file is in). The files that
    finished before it are linked; here, every other file."""
    cache = tmp_path / "hf"
    assert pull(hub, cache).returncode == 0
    root, commit = repo_dir(cache, hub), hub.repo.commit
    (root / "snapshots" / commit / SHARD).unlink()
    (root / "refs" / "main").unlink()
    blob = root / "blobs" / hub.repo.files[SHARD].etag
    assert blob.is_file() and not list((root / "blobs").glob("*.incomplete*"))

    hub.reset_counts()
    done = pull(hub, cache, "--json")
    assert done.returncode == 0, done.stderr
    stream = events(done.stdout)
    assert stream[0]["files_reused"] == 1 and stream[0]["bytes_needed"] == 0
    assert stream[-1]["files_fetched"] == 0 and stream[-1]["bytes_fetched"] == 0
    assert not hub.requests and not hub.bytes_sent  # not a GET, not even a HEAD
    link = root / "snapshots" / commit / SHARD
    assert link.is_symlink() and link.resolve() == blob
    assert (root / "refs" / "main").read_text() == commit


def test_a_blob_at_the_wrong_size_is_named_and_fetched_again(hub, tmp_path):
    cache = tmp_path / "hf"
    assert pull(hub, cache).returncode == 0
    root, commit = repo_dir(cache, hub), hub.repo.commit
    (root / "snapshots" / commit / SHARD).unlink()
    with (root / "blobs" / hub.repo.files[SHARD].etag).open("r+b") as blob:
        blob.truncate(MIB)
    hub.reset_counts()
    done = pull(hub, cache, "--json")
    assert done.returncode == 0, done.stderr
    stream = events(done.stdout)
    assert [(e["file"], "truncated" in e["problem"]) for e in stream if e["event"] == "corrupt"] == [
        (SHARD, True)
    ]
    assert _gets(hub) == [SHARD]
    assert (root / "snapshots" / commit / SHARD).read_bytes() == hub.repo.files[SHARD].data


SNAPSHOT_DOWNLOAD = "import sys; from huggingface_hub import snapshot_download; snapshot_download(sys.argv[1], cache_dir=sys.argv[2])"


# huggingface_hub's http_get writes in chunks of this (constants.DOWNLOAD_CHUNK_SIZE): a partial
# file of its holds nothing until the first 10 MiB of the file have arrived.
HF_CHUNK = 10 * MIB


@pytest.fixture
def big_hub() -> Iterator[StandinHub]:
    with standin_hub(small_checkpoint(shard_bytes=24 * MIB)) as server:
        yield server


def _kill_snapshot_download(hub: StandinHub, cache: Path) -> dict[str, int]:
    """Run huggingface_hub's snapshot_download in a process, throttled, and SIGKILL it once its
    partial file of SHARD holds its first chunk: what a killed download leaves. 4 MiB/s per
    response: the first chunk lands after 2.5 s, the second 2.5 s later, so the kill lands
    between them. Each partial file's bytes."""
    hub.knobs.rate = 4 * MIB
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.endpoint,
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HOME": str(cache),
    }
    process = subprocess.Popen(
        [sys.executable, "-c", SNAPSHOT_DOWNLOAD, hub.repo.repo_id, str(cache / "hub")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    blobs = repo_dir(cache, hub) / "blobs"
    shard = hub.repo.files[SHARD].etag
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        if any(_size(p) >= HF_CHUNK for p in blobs.glob(f"{shard}.*.incomplete")):
            break
        time.sleep(0.01)
    assert process.poll() is None, process.communicate()
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    hub.knobs.rate = None
    hub.wait_idle()
    return {p.name: p.stat().st_size for p in blobs.glob("*.incomplete")}


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:  # renamed into place meanwhile
        return 0


@pytest.mark.slow
def test_partial_files_of_a_killed_snapshot_download_are_resumed_and_the_rest_removed(big_hub, tmp_path):
    hub, cache = big_hub, tmp_path / "hf"
    left = _kill_snapshot_download(hub, cache)
    blobs = repo_dir(cache, hub) / "blobs"
    by_etag = {f.etag: name for name, f in hub.repo.files.items()}
    # huggingface_hub 2.x's own name: <etag>.<8 hex>.incomplete, one per process and file.
    assert left and all(name.count(".") == 2 and name.split(".")[0] in by_etag for name in left)
    shard_partial = next(n for n in left if n.startswith(hub.repo.files[SHARD].etag))
    # A dead one of a blob this pull does not list, and one a live process holds (its lock taken).
    stale, live = blobs / f"{'d' * 64}.0badc0de.incomplete", blobs / f"{'e' * 64}.12345678.incomplete"
    stale.write_bytes(b"x" * 1000)
    live.write_bytes(b"y" * 1000)
    lock = cache / "hub" / ".locks" / repo_dir(cache, hub).name / f"{'e' * 64}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        hub.reset_counts()
        done = pull(hub, cache, "--json")
    assert done.returncode == 0, done.stderr
    stream = events(done.stdout)
    found = {p["name"]: p for p in stream[0]["partial_files"]}
    assert found == {p["name"]: p for p in stream[-1]["partial_files"]}
    assert found[shard_partial]["action"] == "resumed" and found[shard_partial]["tool"] == "huggingface_hub"
    assert found[shard_partial]["file"] == SHARD and found[shard_partial]["bytes"] == left[shard_partial]
    assert found[stale.name]["action"] == "removed" and found[stale.name]["file"] is None
    assert found[live.name]["action"] == "kept"
    # SHARD continued after huggingface_hub's bytes; every file right, hashed.
    assert hub.gets(SHARD) == [left[shard_partial]]
    assert hub.bytes_sent[SHARD] == len(hub.repo.files[SHARD].data) - left[shard_partial]
    snapshot = repo_dir(cache, hub) / "snapshots" / hub.repo.commit
    assert all((snapshot / name).read_bytes() == f.data for name, f in hub.repo.files.items())
    assert sorted(p.name for p in blobs.glob("*.incomplete*")) == [live.name]  # only the live one stays
    assert stream[-1]["bytes_resumed"] == sum(p["bytes"] for p in found.values() if p["action"] == "resumed")

    text = pull(hub, cache)
    assert text.returncode == 0, text.stderr


def test_a_partial_file_of_huggingface_hub_that_is_not_a_prefix_is_fetched_again(hub, tmp_path):
    """hf_xet may write out of order: adopted bytes are hashed once the file is complete."""
    cache = tmp_path / "hf"
    shard = hub.repo.files[SHARD]
    blobs = repo_dir(cache, hub) / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{shard.etag}.a1b2c3d4.incomplete").write_bytes(b"\0" * (2 * MIB))  # a hole, not the bytes
    done = pull(hub, cache, "--json")
    assert done.returncode == 0, done.stderr
    stream = events(done.stdout)
    bad = [e for e in stream if e["event"] == "corrupt"]
    assert [e["file"] for e in bad] == [SHARD] and "huggingface_hub's partial file" in bad[0]["problem"]
    assert hub.gets(SHARD) == [0, 2 * MIB]  # resumed after the adopted bytes, then again from 0
    assert (repo_dir(cache, hub) / "snapshots" / hub.repo.commit / SHARD).read_bytes() == shard.data
    assert not list(blobs.glob("*.incomplete*"))


def test_the_disk_check_weighs_only_what_is_missing(hub, tmp_path, monkeypatch):
    import m31ctl.pull.cache

    cache = tmp_path / "hf"
    assert pull(hub, cache).returncode == 0
    hub.repo.commit_files(
        {"config.json": RepoFile(b'{"architectures": ["MiniMaxM3ForCausalLM"], "v": 2}', False)}
    )
    monkeypatch.setattr(m31ctl.pull.cache, "free_bytes", lambda path: MIB)  # far less than the repo
    done = pull(hub, cache, "--json")
    assert done.returncode == 0, done.stderr
    assert events(done.stdout)[0]["bytes_needed"] == len(hub.repo.files["config.json"].data)


def test_snapshot_download_and_pull_lay_out_the_same_cache(hub, tmp_path):
    """The stand-in serves what snapshot_download lists (the tree endpoint) and fetches: both
    tools end with the same snapshot of links to the same blob names."""
    theirs, ours = tmp_path / "hf-hub", tmp_path / "hf-m31ctl"
    env = {
        **os.environ,
        "HF_ENDPOINT": hub.endpoint,
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "HF_HOME": str(theirs),
    }
    done = subprocess.run(
        [sys.executable, "-c", SNAPSHOT_DOWNLOAD, hub.repo.repo_id, str(theirs / "hub")],
        env=env, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    folder = repo_dir(theirs, hub) / "snapshots" / hub.repo.commit
    assert pull(hub, ours).returncode == 0

    def layout(root: Path) -> dict[str, str]:
        return {str(p.relative_to(root)): p.resolve().name for p in root.rglob("*") if p.is_symlink()}

    mine = repo_dir(ours, hub) / "snapshots" / hub.repo.commit
    assert layout(folder) == layout(mine) and len(layout(mine)) == len(hub.repo.files)
    assert (repo_dir(theirs, hub) / "refs" / "main").read_text() == (
        repo_dir(ours, hub) / "refs" / "main"
    ).read_text()


def test_two_files_of_the_same_bytes_are_fetched_once_and_both_linked(tmp_path):
    repo = small_checkpoint(shard_bytes=MIB)
    repo.files["copies/" + SHARD] = repo.files[SHARD]  # the same bytes at a second path: one blob
    with standin_hub(repo) as server:
        cache = tmp_path / "hf"
        done = pull(server, cache, "--json")
        assert done.returncode == 0, done.stderr
        stream = events(done.stdout)
        size = len(repo.files[SHARD].data)
        assert stream[0]["bytes_needed"] == repo.size() - size
        assert server.gets(SHARD) == [0] and stream[-1]["bytes_fetched"] == repo.size() - size
        assert {e["file"] for e in stream if e["event"] == "file_done"} == set(repo.files)
        snapshot = repo_dir(cache, server) / "snapshots" / repo.commit
        assert (snapshot / "copies" / SHARD).resolve() == (snapshot / SHARD).resolve()
        assert (snapshot / "copies" / SHARD).read_bytes() == repo.files[SHARD].data
