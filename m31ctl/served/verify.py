"""`m31ctl verify`: prove that a running server is the plan's server, that it works, and that it
is fast enough, with vLLM's own benchmark. This module holds the checks; /metrics is
read by prometheus.py, the load is one point of bench's sweep (sweep.bench_args).

Function: a chat completion and a streamed one (smoke's checks), structured output, and a tool
call, the reasoning split and an image input where the plan configures them. A checkpoint m31ctl
made with random weights (its m31ctl-rehearsal.json) writes noise: the tool call and the
reasoning split are then requested and must be served, but what the model wrote is not judged
(skipped, saying why); structured output still is, its grammar constrains any weights. Facts: the served
model, its max length, the KV cache dtype, block size and size the engine reports on /metrics, and
speculative decoding's acceptance, each compared with the plan. Load: `vllm bench serve` (the
engine's own) with the plan's `verify` settings; its pass marks gate. Regression: against an
earlier report. Every answer is read defensively (http_answers.py): a broken or hostile server
fails a check, it does not crash verify.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from m31ctl.capacity.fit import plan_fit
from m31ctl.checks import CheckResult, judged
from m31ctl.deployment import Deployment
from m31ctl.engine.adapter import KV_CACHE_DTYPE
from m31ctl.errors import CheckFailed
from m31ctl.plan import Plan
from m31ctl.runtime.load_run import BenchRunner
from m31ctl.served import figures, kv_transfer, prometheus, smoke, spec_decode, sweep
from m31ctl.served.http_answers import Answer, as_int, as_list, as_object, as_str, fetch, glimpse
from m31ctl.served.target import Target

__all__ = ["VerifyReport", "run"]

# The load's pass marks: (the figure's one name, the verify setting that sets the mark); the
# check's id and the figure are read through figures.VLLM_KEY, as bench reads its points.
PASS_MARKS = (
    ("ttft_p99_ms", "ttft_p99_ms"),
    ("tpot_p99_ms", "tpot_p99_ms"),
    ("output_tok_s", "min_output_throughput"),
)
# What report.bench keeps of vLLM's result, under vLLM's own keys (CI and baselines read them).
BENCH_FIGURES = (
    "completed", "failed", "duration_s", "request_throughput", "request_goodput", "output_tok_s",
    "ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms", "tpot_mean_ms", "tpot_p99_ms", "itl_p99_ms", "e2el_p99_ms",
)  # fmt: skip
# 1x1 transparent PNG: the smallest image input every vision processor accepts.
PIXEL = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="


@dataclass
class VerifyReport:
    endpoint: str
    plan_hash: str
    checks: list[CheckResult] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    bench: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return not any(c.failed for c in self.checks)

    def check(self, name: str, ok: bool | None, detail: str) -> None:
        """ok None: skipped (the plan does not configure it, or it could not run)."""
        self.checks.append(judged(name, ok, detail))

    def failed(self) -> list[str]:
        return [c.id for c in self.checks if c.failed]

    def to_json(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "plan_hash": self.plan_hash,
            "ok": self.ok,
            "failed": self.failed(),
            "checks": [c.to_json() for c in self.checks],
            "facts": self.facts,
            "bench": self.bench,
        }


def run(
    deployment: Deployment,
    base: str,
    *,
    engine_base: str | None = None,
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
        _structured(client, served, report, noise)
        _tool_call(client, plan, report, noise)
        _reasoning(client, plan, report, noise)
        _image(client, plan, report, text_only_checkpoint(deployment))
        _served_facts(client, metrics, engine, report)
        if bench is None:
            report.check(
                "load", None, "no benchmark runner (pass --bench-python, or verify a server m31ctl runs)"
            )
        else:
            _load(plan, base, bench, report)
        _spec_decode(metrics, plan, report)
        if transfers_before is not None:
            # Every request above went through the router: decode's counters must show their
            # prompts' KV came over the wire, none failed (served/kv_transfer.py).
            seen = kv_transfer.since(transfers_before, kv_transfer.facts_of(prometheus.scrape(metrics)))
            report.facts["kv_transfer"] = seen._asdict()
            report.checks.append(kv_transfer.check(seen))
    if baseline is not None:
        _regression(report, baseline, tolerance)
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


def random_weights(deployment: Deployment) -> str | None:
    """Why the served model's words mean nothing, or None: a local checkpoint m31ctl made on the
    spot (make_tiny_model.py, make_tiny_m3.py) has random weights and says so in its
    m31ctl-rehearsal.json."""
    directory = deployment.model.host_path
    marker = Path(directory) / "m31ctl-rehearsal.json" if directory else None
    try:
        made = json.loads(marker.read_text()) if marker is not None and marker.is_file() else None
    except (OSError, ValueError):
        return None
    if not isinstance(made, dict) or made.get("made_by") != "m31ctl":
        return None
    return f"the checkpoint's weights are random ({marker}), so what the model writes is noise"


def text_only_checkpoint(deployment: Deployment) -> str | None:
    """Why a local checkpoint serves no images, or None: its config.json names a causal-LM
    architecture and no vision tower (the tiny MiniMax-M3 is the text backbone alone, which
    vLLM refuses an image for: "... is not a multimodal model")."""
    directory = deployment.model.host_path
    config = Path(directory) / "config.json" if directory else None
    try:
        data = json.loads(config.read_text()) if config is not None and config.is_file() else None
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("vision_config"):
        return None
    names = [str(a) for a in data.get("architectures") or []]
    if not names or not all(a.endswith("ForCausalLM") for a in names):
        return None
    return f"the checkpoint is text-only ({config}: {', '.join(names)}, no vision_config)"


def _unjudged(report: VerifyReport, name: str, answer: Answer, detail: str, noise: str) -> None:
    """A check of what the model writes, on random weights: the request must be served (HTTP
    200 with a message), the rest is skipped and says why."""
    served = answer.status == 200 and bool(_message(answer))
    report.check(
        name,
        None if served else False,
        f"{detail}; not judged: {noise}" if served else detail + answer.evidence(),
    )


def _chat(client: Any, body: dict[str, Any]) -> Answer:
    return fetch(client, "POST", "/v1/chat/completions", body)


def _message(answer: Answer) -> dict[str, Any]:
    """The first choice's message, or {} for an answer of another shape."""
    choices = as_list(answer.obj().get("choices"))
    return as_object(as_object(choices[0]).get("message")) if choices else {}


