"""Deep checks that already passed: remembered for the plan, engine and host they passed on.

The deep checks (vLLM building the plan's configuration, the engine's Python on the GPUs, an
all-reduce) cost 25-50 s on the lent H200 and on this project's CPUs: most of what `launch` added
to the engine's own start (issue 53). They judge the engine invocation, the engine, the host and
m31ctl's own rules; while none of those changed, a second launch (a rollout, a restart) learns
nothing new from them. So a pass is written down under a key made of exactly those, and a launch
whose key is found skips them. Anything that changes the key runs them again: another argv or
environment, another vLLM (version, place, torch) or image ID, other GPUs or driver, another
m31ctl or capability table. A pass with a skipped deep check (no config.json before the first
download) is not a pass: the next launch runs them again.

Side effects are this module's two small functions over one directory of m31ctl's cache (what it
can always rebuild: a lost record only means the checks run again; `m31ctl stop` leaves nothing of a
server's in the state root, and this is not a server's); the key is pure data.
"""

from __future__ import annotations

import hashlib
import json
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from m31ctl import __version__
from m31ctl.atomic import write_atomic
from m31ctl.checks import CheckStatus
from m31ctl.deployment import Deployment
from m31ctl.doctor.base import CheckResult
from m31ctl.doctor.checks import all_checks
from m31ctl.engine.adapter import build_invocation
from m31ctl.hardware import Hardware
from m31ctl.resources import cache_root, recipes_dir
from m31ctl.runtime.protocol import Runtime

FOLDER = "deep-passes"
# m31ctl's own judgement is part of what passed: the table doctor reads engine versions against.
_CAPABILITIES = Path("engines") / "capabilities.yaml"


@dataclass(frozen=True)
class RememberedPass:
    """A deep-check pass found for this key: when, and what the checks said then."""

    passed_at: str
    said: tuple[str, ...]  # each deep check: "id: message", as it passed

    def line(self) -> str:
        return (
            f"deep checks passed at {self.passed_at} for this plan, engine and host "
            "(remembered; `m31ctl doctor --deep` runs them again)"
        )


def host_identity(hardware: Hardware) -> tuple[str, ...]:
    """The host as the deep checks saw it: its name, each GPU (UUID, else index and name) and the
    driver; a GPU swapped or a driver upgraded is another host for them."""
    gpus = tuple(g.uuid or f"{g.index}:{g.name}" for g in hardware.gpus)
    return (socket.gethostname(), *gpus, str(hardware.driver_version), str(hardware.cuda_driver_version))


# The launching environment's variables that reach the engine or its collectives (devices,
# NCCL/Gloo/UCX transports, vLLM's and torch's own settings, the hub's offline switch).
_ENGINE_ENV_PREFIXES = ("CUDA_", "NCCL_", "NVIDIA_", "HIP_", "ROCR_", "RCCL_", "GLOO_", "UCX_", "VLLM_",
                        "TORCH_", "OMP_", "HF_")  # fmt: skip


def pass_key(
    deployment: Deployment, runtime: str, engine: str, hardware: Hardware, environ: Mapping[str, str]
) -> str:
    """What the deep checks judged, as one digest: the runtime, the engine's argv and environment
    as that runtime runs them, the launching environment's engine variables, the engine's
    identity (Runtime.engine_identity), the host, and the m31ctl and capability table that
    judged them."""
    invocation = build_invocation(deployment)
    capabilities = recipes_dir() / _CAPABILITIES
    parts = {
        "runtime": runtime,
        "plan": deployment.plan.hash,
        "argv": list(invocation.args),
        "env": sorted(dict(invocation.env).items()),
        "environ": sorted((k, v) for k, v in environ.items() if k.startswith(_ENGINE_ENV_PREFIXES)),
        "engine": engine,
        "host": list(host_identity(hardware)),
        "m31ctl": __version__,
        "capabilities": hashlib.sha256(capabilities.read_bytes()).hexdigest()
        if capabilities.is_file()
        else "",
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def key_for(
    runtime: Runtime, deployment: Deployment, hardware: Hardware, environ: Mapping[str, str]
) -> str | None:
    """The pass key of `deployment` on `runtime` (launch's and doctor --deep's alike); None when
    the runtime cannot name its engine, which is then checked every time."""
    identity = runtime.engine_identity(deployment)
    return pass_key(deployment, runtime.name, identity, hardware, environ) if identity else None


def _path(key: str) -> Path:
    return cache_root() / FOLDER / f"{key}.json"


def recall(key: str) -> RememberedPass | None:
    """The pass written for this key, if any (an unreadable record is no pass)."""
    try:
        data = json.loads(_path(key).read_text())
        return RememberedPass(str(data["passed_at"]), tuple(str(c) for c in data["said"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def remember(key: str, deployment: Deployment, results: Sequence[CheckResult]) -> RememberedPass | None:
    """Write the pass down when every deep check among `results` passed outright (none skipped,
    none failed); a cache that cannot be written only loses the shortcut."""
    deep = {c.id.value for c in all_checks(deployment) if c.deep}
    deep_results = [r for r in results if r.id in deep]
    if not deep_results or any(r.status is not CheckStatus.OK for r in deep_results):
        return None
    record = RememberedPass(
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        tuple(f"{r.id}: {r.message}" for r in deep_results),
    )
    try:
        _path(key).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(_path(key), json.dumps({"passed_at": record.passed_at, "said": list(record.said)}))
    except OSError:
        return None
    return record
