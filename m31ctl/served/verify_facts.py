"""verify's facts: what the engine says it runs (the served model, its max length, the KV cache's
dtype, block size and size on /metrics) and speculative decoding's acceptance, each compared with
the plan.

The KV cache's size is the capacity model's prediction beside the engine's figure, reported and
not gated; the rest are checks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from m31ctl.capacity.fit import plan_fit
from m31ctl.deployment import Deployment
from m31ctl.engine.adapter import KV_CACHE_DTYPE
from m31ctl.plan import Plan
from m31ctl.served import prometheus, spec_decode
from m31ctl.served.http_answers import as_int, as_list, as_object, fetch, glimpse
from m31ctl.served.verified import VerifyReport
from m31ctl.served.verify_answers import said_if_failed


def check_served_facts(client: Any, metrics: Any, deployment: Deployment, report: VerifyReport) -> None:
    """What the engine says it runs, against the plan: served model, max length (through
    `client`, the endpoint), KV cache (from the engine's /metrics through `metrics`; `deployment`
    is that engine's: a P/D group's decode role)."""
    s = deployment.plan.settings
    listed = fetch(client, "GET", "/v1/models")
    entries = as_list(listed.obj().get("data"))
    entry = next((as_object(m) for m in entries if as_object(m).get("id") == s.model.served_name), {})
    length = as_int(entry.get("max_model_len"))
    report.facts["max_model_len"] = length
    shown = length if length is not None else glimpse(entry.get("max_model_len"), 40)
    report.check(
        "max-model-len",
        length == s.serving.max_model_len,
        f"the engine serves {shown} tokens; the plan says {s.serving.max_model_len}"
        + said_if_failed(listed, length is not None),
    )
    _kv_cache(prometheus.scrape(metrics), deployment, report)


def _kv_cache(metrics: prometheus.ServedMetrics, deployment: Deployment, report: VerifyReport) -> None:
    s = deployment.plan.settings
    info = metrics.labels("vllm:cache_config_info")
    if not info:
        report.check(
            "kv-cache",
            False,
            "/metrics has no vllm:cache_config_info" + (f"; {metrics.problem}" if metrics.problem else ""),
        )
        return
    expected = KV_CACHE_DTYPE.get(s.cache.kv_dtype, s.cache.kv_dtype)
    dtype, block = _label(info, "cache_dtype"), _label(info, "block_size")
    tokens = _int(info.get("kv_cache_size_tokens"))
    report.facts.update(kv_cache_dtype=dtype, block_size=block, kv_cache_tokens=tokens)
    report.check(
        "kv-cache-dtype",
        dtype == expected,
        f"the engine stores its KV cache as {dtype}; the plan says {expected}",
    )
    if s.cache.block_size is not None:
        report.check(
            "block-size",
            block == str(s.cache.block_size),
            f"the engine uses {block}-token blocks; the plan says {s.cache.block_size}",
        )
    predicted = plan_fit(deployment).kv_cache_tokens
    report.facts["kv_cache_tokens_predicted"] = predicted
    if tokens is not None and predicted:
        # The capacity model's figure is a prediction: reported beside the engine's, not gated.
        report.facts["kv_cache_tokens_ratio"] = round(tokens / predicted, 4)


def _label(labels: Mapping[str, str], key: str) -> str | None:
    """A label value as the report keeps it: a server's overlong value is quoted, shortened."""
    value = labels.get(key)
    return value if value is None or (len(value) <= 64 and value.isprintable()) else glimpse(value, 64)


def _int(text: str | None) -> int | None:
    try:
        return int(str(text))
    except ValueError:
        return None


def check_spec_decode(client: Any, plan: Plan, report: VerifyReport) -> None:
    """Speculative decoding's mean acceptance length from vLLM's counters (tokens per step)."""
    spec = plan.settings.speculative
    if spec.method == "none":
        report.check("spec-decode", None, "the plan uses no speculative decoding")
        return
    metrics = prometheus.scrape(client)
    counters = spec_decode.counters_of(metrics)
    drafts = counters.drafts if counters else 0.0
    accepted = counters.accepted if counters else 0.0
    if not (math.isfinite(drafts) and math.isfinite(accepted)) or drafts <= 0:
        report.check(
            "spec-decode",
            False,
            f"{spec.method} proposed no drafts (no spec_decode counters moved)"
            + (f"; {metrics.problem}" if metrics.problem else ""),
        )
        return
    length = spec_decode.acceptance_length(drafts, accepted)
    report.facts["acceptance_length"] = round(length, 3)
    floor = plan.settings.verify.min_acceptance_length
    ok = floor is None or length >= floor
    report.check(
        "spec-decode",
        ok,
        f"mean acceptance length {length:.2f}" + (f" (pass mark >= {floor:g})" if floor else ""),
    )
