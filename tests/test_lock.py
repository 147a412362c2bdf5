"""m31ctl lock, --locked and drift (issue 18), against the real Docker Engine where images matter."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli
from tests.ports import free_port
from tests.support import cli_json


def _lock(tmp_path: Path, *args: str) -> Path:
    path = tmp_path / "m31ctl.lock"
    result = run_cli("lock", *args, "-o", str(path))
    assert result.returncode == 0, result.stderr
    return path


def test_lock_check_is_clean_then_names_a_changed_override_file(tmp_path):
    override = tmp_path / "site.yaml"
    override.write_text("serving:\n  max_model_len: 131072\n")
    lock = _lock(tmp_path, "--hardware", "b300x4", "-f", str(override))
    data = json.loads(lock.read_text())
    assert (
        data["lock_version"] == 1
        and data["plan_hash"]
        and data["settings"]["serving.max_model_len"] == 131072
    )
    assert any(name.startswith("-f #1") for name in data["inputs"])
    assert run_cli("lock", "--hardware", "b300x4", "-f", str(override), "--check", str(lock)).returncode == 0
    override.write_text("serving:\n  max_model_len: 65536\n")
    drifted = run_cli("lock", "--hardware", "b300x4", "-f", str(override), "--check", str(lock))
    assert drifted.returncode == 1
    assert "setting serving.max_model_len: 131072 -> 65536" in drifted.stdout
    assert f"{override}:2" in drifted.stdout  # where the new value came from
    assert f"input -f #1 {override}" in drifted.stdout


def test_lock_is_stable_text(tmp_path):
    first = _lock(tmp_path, "--hardware", "h200x8").read_text()
    assert _lock(tmp_path, "--hardware", "h200x8").read_text() == first
    assert list(json.loads(first)) == sorted(json.loads(first))


def test_a_different_host_is_hardware_drift(tmp_path):
    lock = _lock(tmp_path, "--hardware", "b300x4")
    result = run_cli("lock", "--hardware", "b200x4", "--check", str(lock), "--json")
    assert result.returncode == 1
    changed = {d["what"] for d in cli_json.data(result.stdout)["drift"]}
    assert {"hardware product", "hardware source"} <= changed


def test_a_changed_recipe_is_drift(tmp_path):
    """The shipped recipe itself changed since the lock (an m31ctl checkout with an edited recipe)."""
    copy = tmp_path / "checkout"
    for part in ("m31ctl", "recipes", "templates"):
        shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__", "_data"))
    env = {"PYTHONPATH": str(copy), "XDG_CACHE_HOME": str(tmp_path / "cache")}

    def m31ctl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "m31ctl", *args],
            capture_output=True,
            text=True,
            cwd=copy,
            env={**_base_env(), **env},
        )

    lock = tmp_path / "m31ctl.lock"
    assert m31ctl("lock", "--hardware", "b300x4", "-o", str(lock)).returncode == 0
    recipe = copy / "recipes" / "blackwell.yaml"
    recipe.write_text(recipe.read_text() + "# edited after the lock was made\n")
    result = m31ctl("lock", "--hardware", "b300x4", "--check", str(lock))
    assert result.returncode == 1, result.stderr
    assert "input recipe recipes/blackwell.yaml: sha256:" in result.stdout


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("M31CTL_")}


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "invalid JSON"),
        ('{"lock_version": 99, "m31ctl_version": "9.0.0"}', "newer than this m31ctl understands"),
        ('{"lock_version": 1, "settings": "everything"}', "not a valid lock file"),
        ("[1, 2]", "expected a JSON object"),
        (b"\xff\xfe\x00binary", "not UTF-8"),
    ],
)
def test_bad_lock_files_are_exit_2_naming_the_file(tmp_path, content, problem):
    path = tmp_path / "bad.lock"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    for args in (
        ["lock", "--hardware", "b300x4", "--check", str(path)],
        ["render", "--target", "k8s", "--hardware", "b300x4", "--locked", str(path)],
    ):
        result = run_cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert str(path) in result.stderr and problem in result.stderr and "Traceback" not in result.stderr


def test_locked_render_refuses_drift_and_update_lock_accepts_it(tmp_path):
    lock = _lock(tmp_path, "--hardware", "b300x4")
    same = run_cli("render", "--target", "k8s", "--hardware", "b300x4", "--locked", str(lock))
    assert same.returncode == 0, same.stderr
    moved = ("render", "--target", "k8s", "--hardware", "b300x4", "--set", "serving.max_num_seqs=64")
    refused = run_cli(*moved, "--locked", str(lock))
    assert refused.returncode == 4
    # The old value is the one the lock recorded for the setting (the plan's resolved value,
    # "(none)" when the plan leaves it unset): the line reads it from the lock, not a guess.
    recorded = json.loads(lock.read_text())["settings"].get("serving.max_num_seqs")
    shown = "(none)" if recorded is None else json.dumps(recorded)
    assert "drifted from" in refused.stderr
    assert f"setting serving.max_num_seqs: {shown} -> 64 (--set #1)" in refused.stderr, refused.stderr
    accepted = run_cli(*moved, "--locked", str(lock), "--update-lock")
    assert accepted.returncode == 0 and json.loads(lock.read_text())["settings"]["serving.max_num_seqs"] == 64


def test_locked_render_pins_the_registry_digest(monkeypatch, tmp_path):
    """Where the engine knows a registry digest, rendered files name the image by it."""
    from m31ctl.runtime.images import ImageFacts

    digest = "vllm/vllm-openai@sha256:" + "ab" * 32
    facts = ImageFacts("vllm/vllm-openai:minimax-m31-flash", "sha256:" + "cd" * 32, digest, "0.32.0")
    monkeypatch.setattr("m31ctl.runtime.images.image_facts", lambda reference, ask_vllm=True: facts)
    lock = _lock(tmp_path, "--hardware", "b300x4")
    assert json.loads(lock.read_text())["image"]["digest"] == digest
    rendered = run_cli("render", "--target", "compose", "--hardware", "b300x4", "--locked", str(lock))
    assert rendered.returncode == 0, rendered.stderr
    assert f"image: {digest}" in rendered.stdout


# Against the real Docker Engine: the image tag re-pushed (rebuilt) under the same name.


@pytest.mark.docker
def test_launch_locked_refuses_a_rebuilt_image_under_the_same_tag(tmp_path):
    from m31ctl.runtime.engine_api import connect
    from tests.dockerlib import build_engine_images

    client = connect()
    images = build_engine_images(client)
    tag = f"m31ctl-test/locked:{uuid.uuid4().hex[:6]}"

    def build(marker: str) -> str:
        dockerfile = f"FROM {images['ready']}\nLABEL m31ctl.test.build={marker}\n".encode()
        image, _logs = client.images.build(fileobj=io.BytesIO(dockerfile), tag=tag, rm=True)
        return str(image.id)

    name = f"m31ctl-locked-{uuid.uuid4().hex[:6]}"
    plan_options = [
        "--hardware", "cpu", "--set", f"runtime.container_name={name}", "--set", f"runtime.port={free_port()}",
        "--set", f"engine.image={tag}", "--set", f"model.path={tmp_path}", "--set", "runtime.env.FAKE_ENGINE_DELAY=1",
    ]  # fmt: skip
    args = ["launch", *plan_options]
    first_id = build("one")
    lock = tmp_path / "m31ctl.lock"
    try:
        made = run_cli("lock", *plan_options, "-o", str(lock))
        assert made.returncode == 0, made.stderr
        assert json.loads(lock.read_text())["image"]["id"] == first_id
        launched = run_cli(*args, "--locked", str(lock), "--json")
        assert launched.returncode == 0, launched.stderr
        container = client.containers.get(name)
        assert container.image.id == first_id  # pinned by ID
        second_id = build("two")
        assert second_id != first_id
        refused = run_cli(*args, "--locked", str(lock), "--yes")
        assert refused.returncode == 4, refused.stderr
        assert f"image id: {first_id} -> {second_id}" in refused.stderr
        assert client.containers.get(name).image.id == first_id  # nothing was touched
        doctor = run_cli(
            "doctor", "--hardware", "cpu", "--set", f"engine.image={tag}", "--locked", str(lock), "--json"
        )
        checks = {c["id"]: c for c in cli_json.data(doctor.stdout)["checks"]}
        assert checks["lock"]["status"] == "fail" and second_id in checks["lock"]["message"]
    finally:
        with contextlib.suppress(Exception):
            client.containers.get(name).remove(force=True)
        with contextlib.suppress(Exception):
            client.images.remove(tag, force=True)


def test_the_lock_records_the_checkpoint_commit_and_a_moved_cache_drifts(tmp_path):
    """`m31ctl pull` leaves refs/main naming the commit it downloaded; the lock pins it, and a
    cache that now holds another commit (a re-pull of a moved branch) is drift."""
    cache = tmp_path / "hf"
    ref = cache / "hub" / "models--MiniMaxAI--MiniMax-M3.1-Flash" / "refs" / "main"
    ref.parent.mkdir(parents=True)
    ref.write_text("a" * 40)
    sets = ("--hardware", "b300x4", "--set", f"runtime.hf_cache={cache}")
    lock = tmp_path / "m31ctl.lock"
    assert run_cli("lock", *sets, "-o", str(lock)).returncode == 0
    recorded = json.loads(lock.read_text())["checkpoint"]
    assert recorded == {"repo": "MiniMaxAI/MiniMax-M3.1-Flash", "commit": "a" * 40}
    assert run_cli("lock", *sets, "--check", str(lock)).returncode == 0
    ref.write_text("b" * 40)
    drifted = run_cli("lock", *sets, "--check", str(lock), "--json")
    assert drifted.returncode == 1
    (found,) = [d for d in cli_json.data(drifted.stdout)["drift"] if d["what"] == "checkpoint commit"]
    assert (found["old"], found["new"]) == ("a" * 40, "b" * 40)
