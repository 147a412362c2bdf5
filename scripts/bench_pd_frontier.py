#!/usr/bin/env python3
"""bench's frontier for a P/D group beside the aggregated layout's, on one host (issue 36).

Makes the rehearsal's tiny model, then, natively with vLLM's CPU build (scripts/setup-vllm):
  1. launches the aggregated CPU plan (`--hardware cpu`), runs `m31ctl bench` at concurrency
     1,2,4 against it (aggregated.json), stops it;
  2. launches the P/D plan (`--hardware cpu --variant pd`: prefill and decode engines joined by
     NIXL behind vllm-router), runs the same bench (pd.json; each point carries kv_transfer),
     stops it;
  3. prints `m31ctl bench compare aggregated.json pd.json` and draws both frontiers to
     docs/bench-pd-vs-aggregated-cpu.png.

Both layouts run --dtype float16 (the pd variant needs it on AMX CPUs), so dtype is not what
differs. Throughput is per "GPU": the aggregated engine counts one, the P/D pair two. On a
shared 2-core host the figures reflect the machine's load (printed with each step) as much as
the layouts: they show the shape of the comparison, not a cost.

    .venv/bin/python scripts/bench_pd_frontier.py [--plot PATH] [--requests N]

Takes 10-20 minutes: three vLLM starts and two sweeps. Everything it starts lives under a state
dir of its own on free ports, and is stopped on the way out (also on Ctrl-C or SIGTERM).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import vllm_env  # scripts/vllm_env.py: where the tests' vLLM lives

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = str(vllm_env.python())
FLOAT16 = '["--enforce-eager","-O0","--dtype","float16"]'  # the pd variant's engine args
STARTED = time.monotonic()


def say(message: str) -> None:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"[{time.monotonic() - STARTED:6.0f} s, load {load}] {message}", file=sys.stderr, flush=True)


def m31ctl(*args: str, env: dict[str, str], out: int | None = None) -> int:
    """Run m31ctl in a session of its own (so a terminal's Ctrl-C reaches us first), its output on
    stderr unless `out`; on Ctrl-C pass the signal on and let it clean up what it started."""
    cmd = [sys.executable, "-m", "m31ctl", *args]
    print("+ m31ctl " + " ".join(args), file=sys.stderr, flush=True)
    child = subprocess.Popen(
        cmd, env=env, cwd=ROOT, stdout=sys.stderr.fileno() if out is None else out, start_new_session=True
    )
    try:
        return child.wait()
    except KeyboardInterrupt:
        child.send_signal(signal.SIGINT)
        try:
            child.wait(timeout=120)
        except subprocess.TimeoutExpired:
            child.kill()
        raise


def free_ports(count: int) -> list[int]:
    held = [socket.socket() for _ in range(count)]
    try:
        for s in held:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in held]
    finally:
        for s in held:
            s.close()


def measure(layout: str, plan: list[str], env: dict[str, str], bench: list[str], report: Path) -> None:
    name = f"pdfront-{layout}-{uuid.uuid4().hex[:6]}"
    try:
        say(f"{layout}: launching {name}")
        launch = ["launch", "--runtime", "native", "--name", name, "--timeout", "900", *plan]
        if m31ctl(*launch, env=env) != 0:
            sys.exit(f"{layout}: m31ctl launch failed (logs under {env['M31CTL_STATE_DIR']})")
        say(f"{layout}: ready; bench {' '.join(bench)}")
        if m31ctl("bench", "--runtime", "native", "--name", name, *bench, "-o", str(report), env=env) != 0:
            sys.exit(f"{layout}: m31ctl bench failed")
        say(f"{layout}: report {report}")
    finally:
        say(f"{layout}: stopping")
        m31ctl("stop", "--runtime", "native", "--all", env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "bench-pd-vs-aggregated-cpu.png")
    parser.add_argument("--requests", type=int, default=8, help="requests per point")
    parser.add_argument("--output-len", type=int, default=64)
    opts = parser.parse_args()
    if not Path(VLLM_PY).exists():
        sys.exit(f"no Python with vLLM at {VLLM_PY} (scripts/setup-vllm makes it)")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM cleans up as Ctrl-C does
    work = Path(tempfile.mkdtemp(prefix="m31ctl-pd-frontier-"))
    say(f"work dir {work} (state, model, reports)")
    env = {**os.environ, "M31CTL_STATE_DIR": str(work / "state"), "COLUMNS": "160"}
    model = work / "tiny-model"
    say("making the tiny model")
    made = [VLLM_PY, str(ROOT / "m31ctl/rehearsal/make_tiny_model.py"), str(model)]
    subprocess.run(made, check=True, stdout=sys.stderr)
    common = [
        "--hardware",
        "cpu",
        "--set",
        f"model.path={model}",
        "--set",
        f"runtime.native_python={VLLM_PY}",
    ]
    bench = ["--concurrency", "1,2,4", "--requests", str(opts.requests), "--output-len", str(opts.output_len)]

    (port,) = free_ports(1)
    aggregated = [*common, "--port", str(port), "--set", f"engine.extra_args={FLOAT16}"]
    measure("aggregated", aggregated, env, bench, work / "aggregated.json")

    api, prefill, decode, prefill_side, decode_side = free_ports(5)
    pd = [*common, "--variant", "pd", "--port", str(api)]
    for key, value in {
        "prefill.port": prefill,
        "decode.port": decode,
        "prefill.side_channel_port": prefill_side,
        "decode.side_channel_port": decode_side,
    }.items():
        pd += ["--set", f"disaggregation.{key}={value}"]
    measure("pd", pd, env, bench, work / "pd.json")

    say("comparing")
    reports = [str(work / "aggregated.json"), str(work / "pd.json")]
    compare = ["bench", "compare", *reports, "--plot", str(opts.plot), "-o", str(work / "compare.json")]
    if m31ctl(*compare, env=env, out=sys.stdout.fileno()) != 0:
        sys.exit("m31ctl bench compare failed")
    say(f"plot {opts.plot}; reports {', '.join(reports)}; comparison {work / 'compare.json'}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit("interrupted: what was launched has been stopped")
