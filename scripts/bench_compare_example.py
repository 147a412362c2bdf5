#!/usr/bin/env python3
"""The example of `m31ctl bench compare` in docs/: two bench runs on the CPU rehearsal (vLLM's CPU
build, natively, the tiny model), one with serving.max_num_seqs=1 and one with 4, compared, their
frontiers drawn together (docs/bench-compare-cpu.png) with a price of 2.50 USD per GPU-hour.

    .venv/bin/python scripts/bench_compare_example.py [--reports DIR] [--plot PATH]

Needs the tests' vLLM (scripts/setup-vllm). Takes a few minutes: two server starts and two sweeps of
three points. The figures are a 2-core CPU's, to show the shape of the output, not a GPU's speed.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import vllm_env  # scripts/vllm_env.py: where the tests' vLLM lives

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = str(vllm_env.python())
SEQS = (1, 4)


def m31ctl(*args: str, env: dict[str, str]) -> None:
    print("+ m31ctl " + " ".join(args), flush=True)
    done = subprocess.run([sys.executable, "-m", "m31ctl", *args], env=env, cwd=ROOT)
    if done.returncode != 0:
        sys.exit(f"m31ctl {args[0]} exited {done.returncode}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=Path, help="keep the two bench reports here")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "bench-compare-cpu.png")
    opts = parser.parse_args()
    if not Path(VLLM_PY).exists():
        sys.exit(f"no Python with vLLM at {VLLM_PY} (scripts/setup-vllm makes it)")
    with tempfile.TemporaryDirectory(prefix="m31ctl-compare-") as tmp:
        work = Path(tmp)
        reports = opts.reports or work / "reports"
        reports.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "M31CTL_STATE_DIR": str(work / "state"), "COLUMNS": "160"}
        model = work / "tiny-model"
        subprocess.run(
            [VLLM_PY, str(ROOT / "m31ctl" / "rehearsal" / "make_tiny_model.py"), str(model)], check=True
        )
        made = []
        for seqs in SEQS:
            plan = [
                "--hardware",
                "cpu",
                "--set",
                f"model.path={model}",
                "--set",
                f"runtime.native_python={VLLM_PY}",
            ]
            plan += [
                "--set",
                f"runtime.container_name=example-seqs{seqs}",
                "--set",
                f"runtime.port={free_port()}",
            ]
            plan += ["--set", f"serving.max_num_seqs={seqs}"]
            report = reports / f"max-num-seqs-{seqs}.json"
            m31ctl("launch", "--runtime", "native", *plan, "--timeout", "600", env=env)
            try:
                m31ctl(
                    "bench", *plan, "--concurrency", "2,4,8", "--requests", "16", "--output-len", "128",
                    "--gpu-hour", "2.5", "-o", str(report), env=env,
                )  # fmt: skip
            finally:
                m31ctl("stop", "--runtime", "native", env=env)
            made.append(str(report))
        m31ctl("bench", "compare", *made, "--plot", str(opts.plot), env=env)


if __name__ == "__main__":
    main()
