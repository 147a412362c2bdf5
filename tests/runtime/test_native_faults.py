"""The native runtime when things go wrong around it: a record that cannot prove its pid, a state
directory that is not one, a full disk at the moment of recording, an interrupt at the worst
moment, and six launches of one name at once. The engine is the stand-in server
(tests/standin_vllm), found as `python -m vllm.entrypoints.openai.api_server` through PYTHONPATH."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import last_json, run_cli
from tests.support import cli_json
from tests.support.native import Native, gone, group


@pytest.fixture
def native(tmp_path):
    server = Native(tmp_path)
    yield server
    if server.state.is_dir():
        run_cli("stop", "--runtime", "native", env=server.env)
    for pid in server.engines():  # whatever a failing test left
        os.kill(pid, signal.SIGKILL)


# (a) stop never signals a pid it cannot confirm.


@pytest.mark.parametrize("identity", [None, "boot-and-start-only"])
def test_stop_never_signals_an_unconfirmed_pid(tmp_path, identity):
    """A record without the full identity (no /proc when it was written, an older m31ctl, a record
    written by hand) names a live pid: the old code sent it SIGTERM and SIGKILL. Now status calls
    it unconfirmed, stop signals nothing, keeps the record and says how to remove it (exit 4)."""
    from m31ctl.runtime.native_state import process_identity

    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        if identity is not None:
            boot, start, _command = str(process_identity(bystander.pid)).split(":")
            identity = f"{boot}:{start}"
        directory = tmp_path / "state" / "native"
        directory.mkdir(parents=True)
        record = {
            "name": "m31ctl-unsure", "pid": bystander.pid, "plan_hash": "abc", "recipe": "cpu",
            "variant": "rehearsal", "profile": "latency", "bind": "127.0.0.1", "port": 9,
            "log": str(tmp_path / "log"), "argv": ["x"], "started_at": time.time(), "stop_timeout": 1,
            "identity": identity,
        }  # fmt: skip
        (directory / "m31ctl-unsure.json").write_text(json.dumps(record))
        env = {"M31CTL_STATE_DIR": str(tmp_path / "state")}
        status = cli_json.data(run_cli("status", "--runtime", "native", "--json", env=env).stdout)
        assert [(s["name"], s["state"]) for s in status["servers"]] == [("m31ctl-unsure", "unconfirmed")]
        stopped = run_cli("stop", "--runtime", "native", "--name", "m31ctl-unsure", env=env)
        time.sleep(0.3)
        assert bystander.poll() is None, "stop signalled a process it could not confirm"
        assert stopped.returncode == 4, stopped.stderr
        assert "cannot be confirmed" in stopped.stderr and "not signalled" in stopped.stderr
        assert f"rm {directory / 'm31ctl-unsure.json'}" in stopped.stderr
        assert (directory / "m31ctl-unsure.json").exists()
    finally:
        bystander.kill()
        bystander.wait()


def test_a_confirmed_server_is_stopped_and_its_identity_includes_the_command_line(native):
    launched = run_cli(*native.args("--json"), env=native.env)
    assert launched.returncode == 0, launched.stderr
    record = json.loads(native.record.read_text())
    boot, start, command = record["identity"].split(":")
    cmdline = Path(f"/proc/{record['pid']}/cmdline").read_bytes()
    import hashlib

    assert command == hashlib.sha256(cmdline).hexdigest() and boot and start.isdigit()
    assert json.loads(record["plan"])["plan_hash"] == last_json(launched.stdout)["plan_hash"]
    stopped = run_cli("stop", "--name", native.name, "--json", env=native.env)
    assert stopped.returncode == 0, stopped.stderr
    assert gone(record["pid"]) and not native.record.exists()


def test_stop_all_stops_ours_and_reports_the_stale_record(native):
    """Without a name, an unconfirmed record does not keep the servers m31ctl can confirm running."""
    launched = run_cli(*native.args(), env=native.env)
    assert launched.returncode == 0, launched.stderr
    [engine] = native.engines()
    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        stale = json.loads(native.record.read_text())
        stale.update(name="m31ctl-stale-one", pid=bystander.pid, identity=None)
        (native.state / "native" / "m31ctl-stale-one.json").write_text(json.dumps(stale))
        stopped = run_cli("stop", "--runtime", "native", env=native.env)
        assert stopped.returncode == 4 and "m31ctl-stale-one" in stopped.stderr, stopped.stderr
        assert gone(engine) and not native.record.exists()
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        (native.state / "native" / "m31ctl-stale-one.json").unlink(missing_ok=True)


# (b) a state directory that cannot hold the record.


def test_state_directory_that_is_a_file_is_refused_before_anything_starts(native):
    native.state.mkdir()
    (native.state / "native").write_text("not a directory\n")
    result = run_cli(*native.args(), env=native.env)
    assert result.returncode == 6, result.stderr  # was 70, an internal error
    assert "cannot keep native server state" in result.stderr and "not a directory" in result.stderr
    assert native.engines() == []


def _write_to_full_disk(fd: int, data: bytes) -> None:
    """The seam native_state._write_record, writing where the kernel answers ENOSPC (/dev/full):
    what a full disk does to the record's write."""
    del fd
    with open("/dev/full", "wb", buffering=0) as full:
        full.write(data)


