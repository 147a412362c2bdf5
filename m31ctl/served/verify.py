"""`m31ctl verify`: prove that a running server is the plan's server, that it works, and that it
is fast enough, with vLLM's own benchmark. This module runs the checks, in the order a report
lists them: the plan's hash, smoke's checks, the function checks (verify_answers.py), the facts
the engine reports (verify_facts.py), the load and its regression (verify_load.py) and, for a P/D
group, the router's completions against prefill's alone past the sparse window (pd_parity.py)
and the KV transfers (kv_transfer.py), all into one VerifyReport (verified.py).

Function: a chat completion and a streamed one (smoke's checks), structured output, and a tool
call, the reasoning split and an image input where the plan configures them. Facts: the served
model, its max length, the KV cache dtype, block size and size the engine reports on /metrics, and
speculative decoding's acceptance, each compared with the plan. Load: `vllm bench serve` (the
engine's own) with the plan's `verify` settings; its pass marks gate. Regression: against an
earlier report. Every answer is read defensively (http_answers.py): a broken or hostile server
fails a check, it does not crash verify.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx

from m31ctl.deployment import Deployment
from m31ctl.errors import CheckFailed
from m31ctl.runtime.load_run import BenchRunner
from m31ctl.served import kv_transfer, pd_parity, prometheus, smoke
from m31ctl.served.target import Target
from m31ctl.served.verified import VerifyReport
from m31ctl.served.verify_answers import (
    check_image,
    check_reasoning,
    check_structured,
    check_tool_call,
    random_weights,
    text_only_checkpoint,
)
from m31ctl.served.verify_facts import check_served_facts, check_spec_decode
from m31ctl.served.verify_load import check_load, check_regression

__all__ = ["run", "run_target"]


def run(
    deployment: Deployment,
    base: str,
    *,
    engine_base: str | None = None,
    prefill_base: str | None = None,
    server_plan_hash: str | None,
    bench: BenchRunner | None,
    baseline: Mapping[str, Any] | None = None,
    tolerance: float = 0.25,
) -> VerifyReport:
    plan = deployment.plan
    report = VerifyReport(base, plan.hash)
    served = plan.settings.model.served_name
    if server_plan_hash is not None:
        report.check(
            "plan",
            server_plan_hash == plan.hash,
            f"the server runs plan {server_plan_hash}; verifying plan {plan.hash}",
        )
    # What the engine itself says (/metrics: KV cache, speculative counters, KV transfers) comes
    # from the engine at `engine_base` (Target.engine_base): a P/D group's decode role.
    engine = deployment.answering_engine
    metrics_base = engine_base or base
    with (
        httpx.Client(base_url=base, headers=smoke.auth_headers(), timeout=120.0) as client,
        httpx.Client(base_url=metrics_base, headers=smoke.auth_headers(), timeout=120.0) as metrics,
    ):
        transfers_before = (
            kv_transfer.facts_of(prometheus.scrape(metrics)) if deployment.disaggregated else None
        )
        noise = random_weights(deployment)
        _basic(base, served, report)
        check_structured(client, served, report, noise)
        check_tool_call(client, plan, report, noise)
        check_reasoning(client, plan, report, noise)
        check_image(client, plan, report, text_only_checkpoint(deployment))
        check_served_facts(client, metrics, engine, report)
        if bench is None:
            report.check(
                "load", None, "no benchmark runner (pass --bench-python, or verify a server m31ctl runs)"
            )
        else:
            check_load(plan, base, bench, report)
        check_spec_decode(metrics, plan, report)
        if deployment.disaggregated is not None:
            # The router's greedy completions against prefill's alone, past the sparse window
            # (pd_parity.py): the indexer cache lost on the way shows only there.
            pd_parity.check(deployment, base, prefill_base, metrics, report)
        if transfers_before is not None:
            # Every request above went through the router: decode's counters must show their
            # prompts' KV came over the wire, none failed, and with every cache's bytes (main +
            # indexer a token, capacity's figure for the decode role: served/kv_transfer.py).
            seen = kv_transfer.since(transfers_before, kv_transfer.facts_of(prometheus.scrape(metrics)))
            report.facts["kv_transfer"] = seen._asdict()
            report.checks.append(kv_transfer.check(seen))
            report.checks.append(kv_transfer.check_bytes(seen, kv_transfer.per_token(engine)))
    if baseline is not None:
        check_regression(report, baseline, tolerance)
    return report


def run_target(
    target: Target, *, no_load: bool, baseline: Mapping[str, Any] | None, tolerance: float
) -> VerifyReport:
    """verify of what target.find found: the plan check against the server's recorded plan
    first, when it recorded one (else verify's own check of the hash it reports)."""
    report = run(
        target.deployment,
        target.base,
        engine_base=target.engine_base,
        prefill_base=target.prefill_base,
        server_plan_hash=None if target.plan_check else target.server_hash,
        bench=None if no_load else target.bench,
        baseline=baseline,
        tolerance=tolerance,
    )
    if target.plan_check is not None:
        report.checks.insert(0, target.plan_check)
    return report


def _basic(base: str, served: str, report: VerifyReport) -> None:
    """smoke's checks: models, chat, chat-usage, stream, stream-usage."""
    try:
        basic = smoke.run(base, served)
    except CheckFailed as exc:  # no usable model list: a failed check here, and verify goes on
        report.check("models", False, exc.message)
        return
    report.checks.extend(basic.checks)
    report.facts["ttft_s"] = basic.ttft_s
