"""A slow checkpoint load for the rehearsal, through vLLM's own plugin mechanism.

vLLM runs every `vllm.general_plugins` entry point in each of its processes (vllm/plugins,
load_general_plugins). With M31CTL_REHEARSAL_LOAD_DELAY_S set, this one makes the model loader
sleep that long before it loads the weights, inside the engine core process, exactly where a
250 GB checkpoint spends its minutes: the engine-ready limit, the startup probe and the
multi-node handshake then meet a load as long as the real one, scaled down. With
M31CTL_REHEARSAL_HANDSHAKE_S set, vLLM's headless-worker handshake limit (HANDSHAKE_TIMEOUT_MINS,
five minutes, no setting of its own in 0.32) is scaled the same way. With M31CTL_REHEARSAL_TOKEN_S
set, every model step takes at least that long (a token of each running sequence a step), so a
stream lasts as long as a real model's would (the tiny model streams 400 tokens a second here:
no stream would still run when a deleted pod's preStop wait ends). Unset, it does nothing.
Installed in the rehearsal image only (m31ctl/rehearsal/provision.py).
"""

from __future__ import annotations

import os
import time

DELAY_ENV = "M31CTL_REHEARSAL_LOAD_DELAY_S"
HANDSHAKE_ENV = "M31CTL_REHEARSAL_HANDSHAKE_S"
TOKEN_ENV = "M31CTL_REHEARSAL_TOKEN_S"
# A paced worker's look at the shared-memory queue while it waits for the next step (idle_readers).
READER_POLL_S = 0.001


def pace_tokens(step_s: float) -> None:
    """Each engine step that ran the model (EngineCore.step, or step_with_batch_queue) at least
    `step_s` long. In the engine core's busy loop, not in the worker: a worker that sleeps in its
    step stalls vLLM's SIGTERM drain (seen here: the in-flight stream stopped at SIGTERM, and
    the engine core was force-killed at --shutdown-timeout), while the engine core's own loop
    goes on stepping while it drains."""
    # lazy: vLLM loads this plugin while it starts; its modules only when a pace is set
    from vllm.v1.engine.core import EngineCore

    for name in ("step", "step_with_batch_queue"):
        original = getattr(EngineCore, name, None)
        if original is None or getattr(original, "_m31ctl_paced", False):
            continue  # not in this vLLM, or registered already in this process
        setattr(EngineCore, name, _paced(original, step_s))
    idle_readers()


def idle_readers() -> None:
    """The paced step's wait spent idle in the worker, as a real step's is spent on the GPU.
    vLLM's shared-memory queue (shm_broadcast.SpinCondition.wait) keeps a reader looping on
    sched_yield for busy_loop_s (1 s) after every read; a step every 50 ms never lets the
    worker leave that loop, so a paced engine's worker burnt a whole core doing nothing (seen
    here: 97 % of core 0 for the whole load, and a second engine started beside it, bound to
    the same core by VLLM_CPU_OMP_THREADS_BIND=auto, did not pass its startup probe in 13
    min). Paced, the loop sleeps READER_POLL_S a turn instead of yielding: the same loop, at
    about 1 % of a core. (Leaving the loop at once for vLLM's idle wait is no cure: tried
    here, the writer's notification did not wake the reader, each step waited out the 5 s
    recheck, SHM_READER_RECHECK_INTERVAL_MS, and the engine streamed 0.2 tokens a second.)"""
    # lazy: vLLM loads this plugin while it starts; its modules only when a pace is set
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    original = SpinCondition.wait
    if getattr(original, "_m31ctl_idle", False):
        return  # registered already in this process

    def gentle_wait(self, timeout_ms=None):  # type: ignore[no-untyped-def]
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(READER_POLL_S)  # vLLM: sched_yield(), then back to the flag
            return None
        return original(self, timeout_ms)

    gentle_wait._m31ctl_idle = True  # type: ignore[attr-defined]
    SpinCondition.wait = gentle_wait


def _paced(original, step_s: float):  # type: ignore[no-untyped-def]
    def paced_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        started = time.monotonic()
        out = original(self, *args, **kwargs)
        if isinstance(out, tuple) and len(out) == 2 and out[1]:  # (outputs, model_executed)
            time.sleep(max(0.0, step_s - (time.monotonic() - started)))
        return out

    paced_step._m31ctl_paced = True  # type: ignore[attr-defined]
    return paced_step


def register() -> None:
    handshake = float(os.environ.get(HANDSHAKE_ENV) or 0)
    if handshake > 0:
        # Read at each handshake (startup_handshake multiplies it by 60,000 ms then).
        from vllm.v1.engine import core

        core.HANDSHAKE_TIMEOUT_MINS = handshake / 60
    step = float(os.environ.get(TOKEN_ENV) or 0)
    if step > 0:
        pace_tokens(step)
    delay = float(os.environ.get(DELAY_ENV) or 0)
    if delay <= 0:
        return
    # lazy: vLLM loads this plugin while it starts; its modules only when a delay is set
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    if getattr(BaseModelLoader.load_model, "_m31ctl_slow", False):
        return  # registered already in this process
    original = BaseModelLoader.load_model

    def slow_load_model(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        print(f"m31ctl rehearsal: loading slowly, {delay:g} s ({DELAY_ENV})", flush=True)
        time.sleep(delay)
        return original(self, *args, **kwargs)

    slow_load_model._m31ctl_slow = True  # type: ignore[attr-defined]
    BaseModelLoader.load_model = slow_load_model
