#!/usr/bin/env python3
"""Replay bench's agentic workload one request at a time against a running server, greedy, and
record what each answer said, its time to first token, and the engine's own prefix-cache
counters before and after (issue 50: the KV offload tier on the GPU; docs/gpu-rehearsal.md).

One request at a time so that two servers given the same workload run the same batches: the
only difference between their answers can then be where the prefix's KV came from (the GPU's
prefix cache, the CPU tier, or computed again). With random weights the text is noise, but
greedy noise is a fingerprint of the KV the model attended to.

    agentic_replay.py --url http://127.0.0.1:8000 --model NAME --max-model-len 16384 \\
        --requests 48 --sessions 6 --out replay.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from m31ctl.served import workloads  # the repository's own, from a checkout

COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:external_prefix_cache_queries_total",
    "vllm:external_prefix_cache_hits_total",
)
BY_SOURCE = "vllm:prompt_tokens_by_source_total"


def scrape(url: str) -> dict[str, float]:
    """The counters above, and prompt tokens by source, summed over engines (the text format)."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    seen: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name_labels, value = line.rsplit(" ", 1)
        name = name_labels.split("{", 1)[0]
        if name in COUNTERS:
            seen[name] = seen.get(name, 0.0) + float(value)
        elif name == BY_SOURCE:
            source = name_labels.split('source="', 1)[1].split('"', 1)[0]
            key = f"{BY_SOURCE}:{source}"
            seen[key] = seen.get(key, 0.0) + float(value)
    return seen


def tokens(url: str, model: str, text: str) -> int:
    body = {"model": model, "messages": [{"role": "user", "content": text}]}
    req = urllib.request.Request(
        f"{url}/tokenize", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    return int(json.loads(urllib.request.urlopen(req, timeout=30).read())["count"])


def ask(url: str, model: str, prompt: str, output: int) -> dict[str, object]:
    """One streamed greedy chat completion: its text, time to first token and in all."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": output,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Token ids too: a byte-level tokenizer's text can hold back bytes that do not decode yet.
        "return_token_ids": True,
    }
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    started = time.monotonic()
    first = None
    text: list[str] = []
    ids: list[int] = []
    usage = None
    with urllib.request.urlopen(req, timeout=300) as answer:
        for raw in answer:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", ()):
                # A reasoning parser (MiniMax-M3's) sends the model's text as reasoning first.
                delta = choice.get("delta") or {}
                piece = "".join(delta.get(k) or "" for k in ("reasoning_content", "reasoning", "content"))
                ids += choice.get("token_ids") or []
                if piece or choice.get("token_ids"):
                    first = first if first is not None else time.monotonic() - started
                    text.append(piece)
    return {
        "ttft_s": round(first if first is not None else -1.0, 5),
        "total_s": round(time.monotonic() - started, 5),
        "text": "".join(text),
        "token_ids": ids,
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--sessions", type=int, default=6, help="bench's concurrency: the sessions")
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", type=Path, required=True)
    ns = ap.parse_args()
    meter = workloads.calibrate(lambda text: tokens(ns.url, ns.model, text))
    sizing = workloads.Sizing(512, ns.output_len, ns.max_model_len)
    made = workloads.build("agentic", ns.requests, ns.sessions, sizing, meter, 0)
    before = scrape(ns.url)
    answers = []
    for index, request in enumerate(made.requests):
        answers.append({"index": index, **ask(ns.url, ns.model, request.prompt, request.output_tokens)})
    after = scrape(ns.url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in sorted(set(before) | set(after))}
    ttfts = sorted(float(a["ttft_s"]) for a in answers)  # type: ignore[arg-type]
    report = {
        "label": ns.label,
        "requests": len(answers),
        "sessions": made.sessions,
        "counters": delta,
        "ttft_median_s": ttfts[len(ttfts) // 2],
        "ttft_mean_s": round(sum(ttfts) / len(ttfts), 5),
        "answers": answers,
    }
    ns.out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in report.items() if k != "answers"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
