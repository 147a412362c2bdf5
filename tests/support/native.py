"""A native server of the stand-in engine (tests/standin_vllm, found as `python -m
vllm.entrypoints.openai.api_server` through PYTHONPATH) for a test that launches, stops or
interrupts one: its own state directory, name and port, the engines serving that port, and
whether a process (or a process group) is gone."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

from tests.conftest import ROOT
from tests.ports import free_port

STANDIN = ROOT / "tests" / "standin_vllm"


class Native:
    """One test's native server: its own state directory, name and port."""

    def __init__(self, tmp_path: Path) -> None:
        self.state = tmp_path / "state"
        self.model = tmp_path / "model"
        self.model.mkdir()
        self.name = f"m31ctl-faults-{uuid.uuid4().hex[:6]}"
        self.port = free_port()
        self.env = {
            "M31CTL_STATE_DIR": str(self.state),
            "PYTHONPATH": str(STANDIN),
            "DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock",
        }

    def args(self, *extra: str, delay: float = 0.2, timeout: int = 60) -> list[str]:
        return [
            "launch", "--hardware", "cpu", "--runtime", "native", "--name", self.name,
            "--port", str(self.port), "--set", f"model.path={self.model}", "--timeout", str(timeout),
            "--set", f"runtime.env.FAKE_ENGINE_DELAY={delay}", "--skip-deep", *extra,
        ]  # fmt: skip

    @property
    def record(self) -> Path:
        return self.state / "native" / f"{self.name}.json"

    def engines(self) -> list[int]:
        """Pids of live stand-in engines serving this test's port (whoever started them)."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
            except OSError:
                continue
            if (
                b"vllm.entrypoints.openai.api_server" in argv
                and str(self.port).encode() in argv
                and state != "Z"
            ):
                found.append(int(entry.name))
        return found

    def temp_files(self) -> list[Path]:
        directory = self.state / "native"
        return sorted(directory.glob("*.tmp")) if directory.is_dir() else []


def gone(pid: int, within: float = 60.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def group(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if proc.name.isdigit() and fields[2] == str(pgid) and fields[0] != "Z":
            found.append(int(proc.name))
    return found
