"""The two ways to run `vllm bench serve` with the engine's own Python: a local Python with vLLM
(the native runtime's), a sibling container of the engine image (the Docker runtime's). Only the
launch lives here, beside the runtimes that choose it (Runtime.bench_runner); what to run, the
arguments and the figures, is m31ctl/served/ (verify and bench), which imports this and never
the reverse."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from m31ctl.redact import API_KEY_ENV
from m31ctl.runtime import engine_api

# A bench runner takes `vllm bench serve` arguments and returns its saved result.
BenchRunner = Callable[[list[str]], dict[str, Any]]
BENCH_SCRIPT = Path(__file__).resolve().parent.parent / "engine" / "bench_serve.py"
# `vllm bench serve` sends this variable's value as its bearer token, and no other
# (vllm/benchmarks/lib/endpoint_request_func.py, 0.32: `os.environ.get("OPENAI_API_KEY")`).
BENCH_KEY_ENV = "OPENAI_API_KEY"


def bench_key_env() -> dict[str, str]:
    """The server's key (VLLM_API_KEY, as every m31ctl client reads it) where the benchmark looks
    for it; nothing when the server has none. In the environment alone: never its argv."""
    key = os.environ.get(API_KEY_ENV)
    return {BENCH_KEY_ENV: key} if key else {}


def native_bench(python: str) -> BenchRunner:
    """The benchmark run by a local Python that has vLLM (the native runtime's)."""

    def run_bench(args: list[str]) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="m31ctl-bench-") as tmp:
            done = subprocess.run(
                [
                    python,
                    str(BENCH_SCRIPT),
                    *args,
                    "--save-result",
                    "--result-dir",
                    tmp,
                    "--result-filename",
                    "r.json",
                ],
                capture_output=True,
                text=True,
                timeout=3600,
                env={**os.environ, **bench_key_env()},
            )
            result = Path(tmp) / "r.json"
            if done.returncode != 0 or not result.is_file():
                raise RuntimeError((done.stderr or done.stdout).strip().splitlines()[-1:] or "no result")
            data: dict[str, Any] = json.loads(result.read_text())
            return data

    return run_bench


def container_bench(image: str, mounts: list[tuple[str, str]]) -> BenchRunner:
    """The benchmark run by the engine image's own vLLM, in a sibling container on the host's
    network (the server's port is published there), with the server's model and cache mounts
    for the tokenizer."""

    def run_bench(args: list[str]) -> dict[str, Any]:
        with (
            engine_api.engine_boundary("running vllm bench serve"),
            tempfile.TemporaryDirectory(prefix="m31ctl-bench-") as tmp,
        ):
            os.chmod(tmp, 0o777)
            volumes = {source: {"bind": target, "mode": "ro"} for source, target in mounts}
            volumes[str(BENCH_SCRIPT.parent)] = {"bind": "/m31ctl", "mode": "ro"}
            volumes[tmp] = {"bind": "/m31ctl-out", "mode": "rw"}
            client = engine_api.connect()
            binds = {source: {"bind": b["bind"], "mode": b["mode"]} for source, b in volumes.items()}
            host = client.api.create_host_config(binds=binds, network_mode="host")
            out = ["--save-result", "--result-dir", "/m31ctl-out", "--result-filename", "r.json"]
            # A throwaway: removed whatever happens after create (a refused start, Ctrl-C), where
            # run(remove=True) kept a container whose start failed.
            with engine_api.throwaway(
                client, "bench", image=image, entrypoint=["python3", "/m31ctl/bench_serve.py"],
                command=[*args, *out], host_config=host, environment=bench_key_env(),
            ) as container:  # fmt: skip
                container.start()
                code = int(container.wait().get("StatusCode", -1))
                if code != 0:
                    tail = container.logs(tail=20).decode("utf-8", "replace")
                    # As the native runner: the caller reports it as the load check's failure.
                    raise RuntimeError(f"vllm bench serve exited {code} in {image}: {tail[-400:]}")
            data: dict[str, Any] = json.loads((Path(tmp) / "r.json").read_text())
            return data

    return run_bench
