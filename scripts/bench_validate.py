#!/usr/bin/env python3
"""Validation cost: m31ctl's schema check in-process and whole-process, against building and
running vLLM's own `vllm serve` parser (needs a Python with vLLM: scripts/setup-vllm's by default).

    python3 scripts/bench_validate.py [--vllm-python PYTHON]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import vllm_env  # scripts/vllm_env.py: where the tests' vLLM lives

ROOT = Path(__file__).resolve().parent.parent
PARSE = """
import json, sys
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.entrypoints.launchers.cli_args import make_arg_parser
parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
parser.parse_args(json.loads(sys.argv[1]))
"""


def main() -> None:
    ns = argparse.ArgumentParser(description=__doc__)
    ns.add_argument("--vllm-python", default=str(vllm_env.python()))
    ns.add_argument("--runs", type=int, default=5)
    opts = ns.parse_args()
    sys.path.insert(0, str(ROOT))
    from m31ctl.engine.adapter import build_invocation
    from m31ctl.engine.validate import schema_for, validate
    from m31ctl.hardware import simulated
    from m31ctl.plan import PlanRequest, resolve

    plan = resolve(PlanRequest(hardware=simulated("b300x4")))
    inv = build_invocation(plan)
    schema = schema_for(inv.image, "0.32.0")
    validate(inv, schema)  # load the schema once, as a process does
    samples = []
    for _ in range(200):
        start = time.perf_counter()
        validate(inv, schema)
        samples.append(time.perf_counter() - start)
    print(f"m31ctl validate, in-process (schema loaded): median {statistics.median(samples) * 1000:.2f} ms")
    whole = []
    for _ in range(opts.runs):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "m31ctl", "validate", "--hardware", "b300x4"], cwd=ROOT,
                       capture_output=True, check=True)
        whole.append(time.perf_counter() - start)
    print(f"m31ctl validate --hardware b300x4, whole process: median {statistics.median(whole):.3f} s")
    if not Path(opts.vllm_python).exists():
        print("vLLM parser: skipped (no Python with vLLM)")
        return
    argv = list(inv.args)  # the parser does not look inside JSON configs, so FLASHINFER_TS parses
    parse = []
    for _ in range(max(2, opts.runs // 2)):
        start = time.perf_counter()
        subprocess.run([opts.vllm_python, "-c", PARSE, json.dumps(argv)], capture_output=True, check=True)
        parse.append(time.perf_counter() - start)
    print(f"vLLM make_arg_parser + parse_args, whole process: median {statistics.median(parse):.3f} s")


if __name__ == "__main__":
    main()
