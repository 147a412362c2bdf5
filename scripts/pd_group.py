"""A real prefill/decode group on this machine, natively: a prefill vLLM and a decode vLLM (the CPU
build, scripts/setup-vllm) paired by vLLM's NixlConnector over UCX/TCP on loopback, vllm-router in
front (`--vllm-pd-disaggregation`), and an aggregated vLLM to compare with, for
scripts/bench_pd.py (issue 36). (The pair's proof in the test command is `m31ctl rehearse` of the
rendered pair, tests/rehearsal/test_rehearse_pd.py, and the native launch, tests/runtime/test_launch_pd.py.)

Every process starts in its own session (process group), so stopping it stops vLLM's engine
core child too; `Group` stops whatever it started, whatever happened. Waiting is by bounded,
generous polls: nothing here decides an outcome by how fast the machine is.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import vllm_env  # scripts/vllm_env.py: where the tests' vLLM lives

# scripts/loopback.py: ports and HTTP, shared with the tests; metrics_text for scripts/bench_pd.py
from loopback import Answer, free_port, request
from loopback import metrics_text as metrics_text

ROOT = Path(__file__).resolve().parent.parent
SERVED_NAME = "tiny"
# vLLM's CPU start on two shared cores takes 60-150 s; a busy machine may take several times that.
START_TIMEOUT_S = 900.0
STOP_GRACE_S = 30.0


def vllm_python() -> Path:
    return vllm_env.python()


def router_binary() -> Path:
    """vllm-router's console script, next to the vLLM Python (scripts/setup-vllm installs it)."""
    return vllm_python().parent / "vllm-router"


def make_tiny_model(directory: Path) -> Path:
    """The rehearsal's tiny model (m31ctl/rehearsal/make_tiny_model.py), made on the spot."""
    subprocess.run(
        [str(vllm_python()), str(ROOT / "m31ctl" / "rehearsal" / "make_tiny_model.py"), str(directory)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    return directory


# ---------------------------------------------------------------------------------------------
# What each role needs (measured here; docs/decisions.md "P/D: real parts (issue 36)").

KV_ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
# float16, not the checkpoint's bfloat16: with bfloat16 on a CPU with AMX, vLLM picks its "amx"
# attention kernel (v1/attention/backends/cpu_attn.py _get_attn_isa), and the decode instance's
# worker died of SIGILL inside cpu_attention_with_kv_cache at its first request whose KV came
# from prefill (seen here, on a Xeon with amx_bf16). float16 selects the "vec" kernel, which
# serves. Every instance takes the same dtype: NIXL's compatibility hash includes it
# (nixl/metadata.py compute_nixl_compatibility_hash), and parity needs the same numerics.
ENGINE_ARGS: tuple[str, ...] = ("--dtype", "float16")


def engine_env(core: str, side_channel_port: int | None) -> dict[str, str]:
    """The environment of one vLLM instance on the CPU build. `side_channel_port` None: no
    connector (the aggregated server)."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of host memory for the KV cache (CPU backend)
        "VLLM_CPU_OMP_THREADS_BIND": core,  # one core per instance: two on two cores starve otherwise
        "HF_HUB_OFFLINE": "1",  # the model is a local directory; nothing to ask the hub
    }
    if side_channel_port is not None:
        env |= {
            # NIXL's handshake listener (nixl/base_scheduler.py: VLLM_NIXL_SIDE_CHANNEL_PORT +
            # data_parallel_index); the decode side connects to the prefill side's, whose host
            # and port come back in the prefill answer's kv_transfer_params.
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
            # UCX over TCP on loopback: no RDMA, no CUDA on this machine. Not required here (a
            # run without them transferred as well: UCX chose by itself), but they pin the
            # transport and the device instead of leaving it to UCX's probing.
            "UCX_TLS": "tcp,self,sm",
            "UCX_NET_DEVICES": "lo",
        }
    return env


def engine_argv(model: Path, port: int, kv_role: str | None, extra: tuple[str, ...] = ()) -> list[str]:
    argv = [
        str(vllm_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",  # the `vllm` script fails for the vllm-cpu distribution
        "--model",
        str(model),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "-O0",
        "--max-model-len",
        "2048",
    ]
    argv += extra
    if kv_role is not None:
        argv += ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role})]
    return argv


def router_argv(port: int, prefill: str, decode: str, prometheus_port: int) -> list[str]:
    return [
        str(router_binary()),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--vllm-pd-disaggregation",
        "--prefill",
        prefill,
        "--decode",
        decode,
        "--kv-connector",
        "nixl",
        # cache_aware, the default, adds a render call to each side per request.
        "--policy",
        "round_robin",
        "--worker-startup-check-interval",
        "1",
        "--health-check-interval-secs",
        "5",
        # A worker's /health on a loaded machine can take longer than the default 5 s: three
        # such answers marked decode unhealthy here (503 "No available workers: 1 prefill, 0
        # decode") while it was serving. A dead worker still fails at once (connection refused).
        "--health-check-timeout-secs",
        "30",
        # Its exporter is always on and the router dies if the port is taken: choose it free.
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(prometheus_port),
    ]


# ---------------------------------------------------------------------------------------------
# Processes.


@dataclass
class Process:
    name: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    popen: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        with self.log.open("ab") as out:
            self.popen = subprocess.Popen(
                self.argv,
                env={**os.environ, **self.env},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: vLLM's engine core goes with it
            )
        return self

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        """A crash: SIGKILL to the whole process group, no chance to clean up."""
        self._signal_group(signal.SIGKILL)
        if self.popen is not None:
            self.popen.wait()

    def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after a grace period; idempotent."""
        if self.popen is None:
            return
        if self.popen.poll() is None:
            self._signal_group(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=STOP_GRACE_S)
        # Whatever of the group is still there (an engine core that outlived its parent).
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout=STOP_GRACE_S)

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.popen is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, sig)  # the group's id is the leader's pid (start_new_session)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class Engine:
    """One vLLM instance: its role ("prefill", "decode", or "aggregated") and its ports."""

    role: str
    process: Process
    port: int
    side_channel_port: int | None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def engine(role: str, model: Path, logs: Path, core: str, extra: tuple[str, ...] = ENGINE_ARGS) -> Engine:
    kv_role = KV_ROLE.get(role)
    port = free_port()
    side = free_port() if kv_role else None
    argv = engine_argv(model, port, kv_role, extra)
    process = Process(role, argv, engine_env(core, side), logs / f"{role}.log")
    return Engine(role, process, port, side)


