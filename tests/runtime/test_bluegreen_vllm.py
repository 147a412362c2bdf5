"""launch --blue-green against real vLLM, on the session's shared CPU server (tests/support/
servers.py) and starting no engine of its own: the plan it runs, asked again blue-green, is
unchanged (its recorded plan compared across slots), and the gate a switch runs (verify's checks,
without the load) passes on it, which the stand-in engine had to be taught
(tests/runtime/gated_standin). Its own cost: 0.5 s measured beside the shared server (whose start,
about 47 s here, the session pays once)."""

from __future__ import annotations

import pytest

from m31ctl.cli.launch_views import verify_gate
from m31ctl.runtime import running_server
from m31ctl.runtime.planrecord import recorded_deployment
from tests.conftest import last_json, run_cli


@pytest.mark.vllm
@pytest.mark.slow
def test_real_vllm_passes_the_gate_and_its_plan_is_unchanged(cpu_server, monkeypatch):
    again = run_cli(
        "launch", "--runtime", "native", *cpu_server.plan, "--blue-green", "--gate-no-load", "--json",
        env=cpu_server.env,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    result = last_json(again.stdout)
    assert (result["action"], result["server"], result["rollout"]) == ("unchanged", cpu_server.name, None)
    assert result["endpoint"] == cpu_server.url and "serves this plan already" in again.stderr

    monkeypatch.setenv("M31CTL_STATE_DIR", cpu_server.env["M31CTL_STATE_DIR"])
    server = running_server(cpu_server.name, "native")
    assert server.plan is not None
    verdict = verify_gate(no_load=True)(recorded_deployment(server.plan), "native")
    assert verdict.ok, verdict.failed
    assert {"plan", "chat", "stream", "structured-output", "max-model-len", "kv-cache-dtype"} <= set(
        verdict.checks
    )