def _said(answer: Answer, ok: bool) -> str:
    """A failed check quotes what the server sent; a passed one does not need to."""
    return "" if ok else answer.evidence()


def _structured(client: Any, served: str, report: VerifyReport, noise: str | None = None) -> None:
    """A JSON-schema response: the engine's structured outputs must constrain the answer. On
    random weights (`noise`) with a reasoning parser, what comes before the grammar engages is
    noise too: the answer must end in the schema's value."""
    schema = {"type": "string", "enum": ["yes", "no"]}
    answer = _chat(
        client,
        {
            "model": served,
            "messages": [{"role": "user", "content": "Answer yes or no: is the sky blue?"}],
            "max_tokens": 32,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        },
    )
    content = as_str(_message(answer).get("content"))
    try:
        value = json.loads(content) if content is not None else None
    except (ValueError, RecursionError):
        value = None
    ok = answer.status == 200 and value in ("yes", "no")
    detail = f"HTTP {answer.status}, content {glimpse(content, 60)}"
    if not ok and noise and answer.status == 200 and content and content.rstrip().endswith(('"yes"', '"no"')):
        ok, detail = True, f"{detail}: the grammar's value ends it; what precedes is noise ({noise})"
    report.check("structured-output", ok, detail + _said(answer, ok or content is not None))


def _tool_call(client: Any, plan: Plan, report: VerifyReport, noise: str | None = None) -> None:
    parser = plan.settings.serving.tool_call_parser
    if not parser:
        report.check("tool-call", None, "the plan sets no tool-call parser")
        return
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    answer = _chat(
        client,
        {
            "model": plan.settings.model.served_name,
            "messages": [{"role": "user", "content": "What is the weather in Paris? Use the tool."}],
            "tools": [tool],
            "tool_choice": "auto",
            "max_tokens": 512,
            "temperature": 0,
        },
    )
    sent = _message(answer).get("tool_calls")
    names = [as_str(as_object(as_object(c).get("function")).get("name")) for c in as_list(sent)]
    ok = answer.status == 200 and "get_weather" in names
    shown = glimpse(", ".join(n for n in names if n), 80) if any(names) else "no tool call"
    if noise:
        _unjudged(report, "tool-call", answer, f"HTTP {answer.status}, {parser} parsed {shown}", noise)
        return
    # Tool calls of another shape are quoted themselves: the answer's first bytes may not reach them.
    said = f"; tool_calls {glimpse(sent)}" if sent and not ok else _said(answer, ok)
    report.check("tool-call", ok, f"HTTP {answer.status}, {parser} parsed {shown}" + said)


