"""`vllm bench serve` as the runtimes run it (runtime/load_run.py): the server's key reaches the
benchmark where vLLM's benchmark reads it. Found by the keyed native P/D test (issue 49): every
request of `m31ctl bench` failed in 18 ms against a group with runtime.api_key=true, because the
benchmark sends OPENAI_API_KEY (vllm/benchmarks/lib/endpoint_request_func.py) and m31ctl gave it
only VLLM_API_KEY."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from m31ctl.runtime import load_run

# A stand-in for the engine's Python: writes, as the benchmark's result, the token it would send
# and the argv it got (so the key is seen to travel in the environment alone).
FAKE_PYTHON = """\
import json, os, sys
args = sys.argv[1:]
out = os.path.join(args[args.index("--result-dir") + 1], args[args.index("--result-filename") + 1])
with open(out, "w") as f:
    json.dump({"bearer": os.environ.get("OPENAI_API_KEY"), "argv": args}, f)
"""


@pytest.fixture
def fake_python(tmp_path: Path) -> str:
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\n{FAKE_PYTHON}")
    script.chmod(0o755)
    return str(script)


def test_the_servers_key_reaches_the_benchmark_in_its_environment_alone(fake_python, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "s3cret-bench-key")
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    result = load_run.native_bench(fake_python)(["--base-url", "http://127.0.0.1:9"])
    assert result["bearer"] == "s3cret-bench-key"
    assert "s3cret-bench-key" not in json.dumps(result["argv"])


def test_no_key_no_bearer(fake_python, monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert load_run.native_bench(fake_python)([])["bearer"] is None
    assert load_run.bench_key_env() == {}
