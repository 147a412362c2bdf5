"""`logs --follow` of a native P/D group (issue 49): every part's log, each addition under its
part's name, as `tail -f` of several files prints them; before, it followed the group's own
record's log, which since the router's front is the front's alone (a line at start)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from m31ctl.runtime.native_state import follow_logs


class _Alive:
    def __init__(self) -> None:
        self.until = time.monotonic() + 30
        self.ended = threading.Event()

    def alive(self) -> bool:
        return not self.ended.is_set() and time.monotonic() < self.until


def test_follow_reads_what_each_part_adds_under_its_name(tmp_path: Path):
    logs = {name: tmp_path / f"{name}.log" for name in ("g-router", "g-prefill", "g-decode", "g")}
    for name, path in logs.items():
        path.write_text(f"{name} before the follow\n")  # the tail's, not the follow's
    server = _Alive()
    written: list[str] = []

    def append() -> None:
        time.sleep(0.5)
        with open(logs["g-decode"], "a") as f:
            f.write("decode: POST /v1/completions 200\n")
        time.sleep(0.5)
        with open(logs["g-router"], "a") as f:
            f.write("router: forwarded\n")
        time.sleep(0.5)
        server.ended.set()

    threading.Thread(target=append, daemon=True).start()
    follow_logs(server, [(name, str(path)) for name, path in logs.items()], written.append)  # type: ignore[arg-type]
    assert "".join(written) == (
        "==> g-decode <==\ndecode: POST /v1/completions 200\n==> g-router <==\nrouter: forwarded\n"
    )


def test_one_log_needs_no_header(tmp_path: Path):
    log = tmp_path / "engine.log"
    log.write_text("")
    server = _Alive()
    written: list[str] = []

    def append() -> None:
        time.sleep(0.4)
        with open(log, "a") as f:
            f.write("ready\n")
        time.sleep(0.5)
        server.ended.set()

    threading.Thread(target=append, daemon=True).start()
    follow_logs(server, [("", str(log))], written.append)  # type: ignore[arg-type]
    assert written == ["ready\n"]
