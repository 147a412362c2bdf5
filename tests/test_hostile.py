"""Hostile input, faults and races (issue 19): no injection, no writes outside their place, no
exit 70, secrets never echoed. Real file systems and real HTTP servers where they matter."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli, run_cli_process
from tests.support import cli_json

INJECTION = "x\n[Service]\nExecStartPre=/usr/bin/id\n#"


@pytest.mark.parametrize(
    "name",
    [INJECTION, "../escape", "/etc/passwd", "a/b", "UPPER", "-lead", "trail-", "x" * 64, "a_b", "a.b", ""],
)
def test_bad_server_names_are_refused_at_plan_time(name, tmp_path):
    for target in ("systemd", "k8s", "script", "compose"):
        result = run_cli(
            "render", "--target", target, "--hardware", "b300x4", "--set", f"runtime.container_name={name}",
            "-o", str(tmp_path / "out"),
        )  # fmt: skip
        assert result.returncode == 2, (target, result.stderr)
        assert "not a valid server name" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "escape.service").exists()


def test_launch_name_flag_and_server_commands_check_names():
    assert run_cli("launch", "--hardware", "cpu", "--name", "../x", "--dry-run").returncode == 2
    for command in (["stop"], ["logs"], ["smoke"]):
        result = run_cli(*command, "--name", "../../x")
        assert result.returncode == 2 and "not a valid server name" in result.stderr, command


def test_valid_name_renders_and_stays_inside_the_directory(tmp_path):
    result = run_cli(
        "render", "--target", "systemd", "--hardware", "b300x4", "--set", "runtime.container_name=m31-a1",
        "-o", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["m31-a1.service"]
    unit = (tmp_path / "m31-a1.service").read_text()
    assert unit.count("[Service]") == 1 and "ExecStartPre=/usr/bin/id" not in unit


def test_artifact_writer_refuses_paths(tmp_path):
    from m31ctl.errors import InputError
    from m31ctl.render import Artifact
    from m31ctl.render.files import write

    for name in ("../x", "/tmp/x", "a/b", ".."):
        with pytest.raises(InputError):
            write(tmp_path / "d", [Artifact(name, "x")], force=True)
    assert not (tmp_path / "x").exists() and not (tmp_path / "d").exists()


# Native servers: a recorded pid is trusted only while it is the process we started.


def _state(tmp_path: Path, name: str, pid: int, identity: str | None) -> dict[str, str]:
    directory = tmp_path / "state" / "native"
    directory.mkdir(parents=True)
    record = {
        "name": name, "pid": pid, "plan_hash": "abc", "recipe": "cpu", "variant": "rehearsal",
        "profile": "latency", "bind": "127.0.0.1", "port": 9, "log": str(tmp_path / "log"),
        "argv": ["x"], "started_at": time.time() - 100, "stop_timeout": 1, "identity": identity,
    }  # fmt: skip
    (directory / f"{name}.json").write_text(json.dumps(record))
    return {"M31CTL_STATE_DIR": str(tmp_path / "state")}


def test_native_stop_never_signals_a_reused_pid(tmp_path):
    """After a crash or reboot the recorded pid may be someone else's: status shows the server as
    exited, and stop removes the record without signalling that process."""
    from m31ctl.runtime.native import process_identity

    bystander = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        real = process_identity(bystander.pid)
        assert real is not None
        boot, start, command = real.split(":")
        env = _state(tmp_path, "m31ctl-stale", bystander.pid, f"{boot}:{int(start) + 1}:{command}")
        status = cli_json.data(run_cli("status", "--runtime", "native", "--json", env=env).stdout)
        assert [(s["name"], s["state"]) for s in status["containers"]] == [("m31ctl-stale", "exited")]
        stopped = run_cli("stop", "--runtime", "native", "--name", "m31ctl-stale", env=env)
        assert stopped.returncode == 0, stopped.stderr
        time.sleep(0.3)
        assert bystander.poll() is None, "stop signalled a process that is not ours"
        assert not (tmp_path / "state" / "native" / "m31ctl-stale.json").exists()
    finally:
        bystander.kill()
        bystander.wait()


def test_native_recorded_identity_matches_the_live_process(tmp_path):
    from m31ctl.runtime.native import process_identity

    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        env = _state(tmp_path, "m31ctl-live", bystander.pid, process_identity(bystander.pid))
        status = cli_json.data(run_cli("status", "--runtime", "native", "--json", env=env).stdout)
        assert [(s["name"], s["state"]) for s in status["containers"]] == [("m31ctl-live", "running")]
    finally:
        bystander.kill()
        bystander.wait()


# Secrets: redacted in every message, whichever way they got there.

CANARY = "hf_CANARYhostile0123456789abcdefXYZ"


def test_token_in_a_wrong_field_is_not_echoed():
    result = run_cli("plan", "--hardware", "b300x4", "--set", f"serving.max_num_seqs={CANARY}", "--json")
    assert result.returncode == 2
    assert CANARY not in result.stderr + result.stdout and "***" in result.stderr + result.stdout


def test_env_secret_values_are_redacted_even_when_not_token_shaped():
    secret = "plain-secret-value-42"
    result = run_cli(
        "plan",
        "--hardware",
        "b300x4",
        "--set",
        f"serving.max_model_len={secret}",
        env={"VLLM_API_KEY": secret},
    )
    assert result.returncode == 2 and secret not in result.stderr and "***" in result.stderr


def test_api_key_with_a_line_break_is_refused_without_echo():
    key = "abc123secret\r\ninjected: header"
    result = run_cli("smoke", "--url", "http://127.0.0.1:9", env={"VLLM_API_KEY": key})
    assert result.returncode == 2 and "line break" in result.stderr
    assert "abc123secret" not in result.stderr and "injected" not in result.stderr


# Exit codes: bad input is 2 (or 6 for the host), never 70.


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--hardware", "b300x4", "--set", "serving.max_num_seqs=" + "9" * 5000],
        ["plan", "--hardware", "b300x4", "--set", "engine.extra_args=" + "[" * 10000 + "]" * 10000],
        ["plan", "--hardware", "b300x4", "--set", "parallelism.tensor=true"],
        ["plan", "--hardware", "b300x4", "--set", "engine.extra_args=[1]"],
        ["capacity", "--hardware", "b300x4", "--context", "inf"],
        ["capacity", "--hardware", "b300x4", "--context", "nan"],
        ["capacity", "--hardware", "b300x4", "--sequences", "0"],
        ["capacity", "--hardware", "b300x4", "--plot", "x.txt"],
        ["capacity", "--hardware", "b300x4", "--plot", "no-suffix"],
        ["launch", "--hardware", "cpu", "--port", "0", "--dry-run"],
        ["smoke", "--url", "http://[::1"],
        ["smoke", "--url", "ftp://example"],
    ],
)
def test_bad_input_is_exit_2(args, tmp_path):
    result = run_cli(*args, env={"HOME": str(tmp_path)})
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "internal error" not in result.stderr


def test_settings_name_the_list_item_that_is_wrong():
    result = run_cli("plan", "--hardware", "b300x4", "--set", "engine.extra_args=[1]")
    assert "engine.extra_args[0]" in result.stderr and "--set #1" in result.stderr


def test_huge_and_deep_override_files(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text("serving:\n  max_num_seqs: " + "9" * 5000 + "\n")
    deep = tmp_path / "deep.yaml"
    deep.write_text("serving:\n  x: " + "[" * 5000 + "]" * 5000 + "\n")
    for path in (big, deep):
        result = run_cli("plan", "--hardware", "b300x4", "-f", str(path))
        assert result.returncode == 2 and str(path) in result.stderr and "internal" not in result.stderr


def test_closed_pipes_are_not_failures():
    for args in (["plan", "--hardware", "b300x4"], ["plan", "--hardware", "b300x4", "--json"]):
        proc = subprocess.Popen(
            [sys.executable, "-m", "m31ctl", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT
        )
        assert proc.stdout is not None
        proc.stdout.read(10)
        proc.stdout.close()  # the reader stops early, as `| head -1` does
        _out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, (args, err)
        assert b"Traceback" not in err


def test_closed_stderr_keeps_the_exit_code():
    proc = subprocess.run(
        [sys.executable, "-m", "m31ctl", "plan", "--hardware", "nope"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
        pass_fds=(),
        close_fds=True,
        preexec_fn=lambda: os.close(2),
    )
    assert proc.returncode == 2


def test_ascii_only_output_encoding():
    result = run_cli_process("capacity", "--hardware", "b300x4", env={"PYTHONIOENCODING": "ascii"})
    assert result.returncode == 0, result.stderr


# Smoke against servers that are not quite vLLM.


class _Fake(BaseHTTPRequestHandler):
    mode = "html"

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        if self.mode == "html":
            self._send(200, b"<html>a proxy page</html>", "text/html")
        else:
            self._send(200, json.dumps({"data": [{"id": "m"}]}).encode(), "application/json")

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        if not body.get("stream"):
            self._send(200, b"not json at all", "application/json")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n')
        self.wfile.flush()
        self.connection.close()  # cut short: fewer bytes than announced

    def _send(self, code: int, payload: bytes, kind: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@contextlib.contextmanager
def fake_server(mode: str) -> Iterator[str]:
    handler = type("Handler", (_Fake,), {"mode": mode})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_smoke_against_a_non_json_endpoint():
    with fake_server("html") as url:
        result = run_cli("smoke", "--url", url, "--json")
    assert result.returncode == 1, result.stderr
    assert "did not answer an OpenAI model list" in result.stderr


def test_smoke_against_a_broken_stream():
    with fake_server("broken") as url:
        result = run_cli("smoke", "--url", url, "--json")
    assert result.returncode == 1, result.stderr
    report = cli_json.data(result.stdout)
    checks = {c["id"]: c for c in report["checks"]}
    assert checks["chat"]["status"] == checks["stream"]["status"] == "fail", checks
    assert "internal error" not in result.stderr


# Full and read-only file systems, for real (root can mount them; CI runs as root).


@contextlib.contextmanager
def mounted(tmp_path: Path, *options: str) -> Iterator[Path]:
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a file system needs root")
    target = tmp_path / "mnt"
    target.mkdir()
    done = subprocess.run(["mount", *options, str(target)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount here: {done.stderr.strip()}")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def test_render_into_a_full_file_system_leaves_nothing_half_written(tmp_path):
    with mounted(tmp_path, "-t", "tmpfs", "-o", "size=8k", "tmpfs") as mnt:
        with contextlib.suppress(OSError), (mnt / "filler").open("wb") as filler:
            while True:  # fill it to the last byte
                filler.write(b"\0" * 512)
                filler.flush()
        result = run_cli("render", "--target", "k8s", "--hardware", "b300x4", "-o", str(mnt / "out"))
        assert result.returncode == 2, result.stderr
        assert "No space left on device" in result.stderr and "internal" not in result.stderr
        assert [p.name for p in (mnt / "out").iterdir()] == []  # no partial file, no temp file


def test_render_and_plot_onto_a_read_only_file_system(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    with mounted(tmp_path, "--bind", "-o", "ro", str(source)) as mnt:
        if os.access(mnt, os.W_OK) and _writable(mnt):
            pytest.skip("the read-only bind mount is writable here")
        result = run_cli("render", "--target", "k8s", "--hardware", "b300x4", "-o", str(mnt))
        assert result.returncode == 2 and "Read-only file system" in result.stderr, result.stderr
        pytest.importorskip("matplotlib")
        plotted = run_cli("capacity", "--hardware", "b300x4", "--plot", str(mnt / "cap.png"))
        assert plotted.returncode == 2 and "Read-only file system" in plotted.stderr, plotted.stderr


def _writable(directory: Path) -> bool:
    try:
        (directory / ".probe").write_text("x")
    except OSError:
        return False
    (directory / ".probe").unlink()
    return True


def test_huge_gpu_count_is_refused_without_allocating():
    """Measured in bytes, not seconds (a busy machine is slow, never a sign of allocating)."""
    import tracemalloc

    tracemalloc.start()
    try:
        result = run_cli("plan", "--hardware", "b300x99999999999999999999")
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.returncode == 2, result.stderr
    assert peak < 64 * 2**20, peak  # a plan is kilobytes; a list per GPU would be exabytes


def test_schema_version_holding_a_path_is_bad_input():
    result = run_cli("plan", "--hardware", "b300x4", "--set", "engine.schema_version=../../../etc/passwd")
    assert result.returncode == 2 and "internal" not in result.stderr, result.stderr


def test_corrupt_native_state_file_is_ignored(tmp_path):
    directory = tmp_path / "state" / "native"
    directory.mkdir(parents=True)
    (directory / "m31ctl-broken.json").write_bytes(b"\xff\xfe{not json")
    (directory / "..evil.json").write_text("{}")
    env = {"M31CTL_STATE_DIR": str(tmp_path / "state")}
    result = run_cli("status", "--runtime", "native", "--json", env=env)
    assert result.returncode == 0 and cli_json.data(result.stdout)["containers"] == [], result.stderr


def test_render_check_refuses_an_output_directory_too(tmp_path):
    result = run_cli(
        "render", "--target", "k8s", "--hardware", "b300x4", "--check", str(tmp_path), "-o", str(tmp_path)
    )
    assert result.returncode == 2 and "internal" not in result.stderr


def test_ipv6_loopback_port_check():
    """runtime.bind=::1: the free-port check uses an IPv6 socket (an IPv4 one always said busy)."""
    import socket

    from m31ctl.netaddr import port_free

    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    with socket.socket(socket.AF_INET6) as s:
        try:
            s.bind(("::1", 0))
        except OSError:
            pytest.skip("no ::1 here")
        port = s.getsockname()[1]
        s.listen()
        assert not port_free("::1", port)
    assert port_free("::1", port)


# Secret flags: refused in every spelling vLLM accepts, and never echoed in the refusal.

SECRET_VALUE = "plain-secret-value-77"


@pytest.mark.parametrize(
    "extra",
    [
        ["--api-key", SECRET_VALUE],
        [f"--api-key={SECRET_VALUE}"],
        ["--api_key", SECRET_VALUE],
        [f"--hf_token={SECRET_VALUE}"],
        ["--hf-token", SECRET_VALUE],
        ["--api-k", SECRET_VALUE],
        ["--enforce-eager", "--HF_TOKEN", SECRET_VALUE],
    ],
)
def test_secret_flags_in_any_spelling_are_refused_without_echo(extra):
    for as_json in ((), ("--json",)):
        result = run_cli(
            "plan", "--hardware", "b300x4", "--set", f"engine.extra_args={json.dumps(extra)}", *as_json
        )
        assert result.returncode == 2, (extra, result.stdout, result.stderr)
        assert "would put a secret into argv" in result.stderr
        assert SECRET_VALUE not in result.stderr + result.stdout and "***" in result.stderr, result.stderr


def test_secret_flag_in_an_override_file_is_not_echoed(tmp_path):
    site = tmp_path / "site.yaml"
    site.write_text(f"engine:\n  extra_args: ['--api_key={SECRET_VALUE}']\n")
    result = run_cli("plan", "--hardware", "b300x4", "-f", str(site), "--json")
    assert result.returncode == 2 and SECRET_VALUE not in result.stderr + result.stdout, result.stderr
    assert cli_json.error(result.stdout)["exit_code"] == 2


def test_ordinary_flags_and_prefix_free_words_are_not_secret():
    from m31ctl.redact import secret_flag

    for arg in ("--api-server-count", "--hf-overrides", "--a", "--h", "-api-key", "api-key", "--apis"):
        assert secret_flag(arg) is None, arg
    result = run_cli("plan", "--hardware", "b300x4", "--set", 'engine.extra_args=["--api-server-count", "2"]')
    assert "would put a secret" not in result.stderr


@pytest.mark.parametrize(
    ("text", "secret"),
    [
        ("argv ['--api-key', 'k3y-v4lue']", "k3y-v4lue"),
        ('["--hf_token", "k3y-v4lue"]', "k3y-v4lue"),
        ("vllm serve m --api-k=k3y-v4lue --port 8", "k3y-v4lue"),
        ('{"VLLM_API_KEY": "k3y-v4lue"}', "k3y-v4lue"),
        ("-e HF_TOKEN=k3y-v4lue", "k3y-v4lue"),
        ("key sk-abcdefghijklmnopqrstuvwx", "sk-abcdefghijklmnopqrstuvwx"),
        ("Authorization: Bearer k3y-v4lue-long", "k3y-v4lue-long"),
        ("token ghp_abcdefghijklmnopqrstuvwxyz0123", "ghp_abcdefghijklmnopqrstuvwxyz0123"),
    ],
)
def test_redactor_masks_values_after_secret_names_and_token_shapes(text, secret):
    from m31ctl.redact import redact

    assert secret not in redact(text, {}) and "***" in redact(text, {})


def test_redactor_keeps_ordinary_text():
    from m31ctl.redact import redact

    for text in (
        "runtime.api_key=true requires VLLM_API_KEY",
        "image vllm/vllm-openai@sha256:" + "a" * 64,
        "disk-check-aaaaaaaaaaaaaaaaaaaaaaaa",
        "${VLLM_API_KEY:?set VLLM_API_KEY}",
        "--api-key --port 8000",
    ):
        assert redact(text, {}) == text


def test_redact_data_masks_secret_keys_and_argv_items():
    from m31ctl.redact import redact_data

    data = {
        "old": {"HF_TOKEN": "k3y-v4lue", "runtime.env.VLLM_API_KEY": "k3y-v4lue", "api_key": True},
        "argv": ["--api_key", "k3y-v4lue", "--port", "8"],
    }
    assert "k3y-v4lue" not in json.dumps(redact_data(data, {}))
    assert redact_data(data, {})["argv"][2:] == ["--port", "8"]  # type: ignore[index]


# What sits at a render target path: compared only when it is a regular UTF-8 file.


def _render(*extra: str) -> subprocess.CompletedProcess[str]:
    return run_cli("render", "--target", "systemd", "--hardware", "b300x4", *extra)


def _rendered_file(tmp_path: Path) -> Path:
    assert _render("-o", str(tmp_path)).returncode == 0
    [target] = tmp_path.iterdir()
    return target


def test_non_utf8_file_at_a_render_target_differs(tmp_path):
    target = _rendered_file(tmp_path)
    rendered = target.read_text()
    target.write_bytes(b"\xff\xfe not UTF-8\n")
    written = _render("-o", str(tmp_path))
    assert written.returncode == 4 and "not UTF-8" in written.stderr, written.stderr
    checked = _render("--check", str(tmp_path))
    assert checked.returncode == 1 and str(target) in checked.stdout, checked.stderr
    assert _render("-o", str(tmp_path), "--force").returncode == 0
    assert target.read_text() == rendered


def _render_process(*extra: str) -> subprocess.CompletedProcess[str]:
    """In a process of its own, with a time limit: the old code blocked on a FIFO for ever."""
    return subprocess.run(
        [sys.executable, "-m", "m31ctl", "render", "--target", "systemd", "--hardware", "b300x4", *extra],
        capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["fifo", "link-to-device", "link-to-file", "oversized"])
def test_anything_but_a_regular_file_at_a_render_target_is_a_conflict(tmp_path, kind):
    target = _rendered_file(tmp_path)
    rendered = target.read_text()
    target.unlink()
    decoy = tmp_path.parent / f"decoy-{kind}"
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "link-to-device":
        target.symlink_to("/dev/zero")
    elif kind == "link-to-file":
        decoy.write_text(rendered)  # even the very same text behind a link is not ours to follow
        target.symlink_to(decoy)
    else:
        with target.open("wb") as handle:
            handle.truncate(64 << 20)  # sparse: large, costs no disk
    written = _render_process("-o", str(tmp_path))
    assert written.returncode == 4 and "not the rendered file" in written.stderr, written.stderr
    checked = _render_process("--check", str(tmp_path))
    assert checked.returncode == 1 and str(target) in checked.stdout, checked.stderr
    forced = _render_process("-o", str(tmp_path), "--force")
    assert forced.returncode == 0, forced.stderr
    assert not target.is_symlink() and target.read_text() == rendered
    if kind == "link-to-file":
        assert decoy.read_text() == rendered  # replaced the link, not what it pointed to


def test_directory_at_a_render_target_is_never_replaced(tmp_path):
    target = _rendered_file(tmp_path)
    target.unlink()
    target.mkdir()
    (target / "keep").write_text("x")
    for extra in ((), ("--force",)):
        result = _render("-o", str(tmp_path), *extra)
        assert result.returncode == 4 and "is a directory" in result.stderr, result.stderr
    assert (target / "keep").read_text() == "x"


# Bounded input: every read has a size limit, every parse a depth limit, shapes are checked first.


def _limited_process(*args: str, seconds: int = 60) -> subprocess.CompletedProcess[str]:
    """m31ctl in a process whose memory is capped at 2 GiB: reading an endless file whole fails
    there (exit 70, MemoryError) instead of taking the machine's memory."""
    import resource

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    return subprocess.run(
        [sys.executable, "-m", "m31ctl", *args],
        capture_output=True, text=True, cwd=ROOT, timeout=seconds, check=False, preexec_fn=cap,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "what"),
    [
        (["lock", "--hardware", "b300x4", "--check", "/dev/zero"], "lock file"),
        (["plan", "--hardware", "b300x4", "-f", "/dev/zero"], "override file"),
        (["render", "--target", "k8s", "--hardware", "b300x4", "--locked", "/dev/zero"], "lock file"),
        (
            ["verify", "--hardware", "b300x4", "--url", "http://127.0.0.1:9", "--baseline", "/dev/zero"],
            "report",
        ),
        (["recipes", "validate", "/dev/zero"], "recipe file"),
    ],
)
def test_endless_input_files_are_bad_input(args, what):
    result = _limited_process(*args)
    assert result.returncode == 2, result.stderr
    assert "/dev/zero" in result.stderr and what in result.stderr and "larger than" in result.stderr