def _reasoning(client: Any, plan: Plan, report: VerifyReport, noise: str | None = None) -> None:
    parser = plan.settings.serving.reasoning_parser
    if not parser:
        report.check("reasoning", None, "the plan sets no reasoning parser")
        return
    answer = _chat(
        client,
        {
            "model": plan.settings.model.served_name,
            "messages": [{"role": "user", "content": "What is 17 * 23? Think, then answer."}],
            "max_tokens": 1024,
            "temperature": 0,
            # MiniMax-M3's template: thinking on for this request (vLLM recipes, "Thinking Modes").
            "chat_template_kwargs": {"thinking_mode": "enabled"},
        },
    )
    message = _message(answer)
    reasoning = as_str(message.get("reasoning")) or as_str(message.get("reasoning_content")) or ""
    content = as_str(message.get("content")) or ""
    ok = answer.status == 200 and bool(reasoning) and "<mm:think>" not in content
    detail = f"HTTP {answer.status}, {parser}: {len(reasoning)} characters of reasoning in their own field"
    if noise:
        _unjudged(report, "reasoning", answer, detail, noise)
        return
    report.check("reasoning", ok, detail + _said(answer, ok))


def _image(client: Any, plan: Plan, report: VerifyReport, text_only: str | None = None) -> None:
    mm = plan.settings.multimodal
    if mm.text_only or not mm.image or "image" not in plan.model.modalities:
        report.check("image-input", None, "the plan serves no image input")
        return
    if text_only:
        report.check("image-input", None, f"not sent: {text_only}")
        return
    answer = _chat(
        client,
        {
            "model": plan.settings.model.served_name,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What color is this pixel?"},
                        {"type": "image_url", "image_url": {"url": PIXEL}},
                    ],
                }
            ],
            "max_tokens": 32,
            "temperature": 0,
        },
    )
    ok = answer.status == 200 and as_str(_message(answer).get("content")) is not None
    report.check("image-input", ok, f"HTTP {answer.status}" + _said(answer, ok))


def _served_facts(client: Any, metrics: Any, deployment: Deployment, report: VerifyReport) -> None:
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
        + _said(listed, length is not None),
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


def _load(plan: Plan, base: str, bench: BenchRunner, report: VerifyReport) -> None:
    """One point of bench's sweep: the plan's verify settings as `vllm bench serve` arguments
    (sweep.bench_args, vLLM's random prompts), its figures read as bench reads a point."""
    v = plan.settings.verify
    limits = tuple(
        figures.Limit(key, value)
        for key, value in (("ttft_p99_ms", v.ttft_p99_ms), ("tpot_p99_ms", v.tpot_p99_ms))
        if value
    )
    dataset = sweep.random_dataset(v.input_len, v.output_len)
    try:
        result = bench(sweep.bench_args(plan, base, dataset, v.requests, v.concurrency, 0, limits))
    except Exception as exc:  # the benchmark could not run: a failed gate, with its reason
        report.check("load", False, f"vllm bench serve did not run: {str(exc)[-300:]}")
        return
    kept = [figures.VLLM_KEY[figure] for figure in BENCH_FIGURES]
    report.bench = {key: result.get(key) for key in kept if key in result}
    completed = result.get(figures.VLLM_KEY["completed"]) or 0
    failed = result.get(figures.VLLM_KEY["failed"]) or 0
    report.check(
        "load", completed == v.requests and not failed, f"{completed} of {v.requests} requests completed"
    )
    for figure, setting in PASS_MARKS:
        name, limit, key = figures.check_id(figure), getattr(v, setting), figures.VLLM_KEY[figure]
        lower_is_better = not figures.BETTER_HIGHER[figure]
        measured = figures.measured(result, figure)
        shown = f"{measured:.4g}" if measured is not None else "not measured"
        if limit is None:
            report.check(name, None, f"{key} {shown} (no pass mark set: verify.{setting})")
            continue
        ok = measured is not None and (measured <= limit if lower_is_better else measured >= limit)
        sign = "<=" if lower_is_better else ">="
        report.check(name, ok, f"{key} {shown} (pass mark {sign} {limit:g})")


def _spec_decode(client: Any, plan: Plan, report: VerifyReport) -> None:
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


def _regression(report: VerifyReport, baseline: Mapping[str, Any], tolerance: float) -> None:
    old = baseline.get("bench") or {}
    new = report.bench or {}

    def key(figure: str) -> str:
        return figures.VLLM_KEY[figure]

    worse, compared = figures.worse(
        lambda f: old.get(key(f)), lambda f: new.get(key(f)), figures.VERIFY_REGRESSION, tolerance, key
    )
    if not compared:
        report.check("regression", None, "the baseline and this run share no benchmark figures")
        return
    report.check(
        "regression",
        not worse,
        "; ".join(worse)
        if worse
        else f"{', '.join(map(key, compared))} within {tolerance:.0%} of the baseline",
    )
