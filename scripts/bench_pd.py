#!/usr/bin/env python3
"""What prefill/decode disaggregation costs per request on the CPU rehearsal (issue 36): TTFT and
TPOT through vllm-router (prefill vLLM + decode vLLM, NixlConnector over UCX/TCP on loopback)
against the same requests sent straight to an aggregated vLLM, and the router's own time: the
router's TTFT minus that of the same two stages done by this script (prefill with
`do_remote_decode`, then decode with the prefill's kv_transfer_params), with no router between.

    .venv/bin/python scripts/bench_pd.py [--repeats 5] [--output-len 32] [--json PATH]

Needs .venv-vllm with nixl and vllm-router (scripts/setup-vllm). Three vLLM starts (a few
minutes on two cores), then requests one at a time. Each request has its own prompt (a number in
front), so no prefix cache serves it. The figures are a 2-core CPU's and a tiny model's: they show
the shape of the cost (a second hop, a KV transfer), not a GPU's speed. Prefill runs on one core,
decode and the aggregated server on the other (never both busy: one request at a time);
--decode-core swaps them (vLLM's NIXL worker reserves the last core for KV transfer,
nixl/base_worker.py, which on two cores is core 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # m31ctl (the transfer facts of the decode instance's /metrics)

import pd_group  # noqa: E402 (its library, next to it in scripts/: a script's directory is on sys.path)

SENTENCE = "the model serves tokens on four GPUs with sparse attention and a speculative draft; "
LENGTHS = {"short": 1, "~900 tokens": 50, "~1800 tokens": 100}  # sentences per prompt


def prompt(sentences: int, n: int) -> str:
    return f"{n} " + SENTENCE * sentences


def two_stages(group: pd_group.Group, text: str, output_len: int) -> pd_group.Timed:
    """What the router does, done here: prefill asked for one token with do_remote_decode, then
    decode streamed with the kv_transfer_params prefill answered (vllm_pd_router.rs)."""
    start = time.perf_counter()
    body = {
        "model": pd_group.SERVED_NAME,
        "prompt": text,
        "max_tokens": 1,
        "temperature": 0,
        "stream": False,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    answer = pd_group.request(f"{group.prefill.url}/v1/completions", body)
    if answer.status != 200:
        raise RuntimeError(f"prefill answered HTTP {answer.status}: {answer.body[:300]}")
    params = answer.json()["kv_transfer_params"]
    prefill_s = time.perf_counter() - start
    timed = pd_group.streamed_completion(group.decode.url, text, output_len, kv_transfer_params=params)
    return timed._replace(ttft_s=timed.ttft_s + prefill_s, total_s=timed.total_s + prefill_s)


def summary(samples: list[pd_group.Timed]) -> dict[str, float]:
    ttft = [s.ttft_s * 1000 for s in samples]
    tpot = [s.tpot_s * 1000 for s in samples]
    return {
        "ttft_ms_median": round(statistics.median(ttft), 1),
        "ttft_ms_max": round(max(ttft), 1),
        "tpot_ms_median": round(statistics.median(tpot), 2),
        "tpot_ms_max": round(max(tpot), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="requests per prompt length and path")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument(
        "--decode-core",
        choices=("0", "1"),
        default="1",
        help="the core of decode (and of the aggregated server); prefill takes the other",
    )
    opts = parser.parse_args()
    if not pd_group.router_binary().exists():
        sys.exit(f"{pd_group.router_binary()} is missing: scripts/setup-vllm installs vllm-router and nixl")
    with tempfile.TemporaryDirectory(prefix="m31ctl-bench-pd-") as tmp:
        work = Path(tmp)
        print(
            "bench_pd: making the tiny model and starting prefill, decode, aggregated and the router",
            flush=True,
        )
        model = pd_group.make_tiny_model(work / "tiny-model")
        started = time.monotonic()
        cores = ("1", "0") if opts.decode_core == "0" else ("0", "1")
        with pd_group.group(model, work / "logs", aggregated=True, cores=cores) as group:
            assert group.reference is not None
            print(f"bench_pd: all up in {time.monotonic() - started:.0f} s", flush=True)
            paths = {
                "aggregated": lambda text: pd_group.streamed_completion(
                    group.reference.url, text, opts.output_len
                ),
                "router (P/D)": lambda text: pd_group.streamed_completion(
                    group.router.url, text, opts.output_len
                ),
                "two stages, no router": lambda text: two_stages(group, text, opts.output_len),
                # The decode instance as a plain server (it prefills itself): its connector's cost
                # per decode step, without any transfer.
                "decode alone, no P": lambda text: pd_group.streamed_completion(
                    group.decode.url, text, opts.output_len
                ),
            }
            for run in paths.values():  # warm-up: first requests pay one-off costs (NIXL handshake)
                run(prompt(2, -1))
            n = 0
            results: dict[str, dict[str, Any]] = {}
            for length, sentences in LENGTHS.items():
                for path, run in paths.items():
                    samples, failures = [], []
                    for _ in range(opts.repeats):
                        n += 1
                        try:
                            samples.append(run(prompt(sentences, n)))
                        except RuntimeError as exc:  # counted and shown, not fatal: a loaded machine
                            failures.append(str(exc)[:200])
                    if not samples:
                        sys.exit(f"bench_pd: every {path} request failed: {failures[-1]}")
                    results.setdefault(length, {})[path] = {**summary(samples), "failed": len(failures)}
                    for failure in failures:
                        print(f"bench_pd: {path}: {failure}", flush=True)
            transfer = pd_group.metrics_text(group.decode.url)
    from m31ctl.served import kv_transfer

    figures = {
        "repeats": opts.repeats,
        "output_len": opts.output_len,
        "cores": {"prefill": cores[0], "decode": cores[1], "aggregated": cores[1]},
        "results": results,
        "router_own_ms": {
            length: round(
                by_path["router (P/D)"]["ttft_ms_median"]
                - by_path["two stages, no router"]["ttft_ms_median"],
                1,
            )
            for length, by_path in results.items()
        },
        "decode_transfer": kv_transfer.facts(transfer)._asdict(),
    }
    print(f"\n{'prompt':<14} {'path':<24} {'TTFT ms (median/max)':>22} {'TPOT ms (median/max)':>22}")
    for length, by_path in results.items():
        for path, s in by_path.items():
            print(
                f"{length:<14} {path:<24} {s['ttft_ms_median']:>12.1f} / {s['ttft_ms_max']:<8.1f}"
                f" {s['tpot_ms_median']:>12.2f} / {s['tpot_ms_max']:<8.2f}"
            )
    print("\nrouter's own time (router TTFT - two stages' TTFT, medians):", figures["router_own_ms"])
    print("decode /metrics:", figures["decode_transfer"])
    if opts.json:
        opts.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
