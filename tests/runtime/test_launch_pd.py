"""`m31ctl launch --runtime native` of a P/D plan (issue 36), for real: the CPU rehearsal's pd
variant starts a prefill vLLM and a decode vLLM (the CPU build, NixlConnector over UCX/TCP on
loopback) and vllm-router in front, as one deployment under the plan's name. A greedy
completion is answered through the router, and the decode instance's /metrics show its prompt's
KV came over the wire (m31ctl/served/kv_transfer.py); verify's pd-parity finds the router's greedy
token ids equal to the prefill role's alone (m31ctl/served/pd_parity.py); status lists the group and its two roles;
logs prints each part's; a relaunch changes nothing; stop leaves no process of any part. A
decode that dies while the group starts stops the whole group, with one line naming it.

The tiny model is made as tests/rehearsal/test_rehearsal.py makes it; scripts/pd_group.py proved the pair and
the router natively first (tests/runtime/test_pd_native.py)."""

from __future__ import annotations

import os
import sys
import urllib.parse
import uuid
from pathlib import Path

import pytest

from m31ctl.deployment import derive
from m31ctl.errors import ExitCode
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.served import kv_transfer
from tests.conftest import last_json, run_cli
from tests.ports import free_ports
from tests.support import cli_json
from tests.support.http import metrics_text, request
from tests.support.native import STANDIN
from tests.support.prometheus import PROMETHEUS, all_queries, get, stop, until
from tests.support.prometheus import start as start_prometheus

SERVED = "m31ctl-rehearsal"  # the cpu recipe's model.served_name
# Two vLLM starts one after the other on two shared cores: minutes; a busy machine gets more.
LAUNCH_TIMEOUT_S = 900
PROMPT = "the model serves tokens on four GPUs with sparse attention and a speculative draft; " * 12
# The group is keyed (runtime.api_key=true): the roles want it, the router sends it on, the front
# checks it; m31ctl's own commands read it from the environment as a user's shell would give it.
SECRET = f"pd-key-{uuid.uuid4().hex}"


def _launch_args(name: str, model: Path, vllm_py: str, *extra: str) -> list[str]:
    api, prefill, decode, prefill_side, decode_side = free_ports(5)
    sets = {
        "model.path": str(model),
        "runtime.native_python": vllm_py,
        "disaggregation.prefill.port": prefill,
        "disaggregation.decode.port": decode,
        "disaggregation.prefill.side_channel_port": prefill_side,
        "disaggregation.decode.side_channel_port": decode_side,
    }
    args = [
        "launch",
        "--runtime",
        "native",
        "--hardware",
        "cpu",
        "--variant",
        "pd",
        "--set",
        "runtime.api_key=true",
    ]
    args += ["--name", name, "--port", str(api), "--timeout", str(LAUNCH_TIMEOUT_S), "--json"]
    for key, value in sets.items():
        args += ["--set", f"{key}={value}"]
    return args + list(extra)


