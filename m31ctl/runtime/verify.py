"""`m31ctl verify`: prove that a running server is the plan's server, that it works, and that it
is fast enough, with vLLM's own benchmark (issue 17).

Function: a chat completion and a streamed one (smoke's checks), structured output, and a tool
call, the reasoning split and an image input where the plan configures them. Facts: the served
model, its max length, the KV cache dtype, block size and size the engine reports on /metrics, and
speculative decoding's acceptance, each compared with the plan. Load: `vllm bench serve` (the
engine's own) with the plan's `verify` settings; its pass marks gate. Regression: against an
earlier report.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from m31ctl.engine.adapter import KV_CACHE_DTYPE
from m31ctl.errors import InputError
from m31ctl.plan import Plan
from m31ctl.runtime import smoke

# A bench runner takes `vllm bench serve` arguments and returns its saved result.
BenchRunner = Callable[[list[str]], dict[str, Any]]
BENCH_SCRIPT = Path(__file__).resolve().parent.parent / "engine" / "bench_serve.py"
# Benchmark figures compared with a baseline: (key, higher is better).
REGRESSION_METRICS = (
    ("p99_ttft_ms", False),
    ("p99_tpot_ms", False),
    ("p99_e2el_ms", False),
    ("output_throughput", True),
)
# 1x1 transparent PNG: the smallest image input every vision processor accepts.
PIXEL = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAQAAAC1HAwCAAAAC0lEQVR42mNkYAAAAAYAAjCB0C8AAAAASUVORK5CYII="


@dataclass
class VerifyReport:
    endpoint: str
    plan_hash: str
    checks: list[dict[str, Any]] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    bench: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return all(c["status"] != "fail" for c in self.checks)

    def check(self, name: str, ok: bool | None, detail: str) -> None:
        """ok None: skipped (the plan does not configure it, or it could not run)."""
        status = "skip" if ok is None else "pass" if ok else "fail"
        self.checks.append({"check": name, "status": status, "detail": detail})

    def failed(self) -> list[str]:
        return [c["check"] for c in self.checks if c["status"] == "fail"]

    def to_json(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "plan_hash": self.plan_hash,
            "ok": self.ok,
            "failed": self.failed(),
            "checks": self.checks,
            "facts": self.facts,
            "bench": self.bench,
        }


def run(
    plan: Plan,
    base: str,
    *,
    server_plan_hash: str | None,
    bench: BenchRunner | None,
    baseline: Mapping[str, Any] | None = None,
    tolerance: float = 0.25,
) -> VerifyReport:
    import httpx

    report = VerifyReport(base, plan.hash)
    served = plan.settings.model.served_name
    if server_plan_hash is not None:
        report.check(
            "plan",
            server_plan_hash == plan.hash,
            f"the server runs plan {server_plan_hash}; verifying plan {plan.hash}",
        )
    basic = smoke.run(base, served)  # models, chat, chat-usage, stream, stream-usage
    for c in basic.checks:
        report.check(c["check"], c["ok"], c["detail"])
    report.facts["ttft_s"] = basic.ttft_s
    with httpx.Client(base_url=base, headers=smoke.auth_headers(), timeout=120.0) as client:
        _structured(client, served, report)
        _tool_call(client, plan, report)
        _reasoning(client, plan, report)
        _image(client, plan, report)
        _served_facts(client, plan, report)
        if bench is None:
            report.check(
                "load", None, "no benchmark runner (pass --bench-python, or verify a server m31ctl runs)"
            )
        else:
            _load(plan, base, bench, report)
        _spec_decode(client, plan, report)
    if baseline is not None:
        _regression(report, baseline, tolerance)
    return report


def _chat(client: Any, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    import httpx

    try:
        response = client.post("/v1/chat/completions", json=body)
    except httpx.HTTPError as exc:
        return 0, {"error": str(exc)}
    try:
        data = response.json()
    except ValueError:
        data = {}
    return response.status_code, data if isinstance(data, dict) else {}


def _message(data: dict[str, Any]) -> dict[str, Any]:
    choices = data.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        message = choices[0].get("message")
        return message if isinstance(message, dict) else {}
    return {}


def _structured(client: Any, served: str, report: VerifyReport) -> None:
    """A JSON-schema response: the engine's structured outputs must constrain the answer."""
    schema = {"type": "string", "enum": ["yes", "no"]}
    status, data = _chat(
        client,
        {
            "model": served,
            "messages": [{"role": "user", "content": "Answer yes or no: is the sky blue?"}],
            "max_tokens": 32,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
        },
    )
    content = _message(data).get("content")
    try:
        value = json.loads(content) if isinstance(content, str) else None
    except ValueError:
        value = None
    report.check(
        "structured-output",
        status == 200 and value in ("yes", "no"),
        f"HTTP {status}, content {content!r:.60}",
    )


