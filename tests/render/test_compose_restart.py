"""A restarted engine does not download (issue 34), proven with the real parts: the rendered
Compose file run by docker-compose, its one-shot download service fetching `main` from a stand-in
hub with the real huggingface_hub (rendered with no hub and nothing cached, so resolved at deploy
time: issues 51, 53), vLLM's CPU build serving it offline, and the engine killed from outside so
that its restart policy starts it again after main has moved: it serves the commit the download
recorded in refs/main, asking the hub nothing."""

from __future__ import annotations

import ipaddress
import json
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_cli
from tests.standin_hub import Repo, RepoFile, StandinHub
from tests.support.rehearsal import needs_image

REPO_ID = "standin/tiny-rehearsal"
# Bounds for a start on a busy 2-core machine; they decide only when something is broken.
START_BOUND_S = 900


def _docker(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, check=False)


def _tiny_repo(model: Path) -> Repo:
    files = {
        str(p.relative_to(model)): RepoFile(p.read_bytes(), p.suffix == ".safetensors")
        for p in sorted(model.rglob("*"))
        if p.is_file()
    }
    return Repo(REPO_ID, files)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def _wait_healthy(url: str, container: str) -> None:
    deadline = time.monotonic() + START_BOUND_S
    while not _answers(url):
        state = _docker("inspect", "-f", "{{.State.Status}} {{.RestartCount}}", container).stdout.strip()
        assert time.monotonic() < deadline, f"{container} not answering {url}: {state}"
        time.sleep(2)


@needs_image
@pytest.mark.docker
@pytest.mark.vllm
@pytest.mark.slow
def test_a_restarted_engine_serves_offline_without_downloading(tmp_path, tiny_model):
    # This host as containers reach it: the default bridge's gateway (its subnet's first address:
    # Docker does not always list the gateway).
    subnet = _docker("network", "inspect", "bridge", "-f", "{{(index .IPAM.Config 0).Subnet}}").stdout.strip()
    gateway = str(ipaddress.ip_network(subnet)[1])
    hub = StandinHub(_tiny_repo(tiny_model), host="0.0.0.0", advertise=gateway)
    name = f"m31ctl-clock-{uuid.uuid4().hex[:6]}"
    project = name.replace("-", "")
    port = 18000 + int(uuid.uuid4().hex[:3], 16) % 1000
    cache = tmp_path / "hf"
    cache.mkdir()
    compose = tmp_path / "compose.yaml"
    try:
        rendered = run_cli(
            "render", "--target", "compose", "--hardware", "cpu", "--recipe", "cpu",
            "--set", f"model.path={REPO_ID}", "--set", f"runtime.hf_cache={cache}",
            "--set", f"runtime.container_name={name}", "--set", f"runtime.port={port}",
            "--set", f"runtime.env.HF_ENDPOINT={hub.endpoint}",
        )  # fmt: skip
        # Render asks no hub (HF_ENDPOINT is the session's closed one) and the cache is empty: the
        # files name main, which the download resolves when it runs (m31ctl/revision.py).
        assert rendered.returncode == 0 and "resolves it when it runs" in rendered.stderr, rendered.stderr
        compose.write_text(rendered.stdout)
        services = yaml.safe_load(rendered.stdout)["services"]
        commit = hub.repo.commit
        assert services["download"]["command"][3] == "main"
        assert services["vllm"]["command"][1:3] == ["--revision", "main"]
        assert "HF_HUB_OFFLINE=1" in services["vllm"]["environment"]
        up = subprocess.run(
            ["docker-compose", "-p", project, "-f", str(compose), "up", "-d"],
            capture_output=True, text=True, timeout=START_BOUND_S, check=False,
        )  # fmt: skip
        assert up.returncode == 0, up.stderr[-2000:]
        # No container_name on the one-shot download (a leftover of a script run would collide):
        # docker-compose 1.x names it PROJECT_SERVICE_1.
        downloaded = _docker("inspect", "-f", "{{.State.ExitCode}}", f"{project}_download_1").stdout.strip()
        assert downloaded == "0"
        assert hub.gets("model.safetensors") == [0]  # the one download, by the download service
        ref = cache / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "refs" / "main"
        assert ref.read_text() == commit  # the download recorded the commit main named then
        _wait_healthy(f"http://127.0.0.1:{port}/health", name)

        # main moves on the hub: the restarted engine still serves, offline, what refs/main names.
        assert hub.repo.commit_files({"m31ctl-moved.txt": RepoFile(b"moved", False)}) != commit
        hub.reset_counts()
        pid = _docker("inspect", "-f", "{{.State.Pid}}", name).stdout.strip()
        subprocess.run(["kill", "-9", pid], check=True)  # the engine dies, as a crash would
        deadline = time.monotonic() + START_BOUND_S
        while _docker("inspect", "-f", "{{.RestartCount}}", name).stdout.strip() in ("", "0"):
            assert time.monotonic() < deadline, "the restart policy never restarted the engine"
            time.sleep(1)
        _wait_healthy(f"http://127.0.0.1:{port}/health", name)
        assert hub.requests == []  # the restarted engine asked the hub for nothing
        assert ref.read_text() == commit
        models = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10).read())
        assert models["data"][0]["id"]
    finally:
        subprocess.run(
            ["docker-compose", "-p", project, "-f", str(compose), "down", "-v", "--remove-orphans"],
            capture_output=True, timeout=300, check=False,
        )  # fmt: skip
        hub.close()
    assert _docker("ps", "-aq", "--filter", f"name={name}").stdout.strip() == ""
