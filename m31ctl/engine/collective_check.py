"""The deep doctor's probe, run with the engine's own Python (in its image, or natively):

1. engine: PyTorch and vLLM versions, whether CUDA/HIP initialises on the visible GPUs, the CUDA
   (or HIP) runtime version, and whether PyTorch has kernels for each GPU's architecture
   (torch.cuda.get_arch_list() against the device's sm_XY / gfxNNN);
2. collective: WORLD processes form a process group (NCCL on NVIDIA, RCCL through the same API
   on ROCm, gloo on the CPU) and all-reduce a buffer; the bus bandwidth is reported as NCCL's tests
   define it (2 (n - 1) / n x bytes / time).

Prints two JSON lines on stdout ({"engine": ...}, then {"collective": ...}). Standalone: imports
nothing from m31ctl.

    python collective_check.py --world 2 --backend nccl --mib 256 --bound 180

`--bound` is the collective's own time limit, counted from the moment every rank has started
(imported its torch): how long imports take says nothing about a hang, and on a slow or busy
machine they can take longer than the group setup and the all-reduce together. A collective
still running at the bound is killed and reported as {"timed_out": true}; a start that never
ends is the caller's to bound (it kills the whole run).
"""

import argparse
import json
import os
import queue as queues
import socket
import sys
import time
from typing import Any


def engine_facts() -> dict[str, Any]:
    import torch  # the engine's Python only: timed as part of the engine facts, absent on the host

    facts: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        import vllm  # the engine's Python only; a broken vLLM is a finding, not a crash

        facts["vllm"] = getattr(vllm, "__version__", None)
    except Exception as exc:
        facts["vllm"] = None
        facts["vllm_error"] = f"{type(exc).__name__}: {exc}"[:300]
    facts["cuda_runtime"] = torch.version.cuda
    facts["hip_runtime"] = getattr(torch.version, "hip", None)
    available = torch.cuda.is_available()
    facts["accelerator"] = available
    facts["device_count"] = torch.cuda.device_count() if available else 0
    arch_list = torch.cuda.get_arch_list() if available else []
    facts["arch_list"] = arch_list
    devices = []
    for index in range(facts["device_count"]):
        props = torch.cuda.get_device_properties(index)
        if facts["hip_runtime"]:
            arch = str(getattr(props, "gcnArchName", "")).split(":")[0]
        else:
            arch = f"sm_{props.major}{props.minor}"
        # A kernel for sm_100 runs on sm_100 only; PTX (compute_XY) can JIT for newer GPUs.
        supported = arch in arch_list or any(a.startswith("compute_") for a in arch_list) if arch else False
        devices.append({"index": index, "name": props.name, "arch": arch, "kernels": supported})
    facts["devices"] = devices
    return facts


# Provokes a hung collective for real (tests of the doctor's timeout path): this rank never joins.
DROP_RANK_ENV = "M31CTL_FAULT_DROP_RANK"
# Makes every rank's start-up this many seconds slower, as on a slow or busy machine (tests that
# the bound counts from the ranks' start only).
SLOW_START_ENV = "M31CTL_FAULT_SLOW_START_S"


def _worker(rank: int, world: int, backend: str, mib: int, port: int, queue) -> None:  # type: ignore[no-untyped-def]
    # in the spawned rank, before its "ready": the collective's bound excludes the import time
    import torch
    import torch.distributed as dist

    time.sleep(float(os.environ.get(SLOW_START_ENV) or 0))
    queue.put(("ready", rank))  # imports done: from here on the collective's bound applies
    if os.environ.get(DROP_RANK_ENV) == str(rank):
        time.sleep(86400)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    started = time.perf_counter()
    device = None
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    init_s = time.perf_counter() - started
    numel = mib * 1024 * 1024 // 4
    tensor = torch.ones(numel, dtype=torch.float32, device=device)
    dist.all_reduce(tensor)  # warm-up (connections, buffers)
    if device is not None:
        torch.cuda.synchronize()
    dist.barrier()
    runs = 5
    start = time.perf_counter()
    for _ in range(runs):
        dist.all_reduce(tensor)
    if device is not None:
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / runs
    correct = bool(tensor[0].item() == float(world) ** (runs + 1))
    dist.destroy_process_group()
    if rank == 0:
        size = numel * 4
        # One rank exchanges nothing: no bus bandwidth to report.
        bus = 2 * (world - 1) / world * size / seconds if world > 1 else None
        queue.put(
            (
                "result",
                {
                    "init_s": round(init_s, 3),
                    "allreduce_s": seconds,
                    "bytes": size,
                    "busbw_gbps": bus / 1e9 if bus else None,
                    "correct": correct,
                },
            )
        )


def _read(queue, procs, until: float | None, ready: set[int], result: dict[str, Any]) -> bool:  # type: ignore[no-untyped-def]
    """One message from the ranks (waiting at most until `until`, monotonic; None: no limit).
    False once there is nothing more to wait for: the limit passed, or every rank has exited."""
    wait = 0.5 if until is None else min(0.5, until - time.monotonic())
    if wait <= 0:
        return False
    try:
        kind, value = queue.get(timeout=wait)
    except queues.Empty:
        return any(p.is_alive() for p in procs)
    if kind == "ready":
        ready.add(value)
    else:
        result.update(value)
    return True


def collective(world: int, backend: str, mib: int, bound_s: float) -> dict[str, Any]:
    import torch.multiprocessing as mp  # the engine's Python only, as in engine_facts

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    started = time.perf_counter()
    procs = [ctx.Process(target=_worker, args=(r, world, backend, mib, port, queue)) for r in range(world)]
    for p in procs:
        p.start()
    ready: set[int] = set()
    result: dict[str, Any] = {}
    # Start-up: every rank imports its torch, however long that takes here (a rank that dies
    # meanwhile ends the wait; its exit code says so).
    while len(ready) < world and all(p.is_alive() or p.exitcode == 0 for p in procs):
        _read(queue, procs, None, ready, result)
    deadline = time.monotonic() + bound_s
    while any(p.is_alive() for p in procs) and _read(queue, procs, deadline, ready, result):
        pass
    hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    for rank in hung:
        procs[rank].kill()
    for p in procs:
        p.join()
    while _read(queue, procs, time.monotonic() + 0.1, ready, result) and not result:
        pass  # the result rank 0 sent just before the bound
    return {
        "backend": backend,
        "world": world,
        "exit_codes": [p.exitcode for p in procs],
        "ranks_started": len(ready),
        "timed_out": bool(hung),
        "hung_ranks": hung,
        "bound_s": bound_s,
        "total_s": round(time.perf_counter() - started, 3),
        **result,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--bound", type=float, default=180.0)
    ns = parser.parse_args()
    # Two lines, the engine's first: a collective that hangs must not hide what the engine is.
    for part in ("engine", "collective"):
        value = engine_facts() if part == "engine" else collective(ns.world, ns.backend, ns.mib, ns.bound)
        sys.stdout.write(json.dumps({part: value}) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