def _status(env: dict[str, str]) -> list[dict]:
    shown = run_cli("status", "--runtime", "native", "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    rows: list[dict] = cli_json.data(shown.stdout)["servers"]
    return rows


def _group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (each part is a session, so its group holds vLLM's
    engine core and workers too)."""
    members = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if fields[2] == str(pgid) and fields[0] != "Z":
            members.append(int(proc.name))
    return members


def _completion(base: str) -> dict:
    body = {"model": SERVED, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    answer = request(f"{base}/v1/completions", body, key=SECRET)
    assert answer.status == 200, answer.body[:500]
    return dict(answer.json())


def _the_front_guards_the_router(endpoint: str, router_url: str) -> None:
    """The router's front (issue 49): a completion without the key or with a wrong one is 401,
    worker management through the group's endpoint is 404 with the key or without, and
    vllm-router itself listens on loopback only."""
    assert urllib.parse.urlsplit(router_url).hostname == "127.0.0.1", router_url
    body = {"model": SERVED, "prompt": "hello", "max_tokens": 1}
    for key in (None, "wrong"):
        answer = request(f"{endpoint}/v1/completions", body, key=key)
        assert answer.status == 401, (key, answer.status, answer.body[:200])
    for key in (None, SECRET):
        for path in (
            "/add_worker?url=http://127.0.0.1:9",
            "/workers",
            "/remove_worker?url=http://127.0.0.1:9",
        ):
            answer = request(f"{endpoint}{path}", {} if path != "/workers" else None, key=key)
            assert answer.status == 404, (path, answer.status, answer.body[:200])


def _first_request_crosses(base: str, decode_log: Path) -> None:
    """The pair's first request makes decode's NIXL handshake with prefill, whose reply vLLM 0.32
    waits 5 s for (nixl/base_worker.py `_nixl_handshake`: RCVTIMEO 5000, no setting of its own).
    On this 2-core host prefill's side channel once answered later (CI, a quiet run: decode logged
    "NIXL transfer failure: handshake_failed", zmq.error.Again, and the router answered 500).
    Asked again once for that cause alone, said in the log; any other failure fails. The transfer
    counters the test judges are read after this request."""
    body = {"model": SERVED, "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    answer = request(f"{base}/v1/completions", body, key=SECRET)
    if answer.status == 500 and "NIXL transfer failure: handshake" in decode_log.read_text(errors="replace"):
        print("the first request met vLLM's 5 s NIXL handshake limit (decode's log); asked again")
        answer = request(f"{base}/v1/completions", body, key=SECRET)
    assert answer.status == 200, answer.body[:500]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1800)  # a launch may wait 900 s, then verify, bench and a real Prometheus
def test_pd_launch_serves_through_the_router_and_stops_as_one(vllm_py, tiny_model, tmp_path):
    env = {"M31CTL_STATE_DIR": str(tmp_path / "state"), "VLLM_API_KEY": SECRET}
    name = f"m31ctl-pd-{uuid.uuid4().hex[:6]}"
    # The group's record is its router's front (issue 49), then the router, then the roles.
    parts = [name, f"{name}-router", f"{name}-prefill", f"{name}-decode"]
    args = _launch_args(name, tiny_model, vllm_py)
    pids: list[int] = []
    try:
        launched = run_cli(*args, env=env)
        assert launched.returncode == 0, launched.stderr[-3000:]
        result = last_json(launched.stdout)
        assert result["ready"] and result["action"] == "created" and result["server"] == name, result
        endpoint = result["endpoint"]
        print(f"P/D group ready: router {result['timings_s']['ready']:.1f} s after its start")

        rows = _status(env)
        assert [r["name"] for r in rows] == parts, rows
        assert all(r["state"] == "running" for r in rows), rows
        assert [r["group"] for r in rows] == [None, name, name, name]
        assert rows[0]["endpoint"] == endpoint
        pids = [r["pid"] for r in rows]
        decode_url = rows[3]["endpoint"]
        _the_front_guards_the_router(endpoint, rows[1]["endpoint"])

        _first_request_crosses(endpoint, tmp_path / "state" / "native" / f"{name}-decode.log")
        before = kv_transfer.facts(metrics_text(decode_url))
        answer = _completion(endpoint)
        again = _completion(endpoint)
        assert answer["choices"][0]["text"] and answer["choices"][0]["text"] == again["choices"][0]["text"]
        seen = kv_transfer.since(before, kv_transfer.facts(metrics_text(decode_url)))
        print(f"decode /metrics over two requests through the router: {seen}")
        verdict = kv_transfer.judge(seen)
        assert verdict.came_over_the_wire, verdict.reason
        assert seen.transfers >= 2 and seen.external_prompt_tokens > seen.local_prompt_tokens
        _nixl_queries_answer_from_a_real_prometheus(args, name, tmp_path)

        # The relaunch converges without a change; its preflight's deep checks passed a minute ago
        # on this plan, engine and host (the first launch ran them), so they are skipped here.
        relaunched = run_cli(*args, "--skip-deep", env=env)
        assert relaunched.returncode == 0, relaunched.stderr[-3000:]
        assert last_json(relaunched.stdout)["action"] == "unchanged"

        logs = run_cli("logs", "--runtime", "native", "--name", name, "--tail", "2000", env=env)
        assert logs.returncode == 0, logs.stderr
        for part in parts:
            assert f"==> {part} (" in logs.stdout
        assert "POST /v1/completions" in logs.stdout  # the roles' access lines

        # smoke without --name finds the one group (its parts are not servers of their own).
        smoke = run_cli("smoke", "--runtime", "native", "--json", env=env)
        assert smoke.returncode == 0 and cli_json.data(smoke.stdout)["ok"], smoke.stdout[-2000:]

        # verify's gate on the group: the engine facts from decode's /metrics, and its requests'
        # KV over the wire (the kv-transfer check). --no-load: the two cores serve the group.
        verified = run_cli("verify", "--runtime", "native", "--no-load", "--json", env=env)
        report = cli_json.data(verified.stdout)
        checks = {c["id"]: c for c in report["checks"]}
        assert verified.returncode == 0 and report["ok"], report
        assert checks["kv-transfer"]["status"] == "ok", checks["kv-transfer"]
        assert checks["kv-cache-dtype"]["status"] == "ok", checks["kv-cache-dtype"]
        assert report["facts"]["kv_transfer"]["transfers"] > 0, report["facts"]
        # pd-parity (issue 49): the router's greedy token ids equal prefill's alone, for the
        # longest prompt the plan holds (2,048 - 16: the tiny Llama states no sparse window).
        assert checks["pd-parity"]["status"] == "ok", checks["pd-parity"]
        (compared,) = report["facts"]["pd_parity"]["compared"]
        assert compared["prompt_tokens"] == 2_032 and compared["matched"] == compared["compared"] == 16, (
            compared
        )
        assert report["facts"]["pd_parity"]["kv_transfer"]["external_prompt_tokens"] >= 2_032 - 128
        print(f"pd-parity: {checks['pd-parity']['message']}; {checks['pd-parity-bytes']['message']}")

        # bench on the group: per point, the prompts' KV over NIXL (decode's counters), none failed.
        bench = run_cli(
            "bench", "--runtime", "native", "--concurrency", "2", "--requests", "4", "--output-len", "8", "--json",
            env=env,
        )  # fmt: skip
        (point,) = last_json(bench.stdout)["points"]
        assert bench.returncode == 0 and point["completed"] == 4, bench.stdout[-2000:]
        moved = point["kv_transfer"]
        assert moved["transfers"] >= 4 and moved["failed_transfers"] == 0, moved
        assert moved["external_prompt_tokens"] > moved["local_prompt_tokens"], moved
    finally:
        stopped = run_cli("stop", "--runtime", "native", "--json", env=env)
    assert stopped.returncode == 0, stopped.stderr
    assert cli_json.data(stopped.stdout)["stopped"] == [name]
    assert _status(env) == []
    assert pids and all(_group_members(pid) == [] for pid in pids), "a process of the group survived stop"
    assert sorted(os.listdir(tmp_path / "state" / "native")) == sorted(f"{p}.log" for p in parts)


def _nixl_queries_answer_from_a_real_prometheus(launch_args: list[str], name: str, tmp_path: Path) -> None:
    """The monitoring target rendered for this group's plan, run by a real Prometheus: the
    dashboard's and the alert's NIXL queries (failed KV transfers) return data from the decode
    role (a single server has no connector: tests/render/test_observability.py checks them by
    name only). What they answer is 0 failures, the transfers above having succeeded."""
    if PROMETHEUS is None:
        pytest.fail("no prometheus: scripts/setup-host installs it")
    plan = [a for a in launch_args[launch_args.index("--hardware") :] if a not in ("--json",)]
    plan = plan[: plan.index("--name")] + plan[plan.index("--timeout") + 2 :]
    out = tmp_path / "monitoring"
    sets = [
        "--set",
        f"runtime.container_name={name}",
        "--set",
        f"runtime.port={launch_args[launch_args.index('--port') + 1]}",
    ]
    rendered = run_cli("render", "--target", "monitoring", *plan, *sets, "-o", str(out))
    assert rendered.returncode == 0, rendered.stderr
    d = derive(
        resolve(
            PlanRequest(simulated("cpu"), variant="pd", sets=tuple(a for a in [*plan, *sets] if "=" in a))
        )
    )
    nixl = [(what, expr) for what, expr in all_queries(d) if "vllm:nixl_" in expr]
    assert len(nixl) == 2, nixl  # the dashboard panel and the alert
    (web,) = free_ports(1)
    prometheus = start_prometheus(out, tmp_path, web)  # the rendered files, scraped every second
    try:
        api = f"http://127.0.0.1:{web}/api/v1/query?"
        for what, expr in nixl:
            result = until(
                what, lambda expr=expr: get(api + urllib.parse.urlencode({"query": expr}))["data"]["result"]
            )
            assert [float(sample["value"][1]) for sample in result] == [0.0], (what, result)
    finally:
        stop(prometheus)


def test_a_decode_that_dies_while_the_group_starts_stops_the_group(tmp_path):
    """Decode exits while loading, after prefill is up: launch stops prefill too and says which part
    died (exit 5). Both roles are the stand-in engine (tests/standin_vllm, FAKE_ENGINE_MODE=crash
    for decode): what is proven is the group's handling of a part that dies, which does not need
    a real vLLM to die (before issue 47 a real decode died of a KV cache larger than the host,
    after a real prefill had started: two vLLM starts for this one behaviour)."""
    (tmp_path / "model").mkdir()
    # The native group needs vllm-router beside the engine's Python (it checks before starting
    # anything); this group never reaches its router, so a stub stands there.
    engine_bin = tmp_path / "engine" / "bin"
    engine_bin.mkdir(parents=True)
    (engine_bin / "python").symlink_to(sys.executable)
    (engine_bin / "vllm-router").write_text("#!/bin/sh\nexit 0\n")
    (engine_bin / "vllm-router").chmod(0o755)
    env = {
        "M31CTL_STATE_DIR": str(tmp_path / "state"),
        "PYTHONPATH": str(STANDIN),
        "DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock",
        "VLLM_API_KEY": SECRET,
    }
    name = f"m31ctl-pd-{uuid.uuid4().hex[:6]}"
    args = _launch_args(
        name, tmp_path / "model", str(engine_bin / "python"), "--skip-deep",
        "--set", "disaggregation.decode.env.FAKE_ENGINE_MODE=crash",
    )  # fmt: skip
    try:
        launched = run_cli(*args, env=env)
        assert launched.returncode == ExitCode.NOT_READY, (launched.stdout[-2000:], launched.stderr[-3000:])
        error = launched.stderr.strip().splitlines()[-1]
        print(error)
        assert f"P/D group {name}: {name}-decode exited" in error and "stopped the group" in error, error
        assert f"{name}-prefill" in error
        assert _status(env) == []
    finally:
        run_cli("stop", "--runtime", "native", env=env)
