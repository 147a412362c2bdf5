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
        boot, start = real.split(":")
        env = _state(tmp_path, "m31ctl-stale", bystander.pid, f"{boot}:{int(start) + 1}")
        status = json.loads(run_cli("status", "--runtime", "native", "--json", env=env).stdout)
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
        status = json.loads(run_cli("status", "--runtime", "native", "--json", env=env).stdout)
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
    report = json.loads(result.stdout)
    checks = {c["check"]: c for c in report["checks"]}
    assert not checks["chat"]["ok"] and not checks["stream"]["ok"]
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
    start = time.monotonic()
    result = run_cli("plan", "--hardware", "b300x99999999999999999999")
    assert result.returncode == 2 and time.monotonic() - start < 10, result.stderr


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
    assert result.returncode == 0 and json.loads(result.stdout)["containers"] == [], result.stderr


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
    assert json.loads(result.stdout)["exit_code"] == 2


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