def _deep_json(depth: int) -> str:
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [40, 900, 100_000])
def test_deeply_nested_lock_and_baseline_are_bad_input(tmp_path, depth):
    lock = tmp_path / "deep.lock"
    lock.write_text('{"lock_version": 1, "settings": {"x": ' + _deep_json(depth) + "}}")
    result = run_cli("lock", "--hardware", "b300x4", "--check", str(lock))
    assert result.returncode == 2 and str(lock) in result.stderr and "levels deep" in result.stderr, (
        result.stderr
    )
    baseline = tmp_path / "deep.json"
    baseline.write_text('{"checks": [], "bench": {"x": ' + _deep_json(depth) + "}}")
    result = run_cli(
        "verify", "--hardware", "b300x4", "--url", "http://127.0.0.1:9", "--baseline", str(baseline)
    )
    assert result.returncode == 2 and str(baseline) in result.stderr and "levels deep" in result.stderr, (
        result.stderr
    )


@pytest.mark.parametrize("depth", [40, 900])
def test_deeply_nested_yaml_is_bad_input(tmp_path, depth):
    flow = tmp_path / "flow.yaml"
    flow.write_text("serving:\n  max_num_seqs: " + _deep_json(depth) + "\n")
    block = tmp_path / "block.yaml"
    block.write_text("serving:\n" + "".join("  " * level + "k:\n" for level in range(1, depth)))
    for path in (flow, block):
        result = run_cli("plan", "--hardware", "b300x4", "-f", str(path))
        assert result.returncode == 2 and str(path) in result.stderr, result.stderr
        assert "levels deep" in result.stderr and "internal" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("report", "problem"),
    [
        ({"checks": [], "bench": []}, "'bench' must be an object"),
        ({"checks": [], "bench": "fast"}, "'bench' must be an object"),
        ({"checks": [], "bench": {"output_throughput": "fast"}}, "bench.output_throughput must be a number"),
        ({"checks": {}, "bench": {}}, "'checks' must be a list"),
        ({"checks": ["x"], "bench": {}}, "'checks' must be a list"),
        ([], "expected a JSON object"),
    ],
)
def test_baseline_of_the_wrong_shape_is_refused_before_verify_runs(tmp_path, report, problem):
    """Before verify runs: the server it would ask is never contacted (a listener that counts
    connections, where a wall-clock bound told a slow machine from a verify that ran)."""
    import socket

    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(report))
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        listener.setblocking(False)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        result = run_cli("verify", "--hardware", "b300x4", "--url", url, "--baseline", str(baseline))
        try:
            listener.accept()
            contacted = True
        except BlockingIOError:
            contacted = False
    assert result.returncode == 2 and problem in result.stderr and str(baseline) in result.stderr, (
        result.stderr
    )
    assert not contacted


