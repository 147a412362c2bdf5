#!/usr/bin/env python3
"""Launch overhead against the real Docker Engine, with the stand-in engine image (tests/engine_image).

1. From the server first answering /v1/models (an independent poller, every 10 ms) to
   `m31ctl launch` exiting.
2. Whole `m31ctl launch` against a plain `docker run` of the same image plus the same readiness
   wait (/health 200, then /v1/models lists the model), polled every 0.25 s like m31ctl.

    python3 scripts/bench_launch.py --runs 5
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
DELAY = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def first_answer(port: int, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=0.5).status_code == 200:
                out.append(time.perf_counter())
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.01)


def m31ctl_launch(image: str, tmp: str) -> tuple[float, float]:
    port, name = free_port(), f"m31ctl-bench-{free_port()}"
    stop, seen = threading.Event(), []
    poller = threading.Thread(target=first_answer, args=(port, stop, seen))
    poller.start()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "m31ctl", "launch", "--hardware", "cpu", "--name", name, "--port", str(port),
                    "--set", f"engine.image={image}", "--set", f"model.path={tmp}",
                    "--set", f"runtime.env.FAKE_ENGINE_DELAY={DELAY}"], cwd=ROOT, check=True, capture_output=True)
    end = time.perf_counter()
    stop.set()
    poller.join()
    subprocess.run(["docker", "rm", "-f", name], capture_output=True)
    return end - start, end - seen[0]


def plain_docker(image: str) -> float:
    port, name = free_port(), f"plain-bench-{free_port()}"
    start = time.perf_counter()
    subprocess.run(["docker", "run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:8000", "-e",
                    f"FAKE_ENGINE_DELAY={DELAY}", image, "/models/x", "--served-model-name", "m31ctl-rehearsal"],
                   check=True, capture_output=True)
    base = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                ids = [m["id"] for m in httpx.get(f"{base}/v1/models", timeout=2).json()["data"]]
                if "m31ctl-rehearsal" in ids:
                    break
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    end = time.perf_counter()
    subprocess.run(["docker", "rm", "-f", name], capture_output=True)
    return end - start


def main() -> None:
    opts = argparse.ArgumentParser(description=__doc__)
    opts.add_argument("--runs", type=int, default=5)
    ns = opts.parse_args()
    sys.path.insert(0, str(ROOT))
    from m31ctl.runtime.engine_api import connect
    from tests.dockerlib import build_engine_images

    image = build_engine_images(connect())["ready"]
    tmp = "/tmp"
    launches = [m31ctl_launch(image, tmp) for _ in range(ns.runs)]
    plains = [plain_docker(image) for _ in range(ns.runs)]
    overhead = statistics.median(o for _, o in launches)
    print(f"engine stand-in ready after {DELAY} s of 'loading'; {ns.runs} runs each")
    print(f"first /v1/models answer -> m31ctl launch exits: median {overhead * 1000:.0f} ms "
          f"(max {max(o for _, o in launches) * 1000:.0f} ms)")
    print(f"whole m31ctl launch: median {statistics.median(t for t, _ in launches):.2f} s")
    print(f"plain docker run + the same readiness wait: median {statistics.median(plains):.2f} s")


if __name__ == "__main__":
    main()
