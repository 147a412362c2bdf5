"""m31ctl bench against real vLLM (the CPU build), natively: a sweep of three concurrencies
gives per-point figures, a frontier, an SLO pick, a plot and a profile that `m31ctl plan -f`
reads back with its provenance; the long-context and agentic workloads run as the server counts
them; an SLO no point meets exits 1 naming the closest point. Small counts, short outputs."""

from __future__ import annotations

import json
import time

import pytest

from tests.conftest import run_cli
from tests.support import cli_json

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _bench(
    plan: list[str], env: dict[str, str], *args: str, bare: bool = False
) -> tuple[int, list[dict], dict]:
    # The server by name: another m31ctl server on this host (a container, say) makes a bare
    # bench refuse to guess which one (exit 6). `bare`: no plan options, the server's recorded plan.
    name = next(a.split("=", 1)[1] for a in plan if a.startswith("runtime.container_name="))
    done = run_cli("bench", *([] if bare else plan), "--name", name, *args, "--json", env=env)
    lines = cli_json.stream(done.stdout)
    assert lines, done.stderr[-2000:]
    return done.returncode, lines[:-1], lines[-1]


def test_bench_sweep_frontier_slo_and_profile(cpu_server, tmp_path):
    """On the session's shared server (tests/support/servers.py)."""
    env, plan, tiny_model = cpu_server.env, list(cpu_server.plan), cpu_server.model
    png, profile, saved = tmp_path / "frontier.png", tmp_path / "measured.yaml", tmp_path / "bench.json"
    started = time.monotonic()
    code, events, report = _bench(
        plan, env, "--concurrency", "1,2,4", "--requests", "4", "--output-len", "8",
        "--slo", "tpot_p99_ms=1000", "--plot", str(png), "--write-profile", str(profile), "-o", str(saved),
        "--gpu-hour", "2.5",
    )  # fmt: skip
    print(f"sweep of 3 points: {time.monotonic() - started:.1f} s (report: {report['wall_s']} s)")
    assert code == 0, report
    assert [e["event"] for e in events] == ["point-start", "point"] * 3
    assert report["server_plan_hash"] == report["plan_hash"] and report["token_counts"] == "server"
    for p in report["points"]:
        print(
            f"c={p['concurrency']}: {p['tok_s_per_user']} tok/s/user, {p['tok_s_per_gpu']} tok/s/GPU, "
            f"TTFT p99 {p['ttft_p99_ms']:.1f} ms, TPOT p99 {p['tpot_p99_ms']:.2f} ms"
        )
        assert p["completed"] == p["requests"] == 4 and p["failed"] == 0 and p["error"] is None
        assert p["tok_s_per_user"] > 0 and p["tok_s_per_gpu"] > 0 and p["mean_output_tokens"] == 8
        assert 0 < p["ttft_p50_ms"] <= p["ttft_p99_ms"] and 0 < p["tpot_p50_ms"] <= p["tpot_p99_ms"]
        assert p["goodput_share"] == 1.0  # a 1 s TPOT limit: every request meets it
        assert p["spec"] is None  # the rehearsal plan does not speculate
    assert [p["concurrency"] for p in report["points"]] == [1, 2, 4]
    assert report["frontier"] and set(report["frontier"]) <= {1, 2, 4}
    chosen = report["choice"]["concurrency"]
    best = max(report["points"], key=lambda p: p["tok_s_per_gpu"])
    assert chosen == best["concurrency"] and chosen in report["frontier"]
    assert json.loads(saved.read_text())["choice"] == report["choice"]
    assert png.stat().st_size > 10_000
    # Cost from each point's own measured throughput: 2.5 an hour for the plan's one "GPU".
    for p in report["points"]:
        assert p["cost"]["per_million_output"] == pytest.approx(2.5e6 / (p["output_tok_s"] * 3600), rel=1e-5)
        assert p["cost"]["per_million_total"] == pytest.approx(2.5e6 / (p["total_tok_s"] * 3600), rel=1e-5)
    assert f"# cost: assumed 2.5 USD per GPU-hour on {report['measured_at'][:10]}" in profile.read_text()
    # The profile is a plan layer: max_num_seqs from the point, its provenance shown by --explain.
    read_back = run_cli("plan", *plan, "-f", str(profile), "--json", env=env)
    assert read_back.returncode == 0, read_back.stderr
    resolved = cli_json.data(read_back.stdout)
    assert resolved["settings"]["serving"]["max_num_seqs"] == chosen
    assert resolved["settings"]["verify"]["concurrency"] == chosen
    assert resolved["settings"]["verify"]["tpot_p99_ms"] == 1000
    source = resolved["provenance"]["serving.max_num_seqs"]
    assert source.startswith(f"measured by m31ctl bench on {report['measured_on']}, ")
    explained = run_cli("plan", *plan, "-f", str(profile), "--explain", env={**env, "COLUMNS": "300"})
    assert "measured by m31ctl bench on" in explained.stdout

    # Long inputs near the 2048-token max length, as the server counts them, all served.
    code, _events, long_report = _bench(
        plan, env, "--workload", "long-context", "--concurrency", "2", "--requests", "2"
    )
    (only,) = long_report["points"]
    assert code == 0 and only["completed"] == 2, only
    assert 0.9 * 2048 < only["mean_input_tokens"] + only["mean_output_tokens"] <= 2048
    # Agentic sessions: a shared prefix growing each turn. A bare bench (no plan options)
    # reads the server with the plan it was launched with, as verify does: no host probe.
    code, _events, agent_report = _bench(
        plan, env, "--workload", "agentic", "--concurrency", "2", "--requests", "4", bare=True
    )
    assert code == 0 and agent_report["points"][0]["completed"] == 4
    assert agent_report["plan_hash"] == agent_report["server_plan_hash"] == report["plan_hash"]
    assert agent_report["model"]["path"] == str(tiny_model) and not agent_report["warnings"]
    # An SLO no point meets: exit 1, the closest named; the baseline compares the same point.
    code, _events, failed = _bench(
        plan, env, "--concurrency", "2", "--requests", "4", "--output-len", "8",
        "--slo", "ttft_p99_ms=0.001", "--baseline", str(saved), "--tolerance", "10",
    )  # fmt: skip
    assert code == 1, failed
    assert failed["choice"]["concurrency"] is None and failed["choice"]["closest"] == 2
    assert failed["choice"]["reason"].startswith("no point meets the SLO; closest: concurrency 2 (p99 TTFT")
    # The same point compared; what got worse is the machine's business (a CPU stream that
    # arrived in one burst has a p99 TPOT near 0, the next run's may not), not asserted.
    assert failed["regressions"]["compared_points"] == 1 and failed["regressions"]["tolerance"] == 10.0
    assert all(line.startswith("concurrency 2: ") for line in failed["regressions"]["worse"])