def test_a_good_baseline_loads(tmp_path):
    from m31ctl.checks import judged
    from m31ctl.served.baseline import verify_report as read_baseline

    path = tmp_path / "baseline.json"
    report = {"checks": [judged("chat", True, "HTTP 200").to_json()], "bench": {"output_throughput": 12.5}}
    path.write_text(json.dumps(report))
    assert read_baseline(path) == report
    # A baseline saved before one check shape (issue 38) still loads: only its bench figures are read.
    older = {"checks": [{"check": "chat", "status": "pass", "detail": "HTTP 200"}], "bench": report["bench"]}
    path.write_text(json.dumps(older))
    assert read_baseline(path) == older
    path.write_text(json.dumps({"checks": [], "bench": None}))
    assert read_baseline(path)["bench"] is None


# The disk memo answers only with entries m31ctl wrote.


def test_memo_entries_that_m31ctl_did_not_write_are_misses(tmp_path, monkeypatch):
    from m31ctl import memo

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls: list[int] = []

    def work() -> dict[str, object]:
        calls.append(1)
        return {"recipe": "blackwell", "layer": [1, 2]}

    assert memo.memoized("t", b"k", work) == work()
    [entry] = (tmp_path / "cache" / "m31ctl" / "t").glob("*.json")
    good = entry.read_bytes()
    header, _, payload = good.partition(b"\n")
    bad_entries = [
        b"{}",  # valid JSON, not what m31ctl wrote
        header + b"\n{}",  # the right header over another payload
        b"m31ctl-memo " + b"0" * 32 + b" " + header.split()[-1] + b"\n" + payload,  # another key's entry
        good[:-3],  # truncated
        b"\xff\xfe",
    ]
    for bad in bad_entries:
        entry.write_bytes(bad)
        calls.clear()
        assert memo.memoized("t", b"k", work) == work() and len(calls) == 2, bad
        assert entry.read_bytes() == good  # and the bad entry was replaced
    for plant in ("fifo", "link"):
        entry.unlink()
        os.mkfifo(entry) if plant == "fifo" else entry.symlink_to("/dev/zero")
        calls.clear()
        assert memo.memoized("t", b"k", work) == work() and len(calls) == 2, plant