@dataclass
class Router:
    process: Process
    port: int
    prometheus_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def router(prefill: Engine, decode: Engine, logs: Path) -> Router:
    port, prometheus_port = free_port(), free_port()
    argv = router_argv(port, prefill.url, decode.url, prometheus_port)
    return Router(Process("router", argv, {}, logs / "router.log"), port, prometheus_port)


# ---------------------------------------------------------------------------------------------
# HTTP, with the standard library only (the test runs in .venv, the servers in vLLM's environment):
# scripts/loopback.py's request and metrics_text.


def completion(base: str, prompt: str, max_tokens: int = 16) -> Answer:
    """A greedy completion: temperature 0 and no stop but the length, so two servers with the same
    weights must give the same tokens."""
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    return request(f"{base}/v1/completions", body)


class Timed(NamedTuple):
    """A streamed completion as the client saw it."""

    text: str
    ttft_s: float  # request sent -> first token
    tpot_s: float  # mean time between tokens after the first
    tokens: int
    total_s: float


def streamed_completion(
    base: str, prompt: str, max_tokens: int = 32, kv_transfer_params: dict[str, Any] | None = None
) -> Timed:
    """A greedy streamed completion, timed from the request to each token (SSE chunks).
    `kv_transfer_params`: a prefill instance's answer, for a decode instance asked directly."""
    host, port = base.removeprefix("http://").split(":")
    fields: dict[str, Any] = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    if kv_transfer_params is not None:
        fields["kv_transfer_params"] = kv_transfer_params
    body = json.dumps(fields)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{base} answered HTTP {resp.status}: {resp.read()[:300]!r}")
    stamps: list[float] = []
    text = []
    for raw in resp:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data:") :])
        piece = "".join(choice.get("text", "") for choice in chunk.get("choices", []))
        if chunk.get("choices"):
            stamps.append(time.perf_counter())
            text.append(piece)
    end = time.perf_counter()
    conn.close()
    if not stamps:
        raise RuntimeError(f"{base} streamed no token")
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    return Timed("".join(text), stamps[0] - start, tpot, len(stamps), end - start)