def _tool_call(client: Any, plan: Plan, report: VerifyReport) -> None:
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
    status, data = _chat(
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
    calls = _message(data).get("tool_calls") or []
    names = [c.get("function", {}).get("name") for c in calls if isinstance(c, dict)]
    report.check(
        "tool-call",
        status == 200 and "get_weather" in names,
        f"HTTP {status}, {parser} parsed {names or 'no tool call'}",
    )


def _reasoning(client: Any, plan: Plan, report: VerifyReport) -> None:
    parser = plan.settings.serving.reasoning_parser
    if not parser:
        report.check("reasoning", None, "the plan sets no reasoning parser")
        return
    status, data = _chat(
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
    message = _message(data)
    reasoning = message.get("reasoning") or message.get("reasoning_content")
    report.check(
        "reasoning",
        status == 200 and bool(reasoning) and "<mm:think>" not in str(message.get("content") or ""),
        f"HTTP {status}, {parser}: {len(str(reasoning or ''))} characters of reasoning in their own field",
    )


def _image(client: Any, plan: Plan, report: VerifyReport) -> None:
    mm = plan.settings.multimodal
    if mm.text_only or not mm.image or "image" not in plan.model.modalities:
        report.check("image-input", None, "the plan serves no image input")
        return
    status, data = _chat(
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
    report.check(
        "image-input", status == 200 and isinstance(_message(data).get("content"), str), f"HTTP {status}"
    )


_LABELS = re.compile(r'(\w+)="([^"]*)"')


def _metrics(client: Any) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text: metric name -> [(labels, value)]."""
    import httpx

    try:
        text = client.get("/metrics").text
    except httpx.HTTPError:
        return {}
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = (
            line.partition("{") if "{" in line.split(" ", 1)[0] else (line.split(" ", 1)[0], "", "")
        )
        labels_text, _, value_text = rest.rpartition("} ") if rest else ("", "", line.split(" ", 1)[-1])
        try:
            value = float(value_text.split()[0])
        except (ValueError, IndexError):
            continue
        found.setdefault(name, []).append((dict(_LABELS.findall(labels_text)), value))
    return found


def _served_facts(client: Any, plan: Plan, report: VerifyReport) -> None:
    """What the engine says it runs, against the plan: served model, max length, KV cache."""
    from m31ctl.capacity.fit import plan_fit

    s = plan.settings
    try:
        listed = client.get("/v1/models").json().get("data") or []
    except (ValueError, AttributeError):
        listed = []
    entry = next((m for m in listed if isinstance(m, dict) and m.get("id") == s.model.served_name), {})
    report.facts["max_model_len"] = entry.get("max_model_len")
    report.check(
        "max-model-len",
        entry.get("max_model_len") == s.serving.max_model_len,
        f"the engine serves {entry.get('max_model_len')} tokens; the plan says {s.serving.max_model_len}",
    )
    info = (_metrics(client).get("vllm:cache_config_info") or [({}, 0.0)])[0][0]
    if not info:
        report.check("kv-cache", False, "/metrics has no vllm:cache_config_info")
        return
    expected = KV_CACHE_DTYPE.get(s.cache.kv_dtype, s.cache.kv_dtype)
    tokens = _int(info.get("kv_cache_size_tokens"))
    report.facts.update(
        kv_cache_dtype=info.get("cache_dtype"), block_size=info.get("block_size"), kv_cache_tokens=tokens
    )
    report.check(
        "kv-cache-dtype",
        info.get("cache_dtype") == expected,
        f"the engine stores its KV cache as {info.get('cache_dtype')}; the plan says {expected}",
    )
    if s.cache.block_size is not None:
        report.check(
            "block-size",
            info.get("block_size") == str(s.cache.block_size),
            f"the engine uses {info.get('block_size')}-token blocks; the plan says {s.cache.block_size}",
        )
    predicted = plan_fit(plan).kv_cache_tokens
    report.facts["kv_cache_tokens_predicted"] = predicted
    if tokens is not None and predicted:
        # The capacity model's figure is a prediction: reported beside the engine's, not gated.
        report.facts["kv_cache_tokens_ratio"] = round(tokens / predicted, 4)


def _int(text: str | None) -> int | None:
    try:
        return int(str(text))
    except ValueError:
        return None


def bench_args(plan: Plan, base: str, tokenizer: str) -> list[str]:
    """`vllm bench serve` for the plan's verify settings, against the chat endpoint."""
    v = plan.settings.verify
    args = [
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--base-url", base,
        "--model", plan.settings.model.served_name, "--tokenizer", tokenizer,
        "--dataset-name", "random", "--random-input-len", str(v.input_len), "--random-output-len", str(v.output_len),
        "--num-prompts", str(v.requests), "--max-concurrency", str(v.concurrency),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--ignore-eos",
    ]  # fmt: skip
    goodput = [
        f"{name}:{value:g}" for name, value in (("ttft", v.ttft_p99_ms), ("tpot", v.tpot_p99_ms)) if value
    ]
    if goodput:
        args += ["--goodput", *goodput]
    return args


def _load(plan: Plan, base: str, bench: BenchRunner, report: VerifyReport) -> None:
    v = plan.settings.verify
    try:
        result = bench(bench_args(plan, base, plan.settings.model.path))
    except Exception as exc:  # the benchmark could not run: a failed gate, with its reason
        report.check("load", False, f"vllm bench serve did not run: {str(exc)[-300:]}")
        return
    keys = (
        "completed", "failed", "duration", "request_throughput", "request_goodput", "output_throughput",
        "mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms",
    )  # fmt: skip
    report.bench = {k: result.get(k) for k in keys if k in result}
    completed, failed = result.get("completed") or 0, result.get("failed") or 0
    report.check(
        "load", completed == v.requests and not failed, f"{completed} of {v.requests} requests completed"
    )
    for name, limit, key, lower_is_better in (
        ("ttft-p99", v.ttft_p99_ms, "p99_ttft_ms", True),
        ("tpot-p99", v.tpot_p99_ms, "p99_tpot_ms", True),
        ("output-throughput", v.min_output_throughput, "output_throughput", False),
    ):
        measured = result.get(key)
        shown = f"{measured:.4g}" if isinstance(measured, (int, float)) else "not measured"
        if limit is None:
            report.check(name, None, f"{key} {shown} (no pass mark set: verify.{_setting(name)})")
            continue
        ok = measured is not None and (measured <= limit if lower_is_better else measured >= limit)
        sign = "<=" if lower_is_better else ">="
        report.check(name, ok, f"{key} {shown} (pass mark {sign} {limit:g})")


def _setting(check: str) -> str:
    return {
        "ttft-p99": "ttft_p99_ms",
        "tpot-p99": "tpot_p99_ms",
        "output-throughput": "min_output_throughput",
    }[check]


def _spec_decode(client: Any, plan: Plan, report: VerifyReport) -> None:
    """Speculative decoding's mean acceptance length from vLLM's counters (tokens per step)."""
    spec = plan.settings.speculative
    if spec.method == "none":
        report.check("spec-decode", None, "the plan uses no speculative decoding")
        return
    metrics = _metrics(client)
    drafts = sum(v for _labels, v in metrics.get("vllm:spec_decode_num_drafts_total", []))
    accepted = sum(v for _labels, v in metrics.get("vllm:spec_decode_num_accepted_tokens_total", []))
    if drafts <= 0:
        report.check(
            "spec-decode", False, f"{spec.method} proposed no drafts (no spec_decode counters moved)"
        )
        return
    length = 1 + accepted / drafts
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
    worse = []
    for key, higher_is_better in REGRESSION_METRICS:
        before, now = old.get(key), new.get(key)
        if not isinstance(before, (int, float)) or not isinstance(now, (int, float)) or before <= 0:
            continue
        change = (now - before) / before
        if (change < -tolerance) if higher_is_better else (change > tolerance):
            worse.append(f"{key} {before:.4g} -> {now:.4g} ({change:+.0%})")
    compared = [k for k, _ in REGRESSION_METRICS if k in old and k in new]
    if not compared:
        report.check("regression", None, "the baseline and this run share no benchmark figures")
        return
    report.check(
        "regression",
        not worse,
        "; ".join(worse) if worse else f"{', '.join(compared)} within {tolerance:.0%} of the baseline",
    )


def read_baseline(path: Path) -> dict[str, Any]:
    from m31ctl.inputs import read_text

    try:
        data = json.loads(read_text(path, "baseline report"))
    except ValueError as exc:
        raise InputError(f"not a verify report: {exc}", where=str(path)) from None
    if not isinstance(data, dict) or "checks" not in data:
        raise InputError("not a verify report (no checks)", where=str(path))
    return data


def native_bench(python: str) -> BenchRunner:
    """The benchmark run by a local Python that has vLLM (the native runtime's)."""

    def run_bench(args: list[str]) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="m31ctl-bench-") as tmp:
            done = subprocess.run(
                [
                    python,
                    str(BENCH_SCRIPT),
                    *args,
                    "--save-result",
                    "--result-dir",
                    tmp,
                    "--result-filename",
                    "r.json",
                ],
                capture_output=True,
                text=True,
                timeout=3600,
            )
            result = Path(tmp) / "r.json"
            if done.returncode != 0 or not result.is_file():
                raise RuntimeError((done.stderr or done.stdout).strip().splitlines()[-1:] or "no result")
            data: dict[str, Any] = json.loads(result.read_text())
            return data

    return run_bench


def container_bench(image: str, mounts: list[tuple[str, str]]) -> BenchRunner:
    """The benchmark run by the engine image's own vLLM, in a sibling container on the host's
    network (the server's port is published there), with the server's model and cache mounts
    for the tokenizer."""
    from m31ctl.runtime import engine_api

    def run_bench(args: list[str]) -> dict[str, Any]:
        with (
            engine_api.engine_boundary("running vllm bench serve"),
            tempfile.TemporaryDirectory(prefix="m31ctl-bench-") as tmp,
        ):
            os.chmod(tmp, 0o777)
            volumes = {source: {"bind": target, "mode": "ro"} for source, target in mounts}
            volumes[str(BENCH_SCRIPT.parent)] = {"bind": "/m31ctl", "mode": "ro"}
            volumes[tmp] = {"bind": "/m31ctl-out", "mode": "rw"}
            client = engine_api.connect()
            client.containers.run(
                image,
                entrypoint=["python3", "/m31ctl/bench_serve.py"],
                command=[
                    *args,
                    "--save-result",
                    "--result-dir",
                    "/m31ctl-out",
                    "--result-filename",
                    "r.json",
                ],
                remove=True,
                network_mode="host",
                volumes=volumes,
            )
            data: dict[str, Any] = json.loads((Path(tmp) / "r.json").read_text())
            return data

    return run_bench
