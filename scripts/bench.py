#!/usr/bin/env python3
"""Whole-process timings of m31ctl commands: median of N runs (what a user waits for).

python3 scripts/bench.py --runs 11 "plan --hardware b300x4" "capacity --hardware b300x4"
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time


def time_command(args: list[str], runs: int) -> dict[str, object]:
    samples = []
    codes = set()
    for _ in range(runs):
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "m31ctl", *args], capture_output=True, check=False)
        samples.append(time.perf_counter() - start)
        codes.add(proc.returncode)
    return {
        "command": "m31ctl " + shlex.join(args),
        "runs": runs,
        "median_s": round(statistics.median(samples), 3),
        "min_s": round(min(samples), 3),
        "max_s": round(max(samples), 3),
        "exit_codes": sorted(codes),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=11)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("commands", nargs="+")
    ns = parser.parse_args()
    results = [time_command(shlex.split(c), ns.runs) for c in ns.commands]
    if ns.json:
        json.dump(results, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    for r in results:
        print(
            f"{r['median_s']:.3f} s median ({r['min_s']:.3f}-{r['max_s']:.3f}, n={r['runs']}, exit {r['exit_codes']})  {r['command']}"
        )


if __name__ == "__main__":
    main()
