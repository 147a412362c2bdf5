#!/usr/bin/env python3
"""What `m31ctl launch --runtime native` adds to the engine's own start (issue 53: at most 5%).

Interleaved rounds, after one warm-up launch (which runs the deep checks, records their pass and
fills vLLM's compile cache for both sides):
  raw     the engine m31ctl would start, started directly: the same argv and environment
          (m31ctl's own derivation of both), timed from exec to /v1/models listing the model,
          polled every 0.25 s as launch polls;
  m31ctl  `m31ctl launch --runtime native --json` of the same plan, timed from exec to its exit
          (ready), then `m31ctl stop`.
Prints one JSON line per start and a summary; `--out FILE` writes them too.

    python3 scripts/bench_launch_native.py --rounds 3 -- --recipe cpu --set model.path=/tmp/model ...
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLL_S = 0.25


def _plan(plan_args: list[str]) -> tuple[list[str], dict[str, str], int, str]:
    """The engine's argv and environment as the native runtime would start it, its port and the
    served name: from m31ctl's own derivation, so the raw start is the same engine."""
    sys.path.insert(0, str(ROOT))
    from m31ctl.cli.options import PlanOptions
    from m31ctl.deployment import derive
    from m31ctl.engine.adapter import build_invocation
    from m31ctl.plan import resolve
    from m31ctl.runtime.native import command

    parser = argparse.ArgumentParser(prog="plan options")
    for flag in ("--hardware", "--recipe", "--variant", "--profile"):
        parser.add_argument(flag)
    parser.add_argument("--set", action="append", default=[])
    ns = parser.parse_args(plan_args)
    options = PlanOptions(ns.hardware, ns.recipe, ns.variant, ns.profile, (), tuple(ns.set))
    deployment = derive(resolve(options.request()))
    env = {**os.environ, "HF_HOME": deployment.hf_cache, **dict(build_invocation(deployment).env)}
    return command(deployment), env, deployment.network.port, deployment.plan.settings.model.served_name


def _listed(port: int, served: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as answer:
            return any(m.get("id") == served for m in json.loads(answer.read()).get("data", []))
    except (OSError, ValueError):
        return False


def raw_start(
    argv: list[str], env: dict[str, str], port: int, served: str, timeout: float, log: Path
) -> float:
    started = time.monotonic()
    with open(log, "ab") as out:
        child = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while not _listed(port, served):
            if child.poll() is not None or time.monotonic() - started > timeout:
                raise SystemExit(f"the raw engine did not come up (exit {child.poll()}); see {log}")
            time.sleep(POLL_S)
        return time.monotonic() - started
    finally:
        os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def m31ctl_start(plan_args: list[str], timeout: float, log: Path) -> tuple[float, str]:
    m31ctl = [sys.executable, "-m", "m31ctl"]
    started = time.monotonic()
    done = subprocess.run(
        [*m31ctl, "launch", "--runtime", "native", *plan_args, "--json", "--yes", "--no-pull",
         "--timeout", str(int(timeout))],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    seconds = time.monotonic() - started
    with open(log, "a") as out:
        out.write(done.stderr)
    subprocess.run([*m31ctl, "stop", "--runtime", "native"], cwd=ROOT, capture_output=True)
    if done.returncode != 0:
        raise SystemExit(f"m31ctl launch exited {done.returncode}: {done.stderr[-600:]}")
    skipped = "deep checks passed at" in done.stderr
    return seconds, "remembered" if skipped else "ran"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=420)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/m31ctl-bench-launch"))
    parser.add_argument("plan", nargs=argparse.REMAINDER, help="-- then the plan options")
    ns = parser.parse_args()
    plan_args = ns.plan[1:] if ns.plan[:1] == ["--"] else ns.plan
    ns.logs.mkdir(parents=True, exist_ok=True)
    argv, env, port, served = _plan(plan_args)
    rows: list[dict[str, object]] = []

    def emit(row: dict[str, object]) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        if ns.out:
            ns.out.write_text("".join(json.dumps(r) + "\n" for r in rows))

    seconds, deep = m31ctl_start(plan_args, ns.timeout, ns.logs / "m31ctl.log")
    emit({"round": 0, "start": "m31ctl", "seconds": round(seconds, 2), "deep": deep, "warmup": True})
    for n in range(1, ns.rounds + 1):
        seconds = raw_start(argv, env, port, served, ns.timeout, ns.logs / "raw.log")
        emit({"round": n, "start": "raw", "seconds": round(seconds, 2)})
        seconds, deep = m31ctl_start(plan_args, ns.timeout, ns.logs / "m31ctl.log")
        emit({"round": n, "start": "m31ctl", "seconds": round(seconds, 2), "deep": deep})
    raw = [float(r["seconds"]) for r in rows if r["start"] == "raw"]  # type: ignore[arg-type]
    ours = [float(r["seconds"]) for r in rows if r["start"] == "m31ctl" and not r.get("warmup")]  # type: ignore[arg-type]
    summary = {
        "summary": True,
        "raw_median_s": round(statistics.median(raw), 2),
        "m31ctl_median_s": round(statistics.median(ours), 2),
        "added": round(statistics.median(ours) / statistics.median(raw) - 1, 4),
        "argv": argv,
    }
    emit(summary)


if __name__ == "__main__":
    main()
