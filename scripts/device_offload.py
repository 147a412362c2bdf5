#!/usr/bin/env python3
"""The KV offload tier on a GPU host (issue 50): one engine, three starts, the same agentic
workload replayed one request at a time (scripts/agentic_replay.py), greedy:

    gpu    no tier, the GPU cache as the plan sizes it: every prefix stays on the GPU
    small  no tier, the GPU cache cut to --blocks: sessions' prefixes are evicted between turns
    tier   the same small GPU cache plus the plan's CPU tier (cache.cpu_offload_gib, the flags
           m31ctl's adapter spells): evicted prefixes come back from host memory

What it shows: the prefix hit rate and TTFT with and without the tier (vLLM's own counters), and
whether the answers with prefixes restored from the tier are the answers of the prefixes that
never left the GPU (a tier that loses part of the cache, MiniMax-M3's indexer keys for one,
changes what the model attends to past its 2,048-token sparse window).

The engine's argv and environment are m31ctl's own derivation for the plan options after `--`
(as scripts/bench_launch_native.py does), started directly; --kv-dtype replaces the main cache's
dtype where this engine cannot run the plan's (vLLM 0.26 off SM10x: docs/gpu-rehearsal.md).

    device_offload.py --out DIR [--blocks 180] [--kv-dtype auto] -- PLAN OPTIONS
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import agentic_replay  # noqa: E402
from bench_launch_native import _group_gone, _listed, _plan  # noqa: E402

OFFLOAD_FLAGS = ("--kv-offloading-backend", "--kv-offloading-size")
LOG_KEYS = (
    "GPU KV cache size",
    "Maximum concurrency",
    "Offloading",
    "offload",
    "Error",
    "error",
    "Traceback",
)


def _without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in flags:
            skip = True
            continue
        out.append(arg)
    return out


def _replaced(argv: list[str], flag: str, value: str) -> list[str]:
    out = list(argv)
    if flag in out:
        out[out.index(flag) + 1] = value
    return out


def _serve(argv: list[str], env: dict[str, str], port: int, served: str, log: Path, timeout: float):
    started = time.monotonic()
    with open(log, "ab") as out:
        child = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    while not _listed(port, served):
        if child.poll() is not None or time.monotonic() - started > timeout:
            _stop(child)
            return None, time.monotonic() - started
        time.sleep(0.5)
    return child, time.monotonic() - started


def _stop(child: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(child.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        child.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
    _group_gone(child.pid)
    time.sleep(2)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--blocks", type=int, default=180)
    ap.add_argument("--kv-dtype", default=None)
    ap.add_argument("--requests", type=int, default=36)
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--cases", default="small,tier,gpu")
    ap.add_argument("plan", nargs=argparse.REMAINDER)
    ns = ap.parse_args()
    plan_args = ns.plan[1:] if ns.plan[:1] == ["--"] else ns.plan
    argv, env, port, served = _plan(plan_args)
    if ns.kv_dtype:
        argv = _replaced(argv, "--kv-cache-dtype", ns.kv_dtype)
    if not all(flag in argv for flag in OFFLOAD_FLAGS):
        raise SystemExit("the plan renders no CPU tier: pass --set cache.cpu_offload_gib=N")
    max_len = int(argv[argv.index("--max-model-len") + 1])
    small = ["--num-gpu-blocks-override", str(ns.blocks)]
    cases = {
        "gpu": _without(argv, OFFLOAD_FLAGS),
        "small": _without(argv, OFFLOAD_FLAGS) + small,
        "tier": argv + small,
    }
    ns.out.mkdir(parents=True, exist_ok=True)
    summary = []
    for name in ns.cases.split(","):
        log = ns.out / f"engine-{name}.log"
        (ns.out / f"argv-{name}.json").write_text(json.dumps(cases[name]) + "\n")
        child, up_s = _serve(cases[name], env, port, served, log, ns.timeout)
        row: dict[str, object] = {"case": name, "ready_s": round(up_s, 1), "ready": child is not None}
        if child is not None:
            try:
                sys.argv = [
                    "agentic_replay", "--url", f"http://127.0.0.1:{port}", "--model", served,
                    "--max-model-len", str(max_len), "--requests", str(ns.requests),
                    "--sessions", str(ns.sessions), "--label", name, "--out", str(ns.out / f"replay-{name}.json"),
                ]  # fmt: skip
                agentic_replay.main()
                report = json.loads((ns.out / f"replay-{name}.json").read_text())
                row.update({k: v for k, v in report.items() if k != "answers"})
            except Exception as exc:  # the finding is the failure: keep it and go on
                row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            finally:
                _stop(child)
        lines = [
            line[:400]
            for line in log.read_text(errors="replace").splitlines()
            if any(k in line for k in LOG_KEYS)
        ]
        (ns.out / f"engine-{name}.lines.txt").write_text("\n".join(lines[-80:]) + "\n")
        summary.append(row)
        print(json.dumps(row), flush=True)
    answers = {}
    for name in ns.cases.split(","):
        path = ns.out / f"replay-{name}.json"
        if path.is_file():
            answers[name] = [a["token_ids"] or a["text"] for a in json.loads(path.read_text())["answers"]]
    if "gpu" in answers:
        for name, texts in answers.items():
            same = sum(a == b for a, b in zip(texts, answers["gpu"], strict=False))
            summary.append({"parity_with_gpu": name, "same": same, "of": len(texts)})
    (ns.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary[-3:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
