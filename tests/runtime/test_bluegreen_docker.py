"""launch --blue-green on the real Docker Engine, with the busybox stand-in engine
(tests/engine_image): it answers /health and /v1/models and nothing else, so the new container
is ready and then fails the gate. What that proves in Docker: the live container found by its
labels, the new one in the green slot on the next free port, created, then stopped and removed
when the gate fails, and the old one still serving (exit 1, one line)."""

from __future__ import annotations

import contextlib
import json
import uuid

import httpx
import pytest

from tests.conftest import last_json, run_cli
from tests.ports import free_port

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def image():
    from m31ctl.runtime.engine_api import connect
    from tests.dockerlib import build_engine_images

    return build_engine_images(connect())["ready"]


@pytest.fixture
def names(tmp_path):
    from m31ctl.runtime.engine_api import connect

    name = f"m31ctl-bg-{uuid.uuid4().hex[:8]}"
    yield name
    client = connect()
    for each in (name, f"{name}-green"):
        with contextlib.suppress(Exception):
            client.containers.get(each).remove(force=True)


def test_a_failed_gate_removes_the_green_container_and_the_old_serves(image, names, tmp_path):
    from m31ctl.runtime.engine_api import connect

    port = free_port()
    args = [
        "launch", "--hardware", "cpu", "--name", names, "--port", str(port), "--set", f"engine.image={image}",
        "--set", f"model.path={tmp_path}", "--set", "runtime.env.FAKE_ENGINE_DELAY=1", "--skip-deep",
    ]  # fmt: skip
    first = run_cli(*args, "--json")
    assert first.returncode == 0, first.stderr
    old = last_json(first.stdout)
    client = connect()
    live_id = client.containers.get(names).id

    changed = run_cli(
        *args, "--blue-green", "--gate-no-load", "--set", "serving.max_model_len=1024", "--json"
    )
    assert changed.returncode == 1, changed.stderr
    error = json.loads(changed.stdout.splitlines()[-1])["error"]
    green = f"{names}-green"
    assert error["message"].startswith(f"blue-green: {green} failed the gate (")
    assert error["message"].endswith(f"it is stopped and {names} keeps serving on {old['endpoint']}")
    assert (
        f"blue-green: starting {green} at http://127.0.0.1:" in changed.stderr
        and "Traceback" not in changed.stderr
    )
    assert green not in [c.name for c in client.containers.list(all=True)]
    assert client.containers.get(names).id == live_id and client.containers.get(names).status == "running"
    assert httpx.get(f"{old['endpoint']}/health", timeout=5).status_code == 200
