"""The soak's short version (scripts/soak.py; the long one is a script, run by hand): both runtimes
at once, real vLLM on the CPU under load, one real kill -9 of the engine each. Docker's restart
policy must bring the container back, the native runtime must say it is gone and come back on
the next launch, no request may fail outside an outage, and `stop` must leave no container,
network, process or state file. Its outcome does not hang on this machine's speed: recovery has
a 600 s bound (about a minute is usual here), and the figures are printed, not asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT


@pytest.mark.docker
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1900)  # the soak itself is bounded at 1,800 s
def test_short_soak_recovers_from_a_killed_engine_and_stop_leaves_nothing(
    vllm_py, tiny_model, tmp_path, rehearsal_image
):
    report_path = tmp_path / "soak.json"
    done = subprocess.run(
        [
            sys.executable, str(ROOT / "scripts" / "soak.py"), "--parallel", "--duration", "10",
            "--interval", "5", "--concurrency", "2", "--model", str(tiny_model), "--vllm-python", vllm_py,
            "-o", str(report_path),
        ],
        capture_output=True, text=True, timeout=1800, check=False, cwd=ROOT,
    )  # fmt: skip
    print(done.stderr)
    reports = {r["runtime"]: r for r in json.loads(report_path.read_text())["soak"]}
    assert set(reports) == {"docker", "native"}, done.stderr
    for runtime, report in reports.items():
        assert report["problems"] == [], (runtime, report)
        assert report["faults"] and all(f["recovered_s"] is not None for f in report["faults"])
        assert report["load"]["succeeded"] > 0 and report["load"]["failed_outside_outages"] == 0
        assert report["left"]["processes"] == [] and report["left"]["state_files"] == []
        # `logs` answers after the faults with the engine's start since the last one in its tail.
        assert report["logs"]["exit"] == 0 and report["logs"]["server_starts"] >= 1, (runtime, report["logs"])
    docker = reports["docker"]
    assert docker["left"]["containers"] == [] and docker["left"]["networks"] == []
    # Docker keeps a restarted container's earlier output: every start is in `logs`.
    assert docker["logs"]["server_starts"] >= 1 + len(docker["faults"])
    # The restart policy restarted it: status counted the restart during the outage.
    assert any(seen.get("restart_count", 0) >= 1 for seen in docker["faults"][0]["status_seen"])
    native = reports["native"]
    # The README's native promise: status tells it is not running, and the next launch recreates it.
    assert any(seen.get("state") == "exited" for seen in native["faults"][0]["status_seen"])
    assert native["faults"][0]["relaunch"]["exit"] == 0
    assert native["faults"][0]["relaunch"]["action"] == "recreated"
    assert done.returncode == 0, done.stderr