def test_full_disk_while_recording_stops_the_engine_and_leaves_no_temp_file(native, monkeypatch):
    """The old code left the engine running unrecorded, a 0-byte temp file, and exit 70."""
    from m31ctl.runtime import native_state

    monkeypatch.setattr(native_state, "_write_record", _write_to_full_disk)
    result = run_cli(*native.args(delay=5), env=native.env)
    assert result.returncode == 6, result.stderr
    assert "No space left on device" in result.stderr and "was stopped" in result.stderr
    assert native.engines() == [] and not native.record.exists() and native.temp_files() == []


@pytest.fixture
def full_state(native):
    """The test's state directory on a tmpfs of 64 KiB that a filler file has filled: a real full
    disk, the kernel's own ENOSPC (mounting needs root, as CI runs the tests)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs the tests as root)")
    native.state.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(native.state)], check=True)
    try:
        with contextlib.suppress(OSError), open(native.state / "filler", "wb", buffering=0) as filler:
            while True:
                filler.write(b"\0" * 4096)
        assert os.statvfs(native.state).f_bavail == 0
        yield native.state
    finally:
        run_cli("stop", "--runtime", "native", env=native.env)  # before the mount goes
        subprocess.run(["umount", str(native.state)], check=True)


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("m31ctl: error:")]


def test_launch_on_a_full_disk_is_one_line_and_leaves_nothing(native, full_state):
    """A native launch with its state directory on a full disk: the old code created the lock
    and log files, started the engine, failed to save its record, stopped it again, and left the
    empty <name>.lock and <name>.log behind. Now claim reserves the record's space first: one
    line, exit 6, no engine ever started, no file left in the state directory."""
    result = run_cli(*native.args(timeout=700), env=native.env)
    assert result.returncode == 6, result.stderr
    assert "Traceback" not in result.stderr and len(_error_lines(result.stderr)) == 1, result.stderr
    assert "cannot keep native server state" in result.stderr and "No space left on device" in result.stderr
    assert "was stopped" not in result.stderr  # nothing was started to stop
    assert native.engines() == []
    left = sorted(p.relative_to(full_state).as_posix() for p in full_state.rglob("*") if p.is_file())
    assert left == ["filler"]
    status = run_cli("status", "--runtime", "native", "--json", env=native.env)
    assert status.returncode == 0 and native.name not in status.stdout, status.stdout


def test_a_launch_leaves_only_its_record_and_log_and_stop_only_the_log(native):
    """The per-name lock file lives as long as the claim; the record goes with stop."""
    launched = run_cli(*native.args(), env=native.env)
    assert launched.returncode == 0, launched.stderr
    directory = native.state / "native"
    assert sorted(p.name for p in directory.iterdir()) == [f"{native.name}.json", f"{native.name}.log"]
    assert oct(native.record.stat().st_mode & 0o777) == "0o600"
    stopped = run_cli("stop", "--name", native.name, env=native.env)
    assert stopped.returncode == 0, stopped.stderr
    assert sorted(p.name for p in directory.iterdir()) == [f"{native.name}.log"]


@pytest.mark.slow  # seconds of signal sweeps: the full suite runs it, the fast lane does not
def test_stop_returns_only_when_every_process_of_the_server_is_gone(native, tmp_path):
    """vLLM's multiprocessing resource tracker ignores SIGTERM and outlived a real server by 3 s
    after `stop` had returned (the soak found it). Here the engine's Python starts such a helper
    (SIGTERM ignored, 4 s to live) beside the stand-in engine: stop waits for it too."""
    python = tmp_path / "python-with-helper"
    python.write_text(f'#!/bin/sh\nsh -c \'trap "" TERM; sleep 4\' &\n{sys.executable} "$@"\n')
    python.chmod(0o755)
    launched = run_cli(*native.args("--set", f"runtime.native_python={python}"), env=native.env)
    assert launched.returncode == 0, launched.stderr
    pid = json.loads(native.record.read_text())["pid"]
    assert len(group(pid)) >= 3  # the shell, the helper and the engine
    stopped = run_cli("stop", "--name", native.name, env=native.env)
    assert stopped.returncode == 0, stopped.stderr
    assert group(pid) == []


@pytest.mark.parametrize("then", ["stop", "launch"])
def test_a_killed_servers_orphans_are_ended_by_stop_and_by_the_next_launch(native, tmp_path, then):
    """kill -9 of a real vLLM API server (the soak's fault) left its EngineCore and Worker
    processes running, 2.3 GB, in the dead server's process group; status said `exited`, the
    next launch started a second engine beside them, and stop never looked. Here the server's
    process is a shell whose children (the stand-in engine, a helper) stay when it is killed:
    stop, or the launch that replaces it, ends them."""
    python = tmp_path / "python-with-children"
    python.write_text(f'#!/bin/sh\nsleep 120 &\n{sys.executable} "$@"\n')
    python.chmod(0o755)
    args = native.args("--set", f"runtime.native_python={python}", "--json")
    launched = run_cli(*args, env=native.env)
    assert launched.returncode == 0, launched.stderr
    pid = json.loads(native.record.read_text())["pid"]
    os.kill(pid, signal.SIGKILL)
    assert gone(pid) and len(group(pid)) == 2  # the engine and the helper, orphaned
    status = cli_json.data(run_cli("status", "--runtime", "native", "--json", env=native.env).stdout)
    assert [r["state"] for r in status["containers"]] == ["exited"]
    if then == "stop":
        done = run_cli("stop", "--name", native.name, env=native.env)
        assert done.returncode == 0 and "processes left of" in done.stderr, done.stderr
        assert not native.record.exists()
    else:
        done = run_cli(*args, env=native.env)
        assert done.returncode == 0, done.stderr
        assert last_json(done.stdout)["action"] == "recreated"
        new = json.loads(native.record.read_text())["pid"]
        assert set(native.engines()) <= set(group(new))  # the shell and its engine, nothing older
    assert group(pid) == []


# (e) an interrupt while the engine is started but not yet recorded, and one while waiting.


def _interrupt(fd: int, data: bytes) -> None:
    del fd, data
    raise KeyboardInterrupt


def test_interrupt_before_the_record_is_saved_stops_the_engine(native, monkeypatch):
    from m31ctl.runtime import native_state

    monkeypatch.setattr(native_state, "_write_record", _interrupt)
    result = run_cli(*native.args(delay=5), env=native.env)
    assert result.returncode == 130, result.stderr
    assert native.engines() == [] and not native.record.exists() and native.temp_files() == []


@pytest.mark.slow  # seconds of signal sweeps: the full suite runs it, the fast lane does not
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_while_waiting_keeps_the_record_and_the_next_launch_adopts(native, sig):
    """Ctrl-C, or SIGTERM (a CI runner cancelling: the CLI treats it as Ctrl-C), during the wait."""
    env = {**os.environ, **native.env}
    proc = subprocess.Popen(
        [sys.executable, "-m", "m31ctl", *native.args(delay=6)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    seen = ""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "started" not in seen and proc.poll() is None:
        seen += proc.stderr.readline()
    assert "started" in seen, seen
    proc.send_signal(sig)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "Traceback" not in err, seen + err
    [engine] = native.engines()  # the engine runs on, recorded
    assert json.loads(native.record.read_text())["pid"] == engine
    again = run_cli(*native.args("--json", delay=6), env=native.env)
    assert again.returncode == 0, again.stderr
    assert last_json(again.stdout)["action"] in ("adopted", "unchanged")
    assert native.engines() == [engine]


# (c) concurrent launches of one name start one engine.


@pytest.mark.slow
def test_six_concurrent_launches_of_one_name_start_one_engine(native):
    env = {**os.environ, **native.env}
    argv = [sys.executable, "-m", "m31ctl", *native.args("--json", delay=3)]
    procs = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for _ in range(6)
    ]
    results = [(p.wait(timeout=180), *p.communicate()) for p in procs]
    assert [code for code, _out, _err in results] == [0] * 6, [err[-600:] for _c, _o, err in results]
    actions = sorted(last_json(out)["action"] for _code, out, _err in results)
    assert actions.count("created") == 1 and set(actions) <= {"created", "adopted", "unchanged"}, actions
    log = (native.state / "native" / f"{native.name}.log").read_text()
    assert log.count("vLLM API server version") == 1, log
    assert len(native.engines()) == 1 and native.temp_files() == []