def test_plans_are_right_with_a_tampered_memo(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    first = run_cli_process("plan", "--hardware", "b300x4", "--json", env=env)
    assert first.returncode == 0, first.stderr
    rendered = run_cli_process("render", "--target", "k8s", "--hardware", "b300x4", env=env)
    entries = list((tmp_path / "cache" / "m31ctl").glob("*/*.json"))
    assert {e.parent.name for e in entries} == {"parsed", "yaml"}
    for entry in entries:
        entry.write_text("{}")
    again = run_cli_process("plan", "--hardware", "b300x4", "--json", env=env)
    assert again.returncode == 0 and again.stdout == first.stdout, again.stderr
    assert (
        run_cli_process("render", "--target", "k8s", "--hardware", "b300x4", env=env).stdout
        == rendered.stdout
    )


# Drift reports show what changed, never a secret the lock holds.

LOCKED_SECRETS = ("plainsecretvalue1", "plainsecretvalue2", "plainsecretvalue3", "plainsecretvalue4")


def _lock_with_secrets(tmp_path: Path) -> Path:
    lock = tmp_path / "m31ctl.lock"
    assert run_cli("lock", "--hardware", "b300x4", "-o", str(lock)).returncode == 0
    data = json.loads(lock.read_text())
    # As a lock edited by hand, or written before a guard existed, could hold them.
    data["settings"]["runtime.env.VLLM_API_KEY"] = LOCKED_SECRETS[0]
    data["settings"]["engine.extra_args"] = ["--api_key", LOCKED_SECRETS[1]]
    data["settings"]["runtime.env"] = {"HF_TOKEN": LOCKED_SECRETS[2]}
    data["settings"]["model.path"] = f"--hf-token={LOCKED_SECRETS[3]}"
    lock.write_text(json.dumps(data))
    return lock


def _no_secrets(result: subprocess.CompletedProcess[str]) -> None:
    shown = result.stdout + result.stderr
    assert not [s for s in LOCKED_SECRETS if s in shown], shown
    assert "***" in shown, shown


def test_lock_check_drift_is_redacted(tmp_path):
    lock = _lock_with_secrets(tmp_path)
    for extra in ((), ("--json",)):
        result = run_cli("lock", "--hardware", "b300x4", "--check", str(lock), *extra)
        assert result.returncode == 1, result.stderr
        assert "runtime.env.VLLM_API_KEY" in result.stdout and "engine.extra_args" in result.stdout
        _no_secrets(result)


def test_locked_render_and_doctor_drift_is_redacted(tmp_path):
    lock = _lock_with_secrets(tmp_path)
    for command in (("render", "--target", "k8s"), ("launch", "--dry-run", "--json")):
        refused = run_cli(*command, "--hardware", "b300x4", "--locked", str(lock))
        assert refused.returncode == 4 and "drift" in refused.stderr, refused.stderr
        _no_secrets(refused)
    for extra in ((), ("--json",)):
        doctor = run_cli("doctor", "--hardware", "b300x4", "--locked", str(lock), *extra)
        assert "differences from" in doctor.stdout, doctor.stdout
        _no_secrets(doctor)


# Standard output that is not what rich expects: closed, read-only, full, or ASCII only.


def _process(
    *args: str, env: dict[str, str] | None = None, **popen: object
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "m31ctl", *args],
        capture_output="stdout" not in popen, text=True, cwd=ROOT, timeout=120, check=False,
        env={**os.environ, "COLUMNS": "120", **(env or {})}, **popen,  # type: ignore[arg-type]
    )  # fmt: skip


