#!/usr/bin/env python3
"""Whole-process timings of m31ctl commands against the floor of a minimal typer app.

Runs are interleaved (floor, command 1, command 2, ..., floor, ...) so that a noisy machine
slows every command alike; each command's median is divided by the floor's median.

    .venv/bin/python scripts/bench.py --runs 21   # the Python that has m31ctl
    .venv/bin/python scripts/bench.py --runs 11 "plan --hardware b300x4 --json"
    .venv/bin/python scripts/bench.py --runs 11 --first-run   # the memo off, as on a first run
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

FLOOR = [sys.executable, str(Path(__file__).with_name("bench_floor.py")), "--name", "x", "--count", "2"]
# The goals (issue 53; 1.3x since issue 12): the commands that touch neither Docker nor GPUs cost
# at most 1.15x the floor, warm (the memo of parsed recipes and emitted YAML filled, as from the
# second run on); --help at most 1.0x.
DEFAULT = {
    "--help": 1.0,
    "plan --hardware b300x4 --json": 1.15,
    # Pinned to a commit: render asks the hub otherwise (a network round trip, not m31ctl's cost).
    "render --target k8s --hardware b300x4 --revision 0123456789abcdef0123456789abcdef01234567": 1.15,
    "capacity --hardware b300x4 --json": 1.15,
}
# --first-run: the memo off (M31CTL_NO_CACHE=1, as on a command's first run: PyYAML imported, the
# recipes parsed), at most 1.3x.
FIRST_RUN = {command: 1.0 if goal == 1.0 else 1.3 for command, goal in DEFAULT.items()}


# An installed wheel runs from byte-compiled modules (pip compiles them at install); a
# PYTHONDONTWRITEBYTECODE inherited from the shell would make every m31ctl module compile from
# source on every run, a cost the floor (one file) never pays and no user sees.
_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def _once(argv: list[str], env: dict[str, str] = _ENV) -> tuple[float, int]:
    start = time.perf_counter()
    code = subprocess.run(argv, capture_output=True, check=False, env=env).returncode
    return time.perf_counter() - start, code


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--first-run", action="store_true", help="the memo off (M31CTL_NO_CACHE=1)")
    parser.add_argument("commands", nargs="*", help="m31ctl arguments, one string per command")
    ns = parser.parse_args()
    table = FIRST_RUN if ns.first_run else DEFAULT
    goals = {c: table.get(c) for c in ns.commands} if ns.commands else dict(table)
    # The floor keeps the caller's environment; m31ctl gets the memo off with --first-run.
    envs = {"floor": _ENV} | {c: _ENV | {"M31CTL_NO_CACHE": "1"} if ns.first_run else _ENV for c in goals}
    argvs = {"floor": FLOOR} | {c: [sys.executable, "-m", "m31ctl", *shlex.split(c)] for c in goals}
    samples: dict[str, list[float]] = {k: [] for k in argvs}
    codes: dict[str, set[int]] = {k: set() for k in argvs}
    for name, argv in argvs.items():  # warm the file cache (and the memo) once, untimed
        _once(argv, envs[name])
    for _ in range(ns.runs):
        for name, argv in argvs.items():
            seconds, code = _once(argv, envs[name])
            samples[name].append(seconds)
            codes[name].add(code)
    floor = statistics.median(samples["floor"])
    rows = []
    for name in argvs:
        median = statistics.median(samples[name])
        goal = goals.get(name)
        rows.append(
            {
                "command": "typer floor" if name == "floor" else f"m31ctl {name}",
                "median_s": round(median, 4),
                "ratio": round(median / floor, 2),
                "goal": goal,
                "meets_goal": None if goal is None else median / floor <= goal,
                "exit_codes": sorted(codes[name]),
            }
        )
    if ns.json:
        json.dump({"runs": ns.runs, "first_run": ns.first_run, "results": rows}, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        for r in rows:
            goal = "" if r["goal"] is None else f"  goal <= {r['goal']}x: {'ok' if r['meets_goal'] else 'MISSED'}"
            print(f"{r['median_s']:.3f} s  {r['ratio']:.2f}x  {r['command']}  exit {r['exit_codes']}{goal}")
    return 0 if all(r["meets_goal"] is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
