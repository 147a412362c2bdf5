"""vLLM flags that m31ctl sets from the plan: engine.extra_args may not set them again.

argparse keeps the last value of a repeated flag, so `--port 9000` in extra_args (appended last)
would win over runtime.port while the container still publishes runtime.port, the URL, the probes
and the Service point at it, and capacity, the lock and the rendered files describe the plan's
layout. Such a flag is refused (exit 2) naming the setting to use instead.
"""

from __future__ import annotations

from m31ctl.deployment import Deployment
from m31ctl.errors import InputError

_NODES = "parallelism.nodes (multi-node flags are set per pod)"
# Every spelling vLLM 0.32 registers (engine/schemas/vllm-0.32.0.json `options`), by setting.
OWNED: dict[str, str] = {
    "--port": "runtime.port",
    "--host": "runtime.bind",
    "--uds": "runtime.bind and runtime.port",
    "--model": "model.path",
    "--served-model-name": "model.served_name",
    "--tensor-parallel-size": "parallelism.tensor",
    "-tp": "parallelism.tensor",
    "--pipeline-parallel-size": "parallelism.pipeline",
    "-pp": "parallelism.pipeline",
    "--data-parallel-size": "parallelism.data",
    "-dp": "parallelism.data",
    "--enable-expert-parallel": "parallelism.expert",
    "--no-enable-expert-parallel": "parallelism.expert",
    "-ep": "parallelism.expert",
    "--decode-context-parallel-size": "parallelism.decode_context",
    "-dcp": "parallelism.decode_context",
    "--data-parallel-size-local": _NODES,
    "-dpl": _NODES,
    "--data-parallel-start-rank": _NODES,
    "-dpr": _NODES,
    "--data-parallel-rank": _NODES,
    "-dpn": _NODES,
    "--data-parallel-address": _NODES,
    "-dpa": _NODES,
    "--data-parallel-rpc-port": _NODES,
    "-dpp": _NODES,
    "--headless": _NODES,
    "--nnodes": _NODES,
    "-n": _NODES,
    "--node-rank": _NODES,
    "-r": _NODES,
    "--kv-cache-dtype": "cache.kv_dtype",
    "--block-size": "cache.block_size",
}
# A stem this short names no flag on its own (as m31ctl.redact reads vLLM's prefixes).
_MIN_STEM = 2


def owned_flag(arg: str) -> str | None:
    """The owned flag that `arg` sets when vLLM parses it, or None. vLLM reads `_` and `-` alike,
    takes `--flag=value`, and accepts an unambiguous prefix of a long flag (`--serv`): a prefix of
    an owned flag is refused too; where it is ambiguous vLLM would reject it anyway."""
    if not arg.startswith("-"):
        return None
    name = arg.split("=", 1)[0].lower()
    if not name.startswith("--"):
        return name if name in OWNED else None
    name = "--" + name[2:].replace("_", "-")
    if name in OWNED:
        return name
    if len(name) - 2 < _MIN_STEM:
        return None
    return next((flag for flag in OWNED if flag.startswith("--") and flag.startswith(name)), None)


def refuse_owned_flags(deployment: Deployment) -> None:
    """Raise InputError for the first owned flag in engine.extra_args."""
    plan = deployment.plan
    for arg in plan.settings.engine.extra_args:
        flag = owned_flag(arg)
        if flag is None:
            continue
        spelled = arg.split("=", 1)[0]
        named = flag if spelled == flag else f"{spelled!r} (vLLM's {flag})"
        source = plan.provenance.get("engine.extra_args")
        raise InputError(
            f"engine.extra_args sets {named}, which m31ctl sets from {OWNED[flag]}: the container, "
            "probes, rendered files and capacity would describe another server than vLLM runs",
            where=str(source) if source else None,
            hint=f"remove it from engine.extra_args and set {OWNED[flag]}",
        )