QUIET_COMMANDS = [
    ["plan", "--hardware", "b300x4"],
    ["plan", "--hardware", "b300x4", "--json"],
    ["plan", "--hardware", "b300x4", "--explain"],
    ["capacity", "--hardware", "b300x4", "--json"],
    # Pinned: a revision left to deploy time is a warning on stderr (m31ctl/revision.py).
    ["render", "--target", "k8s", "--hardware", "b300x4", "--revision", "0" * 40],
    ["recipes", "show", "blackwell"],
    ["launch", "--hardware", "cpu", "--dry-run", "--json"],
]


@pytest.mark.parametrize("args", QUIET_COMMANDS)
def test_closed_stdout_is_a_quiet_exit(args):
    """`m31ctl ... >&-`: nothing to print to is a reader that wants nothing, not exit 70."""
    result = subprocess.run(
        [sys.executable, "-m", "m31ctl", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120,
        preexec_fn=lambda: os.close(1),
    )  # fmt: skip
    assert result.returncode == 0 and result.stderr == "", result.stderr


def test_closed_or_read_only_stdout_keeps_the_commands_own_exit_code(tmp_path):
    """A failed check still fails, and a file opened while fd 1 is closed never takes its number."""
    lock = tmp_path / "m31ctl.lock"
    cases = [
        (["doctor", "--hardware", "b300x4", "--json"], lambda: os.close(1)),
        (["plan", "--hardware", "nope", "--json"], lambda: os.close(1)),
        (["plan", "--hardware", "b300x4", "--json"], lambda: os.dup2(os.open(os.devnull, os.O_RDONLY), 1)),
        (["lock", "--hardware", "b300x4", "-o", str(lock)], lambda: (os.close(0), os.close(1))),
    ]
    for args, prepare in cases:
        result = subprocess.run(
            [sys.executable, "-m", "m31ctl", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120,
            preexec_fn=prepare,
        )  # fmt: skip
        expected = {"doctor": 1, "plan": 2 if "nope" in args else 0, "lock": 0}[args[0]]
        assert result.returncode == expected and "internal error" not in result.stderr, (args, result.stderr)
    assert json.loads(lock.read_text())["recipe"] == "blackwell"  # the lock file whole, not on fd 1


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
@pytest.mark.parametrize(
    "args", [["plan", "--hardware", "b300x4"], ["plan", "--hardware", "b300x4", "--json"]]
)
def test_full_stdout_is_an_error_that_says_so(args):
    with open("/dev/full", "w") as full:
        result = subprocess.run(
            [sys.executable, "-m", "m31ctl", *args],
            stdout=full, stderr=subprocess.PIPE, text=True, cwd=ROOT, timeout=120,
        )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "cannot write to standard output: No space left on device" in result.stderr
    assert "Traceback" not in result.stderr and "Exception ignored" not in result.stderr


ASCII_ENVS = [
    {"PYTHONIOENCODING": "ascii"},
    {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0", "PYTHONIOENCODING": ""},
]


@pytest.mark.parametrize("env", ASCII_ENVS, ids=["PYTHONIOENCODING", "LC_ALL=C"])
@pytest.mark.parametrize(
    "args",
    [
        ["doctor", "--hardware", "b300x4"],
        ["plan", "--hardware", "b300x4", "--explain"],
        ["capacity", "--hardware", "b300x4"],
        ["recipes", "list"],
        ["plan", "--hardware", "b300x4", "-f", "UNICODE"],
    ],
)
def test_ascii_stdout_gets_plain_ascii(args, env, tmp_path):
    """An output encoding without box drawing or accents: plain ASCII tables and text (a value
    read from a UTF-8 file too; argv under LC_ALL=C is bytes, which Python passes through)."""
    site = tmp_path / "site.yaml"
    site.write_text("model:\n  served_name: caf\u00e9-\u2192-\u6a21\u578b\n", encoding="utf-8")
    args = [str(site) if arg == "UNICODE" else arg for arg in args]
    result = subprocess.run(
        [sys.executable, "-m", "m31ctl", *args],
        capture_output=True, cwd=ROOT, timeout=120, env={**os.environ, "COLUMNS": "100", **env},
    )  # fmt: skip
    assert result.returncode in (0, 1), result.stderr
    assert b"internal error" not in result.stderr, result.stderr
    assert result.stdout.isascii() and result.stdout.strip(), result.stdout[:400]
    if "--explain" in args or args[0] in ("doctor", "capacity", "recipes"):
        # The table is there, in ASCII: ruled, or stacked a record per block where a cell's
        # command cannot fold into 100 columns (m31ctl/cli/screen.py).
        assert b"+--" in result.stdout or b"|" in result.stdout or b"status: " in result.stdout
    if "-f" in args:
        assert b"cafe->-??" in result.stdout, result.stdout  # one ASCII character for each


def test_sigterm_is_handled_as_an_interrupt(tmp_path):
    """CI runners cancel with SIGTERM: the same message and exit code as Ctrl-C, not a silent 143."""
    import signal

    fifo = tmp_path / "site.yaml"
    os.mkfifo(fifo)
    proc = subprocess.Popen(
        [sys.executable, "-m", "m31ctl", "plan", "--hardware", "b300x4", "-f", str(fifo)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL),
    )  # fmt: skip
    writer = None
    deadline = time.monotonic() + 60
    while writer is None and time.monotonic() < deadline:  # m31ctl is waiting to read the -f file
        try:
            writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            time.sleep(0.05)
    assert writer is not None and proc.poll() is None
    try:
        time.sleep(0.3)  # inside read(), blocked on a writer that never writes
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=30)
    finally:
        os.close(writer)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, (proc.returncode, err)


def test_redaction_leaves_an_ordinary_plan_alone():
    """Settings named like secret flags (runtime.api_key, a switch) are m31ctl's own: their
    values and provenance show in full."""
    for args in (
        ("--json",),
        ("--explain",),
        ("--json", "--set", "runtime.api_key=true", "--set", "runtime.bind=0.0.0.0"),
    ):
        result = run_cli("plan", "--hardware", "b300x4", *args)
        assert result.returncode == 0 and "***" not in result.stdout, result.stderr
    data = cli_json.data(run_cli("plan", "--hardware", "b300x4", "--json").stdout)
    assert data["provenance"]["runtime.api_key"] == "schema default"
