#!/usr/bin/env python3
"""`m31ctl pull` against huggingface_hub's `snapshot_download`, on the stand-in hub (tests/standin_hub.py).

The repo: config, tokenizer, a safetensors index and N LFS shards (default 4 x 256 MiB: 1 GiB).
Each case runs both tools as whole processes into a fresh cache, interleaved (A B B A ...) so a
machine that slows down or speeds up mid-run weighs on both alike, and prints each run, the median
of each tool and the ratio (snapshot_download's median / pull's: above 1, pull is faster).

Cases: uncapped (loopback, as fast as both ends go) and capped (the stand-in's `rate` knob: every
response at most --cap-mibps, a link that limits each connection, as many CDNs and proxies do).

A benchmark, not a test: it asserts nothing about speed, only that each run fetched the whole repo.

    .venv/bin/python scripts/bench_pull.py                  # 4 x 256 MiB, 3 rounds, cap 50 MiB/s
    .venv/bin/python scripts/bench_pull.py --shard-mib 64 --rounds 2 --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from standin_hub import Repo, RepoFile, StandinHub, standin_hub  # noqa: E402

MIB = 1 << 20

SNAPSHOT_DOWNLOAD = """
import sys
from huggingface_hub import snapshot_download
snapshot_download(sys.argv[1], cache_dir=sys.argv[2])
"""


def bench_repo(shards: int, shard_bytes: int) -> Repo:
    """Shards of bytes that do not compress, named and indexed as a safetensors checkpoint is."""
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    files = {name: RepoFile(os.urandom(shard_bytes), True) for name in names}
    index = {"metadata": {}, "weight_map": {f"layers.{i}.weight": name for i, name in enumerate(names)}}
    files |= {
        ".gitattributes": RepoFile(b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n", False),
        "config.json": RepoFile(json.dumps({"architectures": ["MiniMaxM3ForCausalLM"]}).encode(), False),
        "tokenizer.json": RepoFile(b'{"model": {"vocab": {"a": 0}}}' * 2000, False),
        "model.safetensors.index.json": RepoFile(json.dumps(index).encode(), False),
    }
    repo = Repo("standin/bench-m31", files)
    for f in files.values():  # hash once, before any clock runs
        _ = f.sha256, f.blob_id
    return repo


def run_pull(hub: StandinHub, cache: Path) -> float:
    argv = [sys.executable, "-m", "m31ctl", "pull", "--hardware", "b300x4", "--json",
            "--set", f"model.path={hub.repo.repo_id}", "--set", f"runtime.hf_cache={cache}"]  # fmt: skip
    return _timed(argv, hub, cache)


def run_snapshot_download(hub: StandinHub, cache: Path) -> float:
    return _timed([sys.executable, "-c", SNAPSHOT_DOWNLOAD, hub.repo.repo_id, str(cache / "hub")], hub, cache)


def _timed(argv: list[str], hub: StandinHub, cache: Path) -> float:
    # Both tools alike: no progress bars, and HF_HOME in the fresh cache (no token, no shared store).
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HOME": str(cache)}  # fmt: skip
    env.pop("HF_TOKEN", None)
    hub.reset_counts()
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{argv[2]}: exit {done.returncode}: {done.stderr.strip()[-2000:]}")
    hub.wait_idle()
    sent, size = sum(hub.bytes_sent.values()), hub.repo.size()
    if sent < size:
        raise SystemExit(f"{argv[2]}: the hub sent {sent} bytes of {size}: not the whole repo")
    return elapsed


TOOLS = {"pull": run_pull, "snapshot_download": run_snapshot_download}


def bench_case(hub: StandinHub, rate: float | None, rounds: int, scratch: Path) -> dict[str, object]:
    hub.knobs.rate = rate
    times: dict[str, list[float]] = {name: [] for name in TOOLS}
    most: dict[str, int] = {name: 0 for name in TOOLS}
    order = list(TOOLS)
    for round_ in range(rounds):
        for name in order if round_ % 2 == 0 else order[::-1]:  # A B, B A, A B, ...
            cache = scratch / f"{name}-{round_}"
            times[name].append(TOOLS[name](hub, cache))
            most[name] = max(most[name], hub.most_sending)
            shutil.rmtree(cache, ignore_errors=True)
            print(f"  {name:18s} {times[name][-1]:6.2f} s  ({hub.most_sending} bodies at once)", flush=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "rate_mibps": None if rate is None else rate / MIB,
        "runs_s": times,
        "median_s": medians,
        "most_bodies_at_once": most,
        "ratio": medians["snapshot_download"] / medians["pull"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--shard-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each tool per case")
    parser.add_argument("--cap-mibps", type=float, default=50.0, help="per-response cap of the capped case")
    parser.add_argument("--only", choices=("uncapped", "capped"), help="run one case")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object at the end")
    args = parser.parse_args()

    repo = bench_repo(args.shards, args.shard_mib * MIB)
    cases = {"uncapped": None, "capped": args.cap_mibps * MIB}
    results: dict[str, object] = {}
    with standin_hub(repo) as hub, tempfile.TemporaryDirectory(prefix="bench-pull-") as scratch:
        print(
            f"repo: {len(repo.files)} files, {repo.size() / MIB:.0f} MiB ({args.shards} x {args.shard_mib} MiB)"
        )
        for case, rate in cases.items():
            if args.only and case != args.only:
                continue
            print(
                f"{case}" + (f" ({args.cap_mibps:g} MiB/s per response)" if rate else " (loopback)"),
                flush=True,
            )
            result = bench_case(hub, rate, args.rounds, Path(scratch))
            medians = result["median_s"]
            assert isinstance(medians, dict)
            print(
                f"  median: pull {medians['pull']:.2f} s, snapshot_download {medians['snapshot_download']:.2f} s; "
                f"ratio {result['ratio']:.2f}x (above 1: pull is faster)",
                flush=True,
            )
            results[case] = result
    if args.json:
        print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
