#!/usr/bin/env python3
"""What `m31ctl launch --runtime native` adds to the engine's own start (issue 53: at most 5%).

Interleaved rounds, after one warm-up launch (which runs the deep checks, records their pass and
fills vLLM's compile cache for both sides):
  raw     the engine m31ctl would start, started directly: the same argv and environment
          (m31ctl's own derivation of both), timed from exec to /v1/models listing the model,
          polled every 0.25 s as launch polls;
  m31ctl  `m31ctl launch --runtime native --json` of the same plan, timed from exec to its exit
          (ready), then `m31ctl stop`.
Each stop waits until every process of the engine's group is gone (`m31ctl stop` does; the raw
side's did not, so its engine core was still letting go of the GPU while the next launch started),
then SETTLE_S more, and the order alternates by round (raw first in odd rounds, m31ctl first in
even ones), so neither side always starts on the other's heels. An m31ctl row also carries the
engine's own time to /health as launch printed it, and launch's own part (the rest).
Prints one JSON line per start and a summary; `--out FILE` writes them too. `--profile FILE`
runs one more launch under cProfile at the end (not counted) and writes its stats there.

    python3 scripts/bench_launch_native.py --rounds 3 -- --recipe cpu --set model.path=/tmp/model ...
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLL_S = 0.25
SETTLE_S = 2.0  # after every stop, on both sides: the driver's release of the last context
HEALTH_LINE = re.compile(r"/health answers 200 \(([0-9.]+) s\)")


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
        _group_gone(child.pid)
        time.sleep(SETTLE_S)


def _group_gone(pgid: int, timeout: float = 60) -> None:
    """Wait as `m31ctl stop` waits: until no process of the group is left (vLLM's engine core and
    its resource tracker outlive the API server by seconds); SIGKILL what is left after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            os.killpg(pgid, signal.SIGKILL)
            deadline = time.monotonic() + timeout
        time.sleep(0.2)


# The environment each launched engine ran with (/proc/PID/environ), set beside the raw side's:
# a difference is the first suspect when the engine's own start differs between the sides.
ENGINE_ENVIRONS: list[dict[str, str]] = []


def _engine_environ() -> dict[str, str] | None:
    shown = subprocess.run(
        [sys.executable, "-m", "m31ctl", "status", "--runtime", "native", "--json"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    try:
        (server,) = json.loads(shown.stdout)["data"]["servers"]
        raw = Path(f"/proc/{server['pid']}/environ").read_bytes()
    except (ValueError, KeyError, OSError):
        return None
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def env_difference(raw: dict[str, str], launched: dict[str, str]) -> dict[str, object]:
    """Names set on one side only, and names whose values differ (values cut to 120 characters)."""
    return {
        "only_launched": {k: v[:120] for k, v in sorted(launched.items()) if k not in raw},
        "only_raw": {k: v[:120] for k, v in sorted(raw.items()) if k not in launched},
        "differ": {
            k: [raw[k][:120], launched[k][:120]]
            for k in sorted(raw)
            if k in launched and raw[k] != launched[k]
        },
    }


def m31ctl_start(
    plan_args: list[str], timeout: float, log: Path, profile: Path | None = None
) -> tuple[float, str, float | None]:
    m31ctl = [sys.executable, *(["-m", "cProfile", "-o", str(profile)] if profile else []), "-m", "m31ctl"]
    started = time.monotonic()
    done = subprocess.run(
        [*m31ctl, "launch", "--runtime", "native", *plan_args, "--json", "--yes", "--no-pull",
         "--timeout", str(int(timeout))],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    seconds = time.monotonic() - started
    with open(log, "a") as out:
        out.write(done.stderr)
    environ = _engine_environ() if done.returncode == 0 else None
    subprocess.run(
        [sys.executable, "-m", "m31ctl", "stop", "--runtime", "native"], cwd=ROOT, capture_output=True
    )
    time.sleep(SETTLE_S)
    if environ is not None:
        ENGINE_ENVIRONS.append(environ)
    if done.returncode != 0:
        raise SystemExit(f"m31ctl launch exited {done.returncode}: {done.stderr[-600:]}")
    skipped = "deep checks passed at" in done.stderr
    health = HEALTH_LINE.search(done.stderr)
    return seconds, "remembered" if skipped else "ran", float(health.group(1)) if health else None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=420)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/m31ctl-bench-launch"))
    parser.add_argument(
        "--skip-deep",
        action="store_true",
        help="launch with --skip-deep (a try of this script on a stand-in engine)",
    )
    parser.add_argument("--profile", type=Path, help="one more launch under cProfile, its stats here")
    parser.add_argument("plan", nargs=argparse.REMAINDER, help="-- then the plan options")
    ns = parser.parse_args()
    plan_args = ns.plan[1:] if ns.plan[:1] == ["--"] else ns.plan
    launch_args = [*plan_args, *(["--skip-deep"] if ns.skip_deep else [])]
    ns.logs.mkdir(parents=True, exist_ok=True)
    argv, env, port, served = _plan(plan_args)
    rows: list[dict[str, object]] = []

    def emit(row: dict[str, object]) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)
        if ns.out:
            ns.out.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def ours(n: int, warmup: bool = False) -> None:
        seconds, deep, health = m31ctl_start(launch_args, ns.timeout, ns.logs / "m31ctl.log")
        row: dict[str, object] = {"round": n, "start": "m31ctl", "seconds": round(seconds, 2), "deep": deep}
        if health is not None:
            row |= {"engine_to_health_s": health, "own_s": round(seconds - health, 2)}
        emit(row | ({"warmup": True} if warmup else {}))

    def raw(n: int) -> None:
        seconds = raw_start(argv, env, port, served, ns.timeout, ns.logs / "raw.log")
        emit({"round": n, "start": "raw", "seconds": round(seconds, 2)})

    ours(0, warmup=True)
    for n in range(1, ns.rounds + 1):
        for start in (raw, ours) if n % 2 else (ours, raw):
            start(n)
    raw = [float(r["seconds"]) for r in rows if r["start"] == "raw"]  # type: ignore[arg-type]
    ours = [float(r["seconds"]) for r in rows if r["start"] == "m31ctl" and not r.get("warmup")]  # type: ignore[arg-type]
    summary = {
        "summary": True,
        "raw_median_s": round(statistics.median(raw), 2),
        "m31ctl_median_s": round(statistics.median(ours), 2),
        "added": round(statistics.median(ours) / statistics.median(raw) - 1, 4),
        "own_median_s": statistics.median(
            [float(r["own_s"]) for r in rows if "own_s" in r and not r.get("warmup")]  # type: ignore[arg-type]
            or [0.0]
        ),
        "argv": argv,
    }
    if ENGINE_ENVIRONS:
        summary["env"] = env_difference(env, ENGINE_ENVIRONS[-1])
    emit(summary)
    if ns.profile:
        m31ctl_start(launch_args, ns.timeout, ns.logs / "m31ctl.log", profile=ns.profile)


if __name__ == "__main__":
    main()
