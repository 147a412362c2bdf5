"""The native runtime keeps one log per server name and appends each start to it. On the H200
(scripts/bench_launch_native.py, 2026-12-03) every relaunch reported "phase: serving (0.0 s)"
before the engine had printed a line: readiness read the previous start's "Application startup
complete". A launch's handle now reads only what its own start wrote."""

from __future__ import annotations

from types import SimpleNamespace

from m31ctl.runtime.native import LOG_BLOCK, ProcessHandle
from m31ctl.runtime.phases import Phase, latest_phase

# Lines as vLLM 0.26 printed them there (tests/fixtures/gpu/h200-vllm026/engine-*.log).
LAST_START = (
    "(APIServer pid=959) INFO 12-03 13:37:10 [entrypoints/openai/api_server.py:677] Starting vLLM server on http://127.0.0.1:8000\n"
    "(APIServer pid=959) INFO:     Application startup complete.\n"
)
THIS_START = "(APIServer pid=1496) INFO 12-03 13:39:02 [utils/argparse_utils.py:460] non-default args: {}\n"


def _handle(log, since: int) -> ProcessHandle:
    server = SimpleNamespace(name="m31ctl-rehearsal", log=str(log))
    return ProcessHandle(server, None, since=since)  # type: ignore[arg-type]


def test_a_relaunch_reads_only_its_own_start(tmp_path):
    log = tmp_path / "m31ctl-rehearsal.log"
    log.write_text(LAST_START)
    since = log.stat().st_size  # the new engine has not written a line yet: readiness's first look
    assert latest_phase(_handle(log, 0).log_tail(200)) is Phase.SERVING  # what it read before
    assert _handle(log, since).log_tail(200).strip() == ""
    with log.open("a") as out:
        out.write(THIS_START)
    assert latest_phase(_handle(log, since).log_tail(200)) is Phase.STARTING
    with log.open("a") as out:
        out.write(LAST_START.replace("959", "1496"))
    assert latest_phase(_handle(log, since).log_tail(200)) is Phase.SERVING


def test_a_log_cut_shorter_since_is_read_whole(tmp_path):
    """Rotated or truncated under us: the offset is past its end, so all of it is this start's."""
    log = tmp_path / "m31ctl-rehearsal.log"
    log.write_text(THIS_START)
    assert _handle(log, 10**6).log_tail(200) == THIS_START


def test_a_long_tail_reaches_past_one_block(tmp_path):
    """`logs --tail 5000` after a crash: the engine's start, then far more than one read-back block
    of tracebacks (CI's soak saw no start in a 64 KiB window). Every asked-for line comes back."""
    log = tmp_path / "m31ctl-rehearsal.log"
    traceback = (
        "(APIServer pid=1496) ERROR 12-03 13:40:00 [async_llm.py:1] EngineDeadError: " + "x" * 120 + "\n"
    )
    log.write_text(LAST_START + traceback * 2000)
    assert log.stat().st_size > 4 * LOG_BLOCK
    tail = _handle(log, 0).log_tail(5000)
    assert tail.count("Starting vLLM server on") == 1 and tail.count("EngineDeadError") == 2000
    assert _handle(log, 0).log_tail(3) == traceback * 3