def wait_until(
    what: str, ready: Callable[[], bool], timeout: float, watch: list[Process] | None = None
) -> None:
    """Poll `ready` every second until it holds; fail after `timeout` seconds, or at once when a
    watched process has exited (its log tail in the message)."""
    deadline = time.monotonic() + timeout
    while True:
        if ready():
            return
        for process in watch or ():
            if not process.alive:
                raise RuntimeError(f"{process.name} exited while waiting for {what}:\n{process.log_tail()}")
        if time.monotonic() > deadline:
            tails = "".join(f"\n--- {p.name} log tail ---\n{p.log_tail()}" for p in watch or ())
            raise TimeoutError(f"{what}: not within {timeout:.0f} s{tails}")
        time.sleep(1.0)


def healthy(base: str) -> bool:
    return request(f"{base}/health", timeout=10).status == 200


# ---------------------------------------------------------------------------------------------
# The group.


@dataclass
class Group:
    """Prefill, decode and router (and optionally an aggregated server), started together and
    stopped together. Use as a context manager."""

    model: Path
    logs: Path
    aggregated: bool = True
    # VLLM_CPU_OMP_THREADS_BIND of prefill and decode; the aggregated server takes decode's core.
    cores: tuple[str, str] = ("0", "1")
    prefill: Engine = field(init=False)
    decode: Engine = field(init=False)
    reference: Engine | None = field(init=False, default=None)
    router: Router = field(init=False)

    def __post_init__(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        # One core each for prefill and decode; the aggregated server shares decode's core (it is
        # stopped once its answers are in, or measured while the group idles).
        self.prefill = engine("prefill", self.model, self.logs, self.cores[0])
        self.decode = engine("decode", self.model, self.logs, self.cores[1])
        if self.aggregated:
            self.reference = engine("aggregated", self.model, self.logs, self.cores[1])
        self.router = router(self.prefill, self.decode, self.logs)

    def processes(self) -> list[Process]:
        engines = [self.prefill, self.decode] + ([self.reference] if self.reference else [])
        return [e.process for e in engines] + [self.router.process]

    def start(self) -> Group:
        engines = [self.prefill, self.decode] + ([self.reference] if self.reference else [])
        # One at a time: three vLLM start-ups at once on two cores (the CI machine) contend for
        # the cores through profiling and warm-up; one after another each has a core to itself.
        for e in engines:
            e.process.start()
            wait_until(f"{e.role} /health", lambda e=e: healthy(e.url), START_TIMEOUT_S, [e.process])
        self.router.process.start()
        # The router waits for both workers' /health itself before it listens.
        wait_until("router /health", lambda: healthy(self.router.url), START_TIMEOUT_S, [self.router.process])
        return self

    def stop_reference(self) -> None:
        if self.reference is not None:
            self.reference.process.stop()

    def restart_prefill(self) -> None:
        """Start prefill again on the same ports (the router knows it by its URL)."""
        self.prefill.process.popen = None
        self.prefill.process.start()
        wait_until(
            "prefill /health", lambda: healthy(self.prefill.url), START_TIMEOUT_S, [self.prefill.process]
        )

    def stop(self) -> None:
        for process in reversed(self.processes()):
            process.stop()

    def __enter__(self) -> Group:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def group(
    model: Path, logs: Path, aggregated: bool = True, cores: tuple[str, str] = ("0", "1")
) -> Iterator[Group]:
    with Group(model, logs, aggregated, cores) as started:
        yield started


if __name__ == "__main__":  # a manual look: start a group and print its URLs until Ctrl-C
    import tempfile

    with tempfile.TemporaryDirectory(prefix="m31ctl-pd-") as tmp:
        made = make_tiny_model(Path(tmp) / "tiny-model")
        with group(made, Path(tmp) / "logs") as g:
            print(json.dumps({"router": g.router.url, "prefill": g.prefill.url, "decode": g.decode.url}))
            sys.stdout.flush()
            with contextlib.suppress(KeyboardInterrupt):
                signal.pause()
