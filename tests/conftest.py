from __future__ import annotations

import contextlib
import functools
import io
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
SHARED_GPU = ROOT.parent / "shared" / "fixtures" / "gpu"


class _Stdin(io.StringIO):
    def isatty(self) -> bool:
        return False  # tests are never a terminal: confirmations answer no


@contextlib.contextmanager
def _patched_environ(env: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_cli(
    *args: str, env: dict[str, str] | None = None, input: str | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run m31ctl in this process through `m31ctl.cli.main(argv)`, capturing what it prints and
    its exit code; the result has the shape of a finished process."""
    from m31ctl.cli import main

    out, err = io.StringIO(), io.StringIO()
    old_cwd = os.getcwd()
    with (
        _patched_environ({"COLUMNS": "200", **(env or {})}),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        old_stdin = sys.stdin
        sys.stdin = _Stdin(input or "")
        try:
            if cwd is not None:
                os.chdir(cwd)
            code = main(list(args))
        finally:
            sys.stdin = old_stdin
            os.chdir(old_cwd)
    return subprocess.CompletedProcess(["m31ctl", *args], code, out.getvalue(), err.getvalue())


def run_cli_process(
    *args: str, env: dict[str, str] | None = None, input: str | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run m31ctl as a whole process (`python -m m31ctl`): for what only a process shows
    (signals, closed pipes, start-up)."""
    full_env = {**os.environ, "COLUMNS": "200", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "m31ctl", *args],
        capture_output=True,
        text=True,
        env=full_env,
        input=input,
        cwd=cwd,
        timeout=120,
        check=False,
    )


@pytest.fixture
def cli():
    return run_cli


def _gpu_present() -> bool:
    from m31ctl.probe import detect

    try:
        return detect().hardware.count > 0
    except Exception:
        return False


def _docker_reachable() -> bool:
    try:
        from m31ctl.runtime.engine_api import connect

        connect(timeout=3)
        return True
    except Exception:
        return False


def pytest_configure(config: pytest.Config) -> None:
    """The session's own state root unless the caller set one: what m31ctl keeps between runs
    (native records, triage bundles) never comes from the user's home or an earlier run."""
    if "M31CTL_STATE_DIR" not in os.environ:
        import tempfile

        os.environ["M31CTL_STATE_DIR"] = tempfile.mkdtemp(prefix="m31ctl-test-state-")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip GPU tests without a GPU. Docker tests skip without an engine, except in CI,
    where .ci/run starts one: there a missing engine is a failure, not a silent skip. Then the
    order: the quick tests first, the real engines after them, and the tests that need the
    rehearsal image last (scripts/test builds it meanwhile): a stable sort, so each group keeps
    the order the files give."""
    needs_gpu = any("gpu" in item.keywords for item in items)
    needs_docker = any("docker" in item.keywords for item in items)
    gpu = _gpu_present() if needs_gpu else False
    docker = _docker_reachable() if needs_docker else False
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="no GPU on this host (runs on the device host)"))
        if "docker" in item.keywords and not docker and os.environ.get("CI") != "true":
            item.add_marker(
                pytest.mark.skip(reason="no Docker Engine reachable (scripts/setup-host starts one)")
            )
    items.sort(key=_weight)


def _weight(item: pytest.Item) -> int:
    # A real engine in Docker is the rehearsal image's vLLM.
    if "rehearsal_image" in getattr(item, "fixturenames", ()) or {"docker", "vllm"} <= set(item.keywords):
        return 3
    if "vllm" in item.keywords:
        return 2
    return 1 if "docker" in item.keywords or "slow" in item.keywords else 0


REHEARSAL_IMAGE = "m31ctl/vllm-cpu:0.32.0"  # scripts/build-rehearsal-image; the cpu recipe's engine.image
IMAGE_BUILD_WAIT_S = 1200.0  # the build takes about 4 minutes here, longer on a busy host


@pytest.fixture(scope="session")
def rehearsal_image() -> str:
    """The CPU rehearsal image. scripts/test builds it while the quick tests run and writes the
    outcome to $M31CTL_IMAGE_STATUS: the first test that needs it waits for that. Missing, it
    fails the test under CI (a silent skip would hide a dozen unproven behaviours) and skips it
    elsewhere, saying how to build it."""
    import time

    status_file = os.environ.get("M31CTL_IMAGE_STATUS")
    if status_file:
        deadline = time.monotonic() + IMAGE_BUILD_WAIT_S
        while not Path(status_file).exists() and time.monotonic() < deadline:
            time.sleep(2)
        status = Path(status_file).read_text().strip() if Path(status_file).exists() else "still building"
        if status != "ok":
            _missing(f"the rehearsal image build: {status}")
    from m31ctl.runtime import engine_api

    if engine_api.local_image(engine_api.connect(timeout=30), REHEARSAL_IMAGE) is None:
        _missing(f"{REHEARSAL_IMAGE} is not here (scripts/build-rehearsal-image builds it)")
    return REHEARSAL_IMAGE


def _missing(what: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI must run the rehearsal image's tests: {what}")
    pytest.skip(what)


@functools.cache
def _vllm_env(what: str) -> str:
    """scripts/vllm-env's answer (`dir` or `python`): the one place that says where the tests'
    vLLM lives (outside the clone, keyed by its pins; M31CTL_VLLM_VENV names another)."""
    return subprocess.run(
        [str(ROOT / "scripts" / "vllm-env"), what], capture_output=True, text=True, check=True
    ).stdout.strip()


def vllm_python() -> str | None:
    """The tests' Python with real vLLM, once scripts/setup-vllm has made it."""
    candidate = _vllm_env("python")
    return candidate if Path(candidate).exists() else None


@pytest.fixture(scope="session")
def vllm_py() -> str:
    python = vllm_python()
    if python is None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the vLLM tests: scripts/setup-vllm made no {_vllm_env('dir')}")
        pytest.skip(f"no Python with vLLM at {_vllm_env('dir')} (scripts/setup-vllm makes it)")
    return python


def make_tiny_model(directory: Path, *extra: str, python: str | None = None) -> Path:
    """The rehearsal's tiny model (m31ctl/rehearsal/make_tiny_model.py, `extra` its options) made in
    `directory` by vLLM's Python, readable by a container's user when it is mounted."""
    import subprocess

    made = subprocess.run(
        [python or vllm_python() or "python3", str(ROOT / "m31ctl" / "rehearsal" / "make_tiny_model.py"),
         str(directory), *extra],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if made.returncode != 0:
        raise RuntimeError(f"make_tiny_model.py exited {made.returncode}: {made.stderr[-2000:]}")
    for path in [directory.parent, directory, *directory.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return directory


@pytest.fixture(scope="session")
def tiny_models(vllm_py: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The session's one tiny-model factory: `tiny_models(*options)` makes the rehearsal's tiny
    model with make_tiny_model.py's options once and hands the same directory to every test that
    asks for those options (the tests only read it; each making its own cost a vLLM import)."""
    made: dict[tuple[str, ...], Path] = {}

    def factory(*options: str) -> Path:
        if options not in made:
            name = "tiny-model" + "".join(o.strip("-") for o in options)
            made[options] = make_tiny_model(tmp_path_factory.mktemp("tiny") / name, *options, python=vllm_py)
        return made[options]

    return factory


@pytest.fixture(scope="session")
def tiny_model(tiny_models: Any) -> Path:
    """The tiny Llama most tests serve (4 attention heads, 4 KV heads, 2048 positions)."""
    return Path(tiny_models())


@pytest.fixture(scope="session")
def cpu_server(vllm_py: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One aggregated CPU server for the session, launched by m31ctl natively (tests/support/
    servers.py): the tests that only read a server share it; stopped, and stop's promise checked,
    when the session ends."""
    from tests.support.servers import launch_cpu_server, stop_and_check

    server = launch_cpu_server(tiny_model, vllm_py, tmp_path_factory.mktemp("cpu-server") / "state")
    try:
        yield server
    finally:
        stop_and_check(server)


def last_json(stdout: str) -> Any:
    """The result object of a JSON Lines stream (launch --json prints phase events first)."""
    from tests.support.cli_json import data

    return data(stdout)


# The commit the tests pin a rendered hub checkpoint at: the goldens carry this one.
PINNED_COMMIT = "0123456789abcdef0123456789abcdef01234567"
# An endpoint nothing listens on (port 9, discard, is closed here): `render` and `lock` never ask
# the hub (m31ctl/revision.py), so they must work with HF_ENDPOINT pointing at it.
CLOSED_HUB = "http://127.0.0.1:9"


@pytest.fixture(scope="session", autouse=True)
def no_hub() -> Iterator[str]:
    """HF_ENDPOINT at CLOSED_HUB for the whole session unless a test sets its own (the tests that
    download start a stand-in hub, tests/standin_hub.py): the real hub is not reachable here."""
    saved = os.environ.get("HF_ENDPOINT")
    os.environ.setdefault("HF_ENDPOINT", CLOSED_HUB)
    try:
        yield os.environ["HF_ENDPOINT"]
    finally:
        if saved is None:
            os.environ.pop("HF_ENDPOINT", None)
