"""A plan's rehearsal twin: the same parallel layout, scaled to this host, serving a tiny model
with vLLM's CPU build. Pure: the plan in, the twin plan and what changed (and why) out.

What the twin keeps is what a rehearsal can prove: the layout's shape (nodes, leader and headless
workers, Ray or not, expert parallelism), the names, ports, bind address, API key, environment,
probes and every quoting the render does. What it replaces is what only GPUs and the real
checkpoint can run: the model, the engine image, cache and attention kernels, speculative
decoding, the tool and reasoning parsers (MiniMax's own), and the rank counts.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

from m31ctl.hardware import Platform
from m31ctl.plan import Plan
from m31ctl.plan.catalog import get_model
from m31ctl.plan.disaggregation import UCX_TRANSPORTS
from m31ctl.plan.layers import Source
from m31ctl.plan.settings import PlanSettings
from m31ctl.timeline import VLLM_HANDSHAKE_S

if TYPE_CHECKING:
    from m31ctl.rehearsal.provision import TinyModels

# Two containers of one rank each at most: the machines this runs on have a few cores, and one
# vLLM CPU rank wants a core to itself (more ranks than cores starve each other's OpenMP threads).
MAX_NODES = 2
# A single-node plan may keep two tensor-parallel ranks in one container (the same two cores).
MAX_RANKS_ONE_NODE = 2
TINY_MODEL_ID = "rehearsal-tiny"
# The tiny model's KV and attention heads (make_tiny_model.CONFIG): tensor parallelism must divide them.
TINY_HEADS = 4
# The CPU recipe's engine flags (recipes/cpu.yaml): no C++ compiler in the image for torch.compile.
CPU_EXTRA_ARGS = ("--enforce-eager", "-O0")
CPU_ENV = {
    # GiB of host memory for the KV cache on each rank (vLLM's CPU backend).
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # torch.compile as a no-op: with tensor parallelism vLLM compiles its embedding mask
    # (vocab_parallel_embedding.get_masked_input_and_mask) with inductor on CPU, which needs a
    # C++ compiler the rehearsal image does not have (InvalidCxxCompiler at the first request).
    "TORCHDYNAMO_DISABLE": "1",
}
_SOURCE = Source("rehearsal", detail="rehearsal twin (m31ctl rehearse)")


class Change(NamedTuple):
    """One setting the twin changed: from the plan's value to the twin's, and why."""

    key: str
    plan: Any
    twin: Any
    why: str

    def to_json(self) -> dict[str, Any]:
        return self._asdict()


class Twin(NamedTuple):
    plan: Plan  # the twin plan: render it with the normal render code
    original: Plan
    changes: tuple[Change, ...]
    moe: bool  # the tiny model has experts (the plan enables expert parallelism)
    ranks_per_node: int
    model_dir: Path  # the tiny model it serves (provision.py makes it there)

    @property
    def nodes(self) -> int:
        return self.plan.settings.parallelism.nodes


def scaled_layout(par: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The plan's layout with the same shape on at most MAX_NODES nodes of one rank each, and
    why. Pipeline stages span the nodes one per node (over Ray); data-parallel ranks spread
    evenly over them; a single node keeps up to two tensor-parallel ranks."""
    nodes = min(par["nodes"], MAX_NODES)
    base = {**par, "nodes": nodes, "fill_host": False, "decode_context": 1}
    if par["nodes"] > 1 and par["pipeline"] > 1:
        why = f"PP{nodes} over Ray, one stage a node of TP1 (the plan: TP{par['tensor']} within a node)"
        return {**base, "tensor": 1, "pipeline": nodes, "data": 1}, why
    if par["nodes"] > 1:
        why = f"DP{nodes}, one rank a node: the leader and {nodes - 1} headless worker (vLLM's multi-node DP)"
        return {**base, "tensor": 1, "pipeline": 1, "data": nodes}, why
    tensor = min(par["tensor"], MAX_RANKS_ONE_NODE)
    data = min(par["data"], MAX_RANKS_ONE_NODE // tensor)
    why = f"one node: TP{tensor} x DP{data} (at most {MAX_RANKS_ONE_NODE} ranks on this host)"
    return {**base, "tensor": tensor, "pipeline": 1, "data": data}, why


def _omp_bind(ranks: int) -> str:
    """vLLM's CPU build binds each rank's OpenMP threads to the cores listed here, ranks
    separated by '|'. With two ranks in one container, 'auto' put both on the same cores and
    tensor parallelism never became ready; one core per rank serves."""
    return "|".join(str(core) for core in range(ranks)) if ranks > 1 else "auto"


# A P/D pair's roles: one engine of one rank each, on a core of its own (the CPU worker binds
# its OpenMP threads to the core named here), as the CPU recipe's pd variant runs them.
PD_ROLE_CORES = {"prefill": "0", "decode": "1"}
# float16 for both roles: on an AMX CPU vLLM 0.32's AMX attention kernel kills the decode worker
# on its first request with transferred KV under bfloat16 (recipes/cpu.yaml, pd variant); the
# dtype is a factor of NIXL's compatibility hash, so the roles share it.
PD_DTYPE_ARGS = ("--dtype", "float16")


def pd_twin(pd: dict[str, Any]) -> dict[str, Any]:
    """A P/D plan's disaggregation section on this host: each role one rank on its own core,
    the twin's image and the CPU backend's KV cache and attention (the plan's per-role image,
    KV dtype and backend need GPUs), the CPU build's UCX transports over the containers' own
    network (UCX_NET_DEVICES unset: UCX takes the interfaces there are). The router and the
    connector are the plan's."""
    roles = {
        role: {
            **pd.get(role, {}),
            "tensor": 1,
            "data": 1,
            "nodes": 1,
            "image": None,
            "kv_dtype": None,
            "attention_backend": None,
            "env": {**pd.get(role, {}).get("env", {}), "VLLM_CPU_OMP_THREADS_BIND": core},
        }
        for role, core in PD_ROLE_CORES.items()
    }
    return {**pd, **roles, "ucx_transports": UCX_TRANSPORTS[Platform.CPU], "ucx_net_devices": None}


# A scaled rehearsal's load uses this share of the plan's (scaled) load budget: a real load that
# fits its budget, longer than vLLM's scaled default engine-ready limit (600 s of 1,200 s).
LOAD_SHARE = 0.75
# The slow-load plugin's switches (m31ctl/rehearsal/slow_load, in the rehearsal image).
LOAD_DELAY_ENV = "M31CTL_REHEARSAL_LOAD_DELAY_S"
HANDSHAKE_ENV = "M31CTL_REHEARSAL_HANDSHAKE_S"
# Every model step at least this long (the plugin's token pace): a rollout rehearsal's streams.
TOKEN_ENV = "M31CTL_REHEARSAL_TOKEN_S"


def scaled_clock(plan: Plan, startup_s: int, scale: float) -> tuple[dict[str, Any], dict[str, str]]:
    """The runtime settings and the plugin's environment of a rehearsal at the plan's own clock
    scaled by `scale`: the load budget is the tiny model's own start (`startup_s`, what --timeout
    allows) plus the plan's budget x scale, and the injected load is LOAD_SHARE of the latter;
    vLLM's headless handshake is scaled alike. The readiness wait then follows from the timeline
    as on real GPUs (no startup_timeout)."""
    scaled_load = math.ceil(plan.settings.runtime.load_and_compile_s * scale)
    runtime = {"load_and_compile_s": startup_s + scaled_load, "startup_timeout": None}
    env = {
        LOAD_DELAY_ENV: str(math.ceil(scaled_load * LOAD_SHARE)),
        HANDSHAKE_ENV: str(math.ceil(VLLM_HANDSHAKE_S * scale)),
    }
    return runtime, env


def twin_settings(
    plan: Plan,
    model_dir: str,
    image: str,
    startup_s: int,
    scale: float | None = None,
    token_s: float | None = None,
) -> tuple[dict[str, Any], str]:
    """The twin's settings as data (validated by the caller) and why the layout was scaled; with
    `token_s`, every model step paced to it (the plugin's TOKEN_ENV)."""
    tree = plan.settings_dict()
    # settings_dict leaves out a section the plan does not set (an aggregated plan's disaggregation)
    paired = bool(tree.get("disaggregation", {}).get("enabled", False))
    layout, why = scaled_layout(tree["parallelism"])
    if paired:  # the roles' own layouts (pd_twin) are what runs
        layout = {**layout, "nodes": 1, "tensor": 1, "pipeline": 1, "data": 1}
        why = "a P/D pair on this host: each role one engine of one rank, on a core of its own"
    ranks = layout["tensor"] * (layout["data"] if layout["nodes"] == 1 else 1)  # ranks in one pod
    runtime = tree["runtime"]
    # The plan's own environment wins: a VLLM_CPU_* it sets is what the user means to rehearse.
    env = {**CPU_ENV, "VLLM_CPU_OMP_THREADS_BIND": _omp_bind(ranks), **runtime["env"]}
    serving = tree["serving"]
    # The CPU flags the plan does not already pass (the CPU recipe's own pass them), then its own.
    extra = [
        *(a for a in CPU_EXTRA_ARGS if a not in tree["engine"]["extra_args"]),
        *tree["engine"]["extra_args"],
    ]
    if paired and "--dtype" not in extra:
        extra += PD_DTYPE_ARGS
    tree.update(
        model={"id": TINY_MODEL_ID, "path": model_dir, "served_name": tree["model"]["served_name"]},
        # The plan's extra flags stay (after the CPU ones): they are part of what would run.
        engine={
            **tree["engine"],
            "image": image,
            "extra_args": extra,
        },
        parallelism=layout,
        attention_backend=None,
        cache={},
        speculative={},
        moe={},
        multimodal={},
        serving={
            "max_model_len": 2048,
            "max_num_seqs": serving["max_num_seqs"],
            "gpu_memory_utilization": 0.9,
            # Nothing to drain in a rehearsal: containers stop in seconds.
            "shutdown_timeout": 5,
        },
        runtime={**runtime, "env": env, "startup_timeout": startup_s},
    )
    if paired:
        tree["disaggregation"] = pd_twin(tree["disaggregation"])
    if scale is not None:
        clock, plugin_env = scaled_clock(plan, startup_s, scale)
        tree["runtime"] = {**tree["runtime"], **clock, "env": {**env, **plugin_env}}
    if token_s is not None:
        tree["runtime"]["env"] = {**tree["runtime"]["env"], TOKEN_ENV: f"{token_s:g}"}
    return tree, why


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value and key != "env":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


_WHY = {
    "model": "a tiny model made on the spot (random weights): the checkpoint needs GPUs",
    "engine": "vLLM's CPU build in the local rehearsal image, eager mode (no compiler in the image)",
    "parallelism": "",  # filled with the layout's reason
    "cache": "the CPU backend's own KV cache and block size (NVFP4/FP8 caches need GPU kernels)",
    "speculative": "no DSpark draft in the tiny model",
    "attention_backend": "the CPU attention backend",
    "moe": "the CPU MoE path",
    "multimodal": "the tiny model is text-only",
    "disaggregation": "each role one rank on a core of its own, the CPU build's UCX transports over the "
    "containers' network (per-role images, KV dtypes and backends need GPUs)",
    "serving": "the tiny model's 2K context; MiniMax's parsers need MiniMax's tokenizer; a 5 s drain",
    "runtime": "the CPU backend's KV space and thread binding, torch.compile off (no compiler in the "
    "image); the startup budget is --timeout",
}
# Reasons that fit one setting better than its section's (the most specific key wins).
_WHY_KEY = {
    "serving.max_model_len": "the tiny model's 2K context",
    "serving.tool_call_parser": "MiniMax's parsers need MiniMax's tokenizer",
    "serving.reasoning_parser": "MiniMax's parsers need MiniMax's tokenizer",
    "serving.shutdown_timeout": "nothing to drain in a rehearsal: a 5 s drain",
    "serving.gpu_memory_utilization": "the CPU backend sizes its KV cache by VLLM_CPU_KVCACHE_SPACE",
    "serving.max_num_seqs": "the CPU build's own default",
    "runtime.startup_timeout": "the startup budget is --timeout",
    "runtime.load_and_compile_s": "--clock-scale: the tiny model's own start plus the plan's budget, scaled",
    "runtime.env": "the CPU backend's KV space and thread binding, torch.compile off (no compiler in the image)",
    "engine.image": "vLLM's CPU build in the local rehearsal image",
    "engine.extra_args": "eager mode: no C++ compiler in the image for torch.compile (a P/D pair: "
    "float16, which an AMX CPU's attention kernel needs for transferred KV)",
    "model.path": "a tiny model made on the spot (random weights): the checkpoint needs GPUs",
    "model.id": "a tiny model made on the spot (random weights): the checkpoint needs GPUs",
}


def _why(key: str, layout_why: str) -> str:
    section = key.split(".")[0]
    if section == "parallelism":
        return layout_why
    if key.startswith("runtime.env."):
        key = "runtime.env"
    return _WHY_KEY.get(key) or _WHY.get(section, "rehearsal")


def changes_between(before: dict[str, Any], after: dict[str, Any], layout_why: str) -> tuple[Change, ...]:
    old, new = _flat(before), _flat(after)
    found = []
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            found.append(Change(key, old.get(key), new.get(key), _why(key, layout_why)))
    return tuple(found)


def rehearsal_twin(
    plan: Plan,
    models: TinyModels,
    image: str,
    startup_s: int,
    scale: float | None = None,
    token_s: float | None = None,
) -> Twin:
    """The twin of `plan` serving the tiny model of its kind from `models` (the MoE one when the
    plan enables expert parallelism) from `image` (at the plan's own clock scaled by `scale`,
    with a slow load injected, when given; its tokens paced to `token_s` when given)."""
    model_dir = models.moe if plan.settings.parallelism.expert else models.dense
    tree, why = twin_settings(plan, str(model_dir), image, startup_s, scale, token_s)
    settings = PlanSettings.model_validate(tree)
    provenance = dict(plan.provenance)
    changes = changes_between(plan.settings_dict(), settings.model_dump(mode="json"), why)
    for change in changes:
        provenance[change.key] = _SOURCE
    twin_plan = plan._replace(
        model=get_model(TINY_MODEL_ID), settings=settings, provenance=MappingProxyType(provenance)
    )
    return Twin(
        plan=twin_plan,
        original=plan,
        changes=changes,
        moe=settings.parallelism.expert,
        ranks_per_node=settings.parallelism.tensor
        * (settings.parallelism.data if settings.parallelism.nodes == 1 else 1),
        model_dir=model_dir,
    )
