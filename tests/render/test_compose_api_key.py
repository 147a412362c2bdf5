"""The API key reaches a Compose engine as a file, never as an environment value (issue 53): what
`docker-compose config` prints and what `docker inspect` of the started engine shows hold no key,
the engine's own process gets it, and a missing or empty file never yields a server without auth.

The start (targets.API_KEY_START) is checked under the shells the images run (dash, the /bin/sh
of the Debian and Ubuntu based vLLM images; busybox's ash, the stand-in engine's); the whole file
with the real docker-compose on the stand-in engine (tests/engine_image), given the entrypoint the
vLLM images have, `vllm serve`, by a derived image built here in a second."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from m31ctl.render.targets import API_KEY_START, api_key_entrypoint
from tests.conftest import run_cli
from tests.ports import free_port

CANARY = "m31ctl-canary-api-key-7d41c2"
SHELLS = [s for s in ("/bin/dash", "/bin/busybox") if Path(s).exists()]
FAILED = "is missing, unreadable or empty: the plan requires VLLM_API_KEY"


def _start(shell: str, key_file: Path, command: list[str]) -> subprocess.CompletedProcess[str]:
    """The rendered entrypoint with `shell` for /bin/sh and `key_file` for the mounted secret."""
    entrypoint = api_key_entrypoint("VLLM_API_KEY", ())
    assert entrypoint[:3] == ["/bin/sh", "-c", API_KEY_START]
    argv = [shell, *(["sh"] if shell.endswith("busybox") else []), *entrypoint[1:]]
    argv[argv.index("/run/secrets/vllm_api_key")] = str(key_file)
    return subprocess.run(
        [*argv, *command], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=10
    )


@pytest.mark.parametrize("shell", SHELLS)
def test_the_start_exports_the_key_and_execs_the_command_unchanged(shell: str, tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text(CANARY + "\n")  # `echo KEY > FILE`: the line break is not part of the key
    # What the image's entrypoint would get: the words verbatim, none expanded or split.
    words = ["a b", "$(id)", "'", ""]
    done = _start(shell, key_file, ["/bin/sh", "-c", 'printf "%s|" "$VLLM_API_KEY" "$@"', "engine", *words])
    assert done.returncode == 0, done.stderr
    assert done.stdout == "|".join([CANARY, *words]) + "|"


@pytest.mark.parametrize("shell", SHELLS)
@pytest.mark.parametrize("content", [None, "", "\n", "directory"])
def test_a_missing_or_empty_key_file_stops_the_start_with_one_line(
    shell: str, content: str | None, tmp_path: Path
) -> None:
    key_file = tmp_path / "key"
    if content == "directory":  # what a missing secret file was mounted as in issue 39's runs
        key_file.mkdir()
    elif content is not None:
        key_file.write_text(content)
    ran = tmp_path / "ran"
    done = _start(shell, key_file, ["/bin/sh", "-c", 'touch "$1"', "engine", str(ran)])
    assert done.returncode == 1 and not ran.exists()  # the engine never started
    assert (
        done.stderr.count("\n") == 1 and FAILED in done.stderr and "M31CTL_API_KEY_FILE=PATH" in done.stderr
    )


# --- the real docker-compose ------------------------------------------------------------------

# `vllm serve` for the stand-in engine, as vllm/vllm-openai's ENTRYPOINT ["vllm", "serve"]: it
# publishes the SHA-256 of the key its process got (never the key), then runs engine.sh.
VLLM_STANDIN = """#!/bin/sh
[ "$1" = serve ] || { echo "stand-in vllm: serve only" >&2; exit 2; }
shift
printf '%s' "${VLLM_API_KEY:-}" | sha256sum | cut -d' ' -f1 > /www/key.sha256
exec /bin/sh /engine.sh "$@"
"""
VLLM_SERVE_IMAGE = "m31ctl-test/engine:vllm-serve"


@pytest.fixture(scope="module")
def vllm_serve_image() -> str:
    from m31ctl.runtime.engine_api import connect
    from tests.dockerlib import build_engine_images

    client = connect()
    base = build_engine_images(client)["ready"]
    with tempfile.TemporaryDirectory() as tmp:
        context = Path(tmp)
        (context / "vllm").write_text(VLLM_STANDIN)
        (context / "Dockerfile").write_text(
            f'FROM {base}\nCOPY vllm /bin/vllm\nRUN ["/bin/chmod", "755", "/bin/vllm"]\nENTRYPOINT ["vllm", "serve"]\n'
        )
        client.images.build(path=str(context), tag=VLLM_SERVE_IMAGE, rm=True)
    return VLLM_SERVE_IMAGE


def _compose(project: str, path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker-compose", "-p", project, "-f", str(path), *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(path.parent), **env},
        timeout=120,
        check=False,
    )


def _get(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return str(answer.read().decode())
    except OSError:
        return None


@pytest.mark.docker
def test_compose_config_and_docker_inspect_never_show_the_key(vllm_serve_image: str, tmp_path: Path) -> None:
    name = f"m31ctl-key-{uuid.uuid4().hex[:6]}"
    project = name.replace("-", "")
    port = free_port()
    model = tmp_path / "model"
    model.mkdir()
    rendered = run_cli(
        "render", "--target", "compose", "--hardware", "cpu",
        "--set", f"engine.image={vllm_serve_image}", "--set", f"model.path={model}",
        "--set", "runtime.api_key=true", "--set", f"runtime.container_name={name}",
        "--set", f"runtime.port={port}", "--set", "runtime.env.FAKE_ENGINE_DELAY=0",
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    compose = tmp_path / "compose.yaml"
    compose.write_text(rendered.stdout)
    key_file = tmp_path / "api-key"
    key_file.write_text(CANARY + "\n")
    key_file.chmod(0o600)
    # An exported VLLM_API_KEY is not what the file reads: without the key file Compose refuses.
    refused = _compose(project, compose, {"VLLM_API_KEY": CANARY}, "config")
    assert refused.returncode != 0 and "the plan requires VLLM_API_KEY" in refused.stderr
    assert CANARY not in refused.stdout + refused.stderr
    env = {"M31CTL_API_KEY_FILE": str(key_file), "VLLM_API_KEY": CANARY}
    try:
        config = _compose(project, compose, env, "config")
        assert config.returncode == 0, config.stderr
        assert str(key_file) in config.stdout and CANARY not in config.stdout + config.stderr
        up = _compose(project, compose, env, "up", "-d")
        assert up.returncode == 0, up.stderr
        deadline = time.monotonic() + 60
        while (digest := _get(f"http://127.0.0.1:{port}/key.sha256")) is None or _get(
            f"http://127.0.0.1:{port}/health"
        ) is None:
            assert time.monotonic() < deadline, subprocess.run(
                ["docker", "logs", name], capture_output=True, text=True
            )
            time.sleep(0.5)
        # The engine's own process got the key (its digest), started by the image's `vllm serve`...
        assert digest.strip() == hashlib.sha256(CANARY.encode()).hexdigest()
        # ...and what Docker keeps of the container (environment, entrypoint, args, mounts) has none.
        inspect = subprocess.run(["docker", "inspect", name], capture_output=True, text=True, check=True)
        assert CANARY not in inspect.stdout and "/run/secrets/vllm_api_key" in inspect.stdout
        assert _compose(project, compose, env, "down", "-t", "5").returncode == 0

        # A key file that is empty: the engine exits at once, saying so, and never serves.
        key_file.write_text("")
        up = _compose(project, compose, env, "up", "-d")
        assert up.returncode == 0, up.stderr
        deadline = time.monotonic() + 30
        while (
            FAILED
            not in (logs := subprocess.run(["docker", "logs", name], capture_output=True, text=True)).stderr
        ):
            assert time.monotonic() < deadline, logs
            time.sleep(0.5)
        assert _get(f"http://127.0.0.1:{port}/health") is None
        assert "Application startup complete" not in logs.stdout + logs.stderr
    finally:
        _compose(project, compose, env, "down", "-v", "--remove-orphans", "-t", "5")
    assert (
        shutil.which("docker")
        and not subprocess.run(
            ["docker", "ps", "-aq", "--filter", f"name={name}"], capture_output=True, text=True
        ).stdout.strip()
    )
