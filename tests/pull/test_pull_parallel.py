"""Parallel transfers against the stand-in hub with the real huggingface_hub: files and byte ranges
at once, within the bound on connections; a stop mid-ranges resumes each range exactly where its
bytes end; a server that ignores Range gets the file in one piece. The pull runs in this process
(m31ctl.pull.pull) so the range size can be small enough for 4 MiB shards."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from standin_hub import StandinHub, small_checkpoint, standin_hub
from test_pull import MIB, SHARD, _deployment, repo_dir

from m31ctl.pull import Progress, PullInterrupted, PullOptions, PullResult, pull


@pytest.fixture
def hub() -> Iterator[StandinHub]:
    with standin_hub(small_checkpoint(shard_bytes=4 * MIB)) as server:
        yield server


def _pull(hub: StandinHub, cache: Any, on_event: Any = None, **options: Any) -> tuple[PullResult, list[Any]]:
    seen: list[Any] = []

    def hear(event: Any) -> None:
        seen.append(event)
        if on_event is not None:
            on_event(event)

    opts = PullOptions(environ={"HF_ENDPOINT": hub.endpoint}, **options)
    return pull(_deployment(hub, cache), opts, hear), seen


def test_files_and_ranges_of_one_file_come_at_once_within_the_bound(hub, tmp_path):
    hub.knobs.gather = 4  # every body waits until 4 are being sent: a pull of one at a time never gets past
    result, seen = _pull(hub, tmp_path / "hf", connections=4, part_bytes=MIB)
    assert hub.most_sending == 4  # the bound held: never more bodies at once than connections
    shard = hub.repo.files[SHARD]
    starts = hub.gets(SHARD)
    assert len(starts) == 5 and starts[0] == 0  # 4 MiB + 2000 bytes: five ranges of about 0.8 MiB
    assert hub.bytes_sent[SHARD] == len(shard.data)  # each byte once
    assert sum(hub.bytes_sent.values()) == result.bytes_fetched == hub.repo.size()
    assert result.connections == 4
    done = {e.file: e for e in seen if e.kind == "file_done"}
    assert done[SHARD].parts == 5 and done["config.json"].parts == 1
    assert any(isinstance(e, Progress) and len(e.in_flight) > 1 for e in seen)
    snapshot = repo_dir(tmp_path / "hf", hub) / "snapshots" / hub.repo.commit
    assert all((snapshot / name).read_bytes() == f.data for name, f in hub.repo.files.items())
    assert not list((snapshot.parent.parent / "blobs").glob("*.incomplete*"))


def test_a_stop_mid_ranges_resumes_each_range_after_its_bytes(hub, tmp_path):
    cache = tmp_path / "hf"
    shard = hub.repo.files[SHARD]
    partial = repo_dir(cache, hub) / "blobs" / f"{shard.etag}.incomplete"
    record = partial.with_name(partial.name + ".parts")
    hub.knobs.rate = 1 * MIB  # every range takes a second at least: the stop lands mid-ranges

    def ctrl_c_once_bytes_are_there(event: Any) -> None:
        if (
            isinstance(event, Progress)
            and record.is_file()
            and partial.is_file()
            and partial.stat().st_size > MIB
        ):
            raise KeyboardInterrupt  # where Ctrl-C lands: in the watching thread

    with pytest.raises(PullInterrupted):
        _pull(hub, cache, ctrl_c_once_bytes_are_there, part_bytes=MIB)
    hub.knobs.rate = None
    hub.wait_idle()
    parts = json.loads(record.read_text())
    assert parts["size"] == len(shard.data) and len(parts["parts"]) == 5
    held = sum(done for _start, _end, done in parts["parts"])
    assert 0 < held < len(shard.data)
    with partial.open("rb") as stream:  # what the record counts is the file's bytes
        for start, _end, done in parts["parts"]:
            stream.seek(start)
            assert stream.read(done) == shard.data[start : start + done]

    hub.reset_counts()
    result, _seen = _pull(hub, cache, part_bytes=MIB)
    unfinished = [start + done for start, end, done in parts["parts"] if start + done < end]
    assert hub.gets(SHARD) == unfinished  # each range from where its bytes end, none from 0 again
    assert hub.bytes_sent[SHARD] == len(shard.data) - held
    assert result.bytes_resumed >= held
    assert (repo_dir(cache, hub) / "snapshots" / hub.repo.commit / SHARD).read_bytes() == shard.data
    assert not record.exists() and not partial.exists()


def test_a_server_that_ignores_range_gets_each_file_in_one_piece(hub, tmp_path):
    hub.knobs.ranges = False
    result, seen = _pull(hub, tmp_path / "hf", part_bytes=MIB)
    done = {e.file: e for e in seen if e.kind == "file_done"}
    assert done[SHARD].parts == 1
    snapshot = repo_dir(tmp_path / "hf", hub) / "snapshots" / hub.repo.commit
    assert all((snapshot / name).read_bytes() == f.data for name, f in hub.repo.files.items())
    assert result.files_fetched == len(hub.repo.files)


def test_a_stalled_range_is_retried_alone_while_the_others_finish(hub, tmp_path):
    hub.knobs.stall_after[SHARD] = 0  # the first response for SHARD, whichever range it is, hangs
    hub.knobs.stalls_left = 1
    result, seen = _pull(hub, tmp_path / "hf", part_bytes=MIB, stall_timeout_s=1.0, retries=1)
    retries = [e for e in seen if e.kind == "retry"]
    assert [(e.file, e.attempt) for e in retries] == [(SHARD, 1)]
    first, end = retries[0].byte_range
    assert 0 <= first < end <= len(hub.repo.files[SHARD].data) and end - first < MIB
    # The retry asked for that range again from its first byte; nothing crossed the wire twice.
    assert hub.gets(SHARD).count(first) == 2
    assert sum(hub.bytes_sent.values()) == result.bytes_fetched == hub.repo.size()
    snapshot = repo_dir(tmp_path / "hf", hub) / "snapshots" / hub.repo.commit
    assert (snapshot / SHARD).read_bytes() == hub.repo.files[SHARD].data


@pytest.mark.slow
def test_a_killed_pull_of_a_file_in_ranges_resumes_each_range_from_its_record(tmp_path):
    """A real SIGKILL mid-ranges (a 128 MiB file: two ranges of the default 64 MiB): the record
    may lag the bytes on disk by up to a second, never lead them; the next pull asks each range
    from what the record counts and fetches exactly the rest."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from standin_hub import Repo, RepoFile
    from test_pull import _argv, _env

    big = RepoFile(os.urandom(128 * MIB), True)
    config = RepoFile(json.dumps({"architectures": ["MiniMaxM3ForCausalLM"]}).encode(), False)
    with standin_hub(Repo("standin/one-big-file", {"config.json": config, "model.safetensors": big})) as hub:
        cache = tmp_path / "hf"
        record = repo_dir(cache, hub) / "blobs" / f"{big.etag}.incomplete.parts"
        hub.knobs.rate = 16 * MIB  # a range takes 4 s at least: the kill lands mid-ranges
        process = subprocess.Popen(
            [sys.executable, "-m", "m31ctl", *_argv(hub, cache, "--json")],
            env={**os.environ, **_env(hub)}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if sum(done for _s, _e, done in json.loads(record.read_text())["parts"]) >= 8 * MIB:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.01)
        assert process.poll() is None, process.communicate()
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
        hub.knobs.rate = None
        parts = json.loads(record.read_text())["parts"]  # as the kill left it
        assert len(parts) == 2
        held = sum(done for _start, _end, done in parts)
        assert 8 * MIB <= held < len(big.data)

        hub.reset_counts()
        result, _seen = _pull(hub, cache)
        assert hub.gets("model.safetensors") == [
            start + done for start, end, done in parts if start + done < end
        ]
        assert hub.bytes_sent["model.safetensors"] == len(big.data) - held
        assert result.bytes_resumed == held
        snapshot = repo_dir(cache, hub) / "snapshots" / hub.repo.commit
        assert (snapshot / "model.safetensors").read_bytes() == big.data


def test_a_resume_the_server_answers_with_the_whole_file_starts_over(hub, tmp_path):
    cache = tmp_path / "hf"
    shard = hub.repo.files[SHARD]
    blobs = repo_dir(cache, hub) / "blobs"
    blobs.mkdir(parents=True)
    (blobs / f"{shard.etag}.incomplete").write_bytes(shard.data[:MIB])  # an earlier run's bytes
    hub.knobs.ranges = False  # the resume's Range is answered 200, from byte 0
    result, seen = _pull(hub, cache)
    assert hub.gets(SHARD) == [0] and hub.bytes_sent[SHARD] == len(shard.data)
    done = {e.file: e for e in seen if e.kind == "file_done"}
    assert done[SHARD].resumed_from == 0 and result.bytes_resumed == 0
    assert (repo_dir(cache, hub) / "snapshots" / hub.repo.commit / SHARD).read_bytes() == shard.data
