"""The vLLM engine adapter: the only code that knows vLLM's flag spellings.

It turns a plan into the argv that follows `vllm serve` (the image's entrypoint) and the
environment the engine needs. Secrets are never part of it: they travel by reference.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, NamedTuple

from m31ctl.deployment import Deployment
from m31ctl.engine.owned import refuse_owned_flags
from m31ctl.plan.settings import PlanSettings

# Domain cache dtype -> vLLM's spelling, per flag (--kv-cache-dtype says bfloat16, the
# indexer config says bf16).
KV_CACHE_DTYPE = {"nvfp4": "nvfp4", "fp8": "fp8", "bf16": "bfloat16"}
_INDEXER_DTYPE = {"nvfp4": "nvfp4", "fp8": "fp8", "bf16": "bf16"}

# AITER is off unless its master switch is on; its MoE sub-switch (VLLM_ROCM_USE_AITER_MOE)
# defaults on, so the master switch alone selects AITER MoE with --moe-backend aiter.
_AITER_MOE_ENV = {"VLLM_ROCM_USE_AITER": "1"}
# What the master switch turns on: the AITER switches whose default is on (vLLM 0.32,
# vllm/envs.py: VLLM_ROCM_USE_AITER_{CUSTOM_AR,LINEAR,MOE,RMSNORM,MLA,MHA,FP8BMM,FP4BMM,TRITON_GEMM}
# default True; the day-zero images are 0.32-based. vLLM 0.33 turns FP8BMM and FP4BMM off).
AITER_DEFAULT_ON = (
    "custom all-reduce", "linear", "MoE", "RMSNorm", "MLA", "MHA", "FP8 BMM", "FP4 BMM", "Triton GEMM",
)  # fmt: skip


class EngineInvocation(NamedTuple):
    image: str
    args: tuple[str, ...]  # after `vllm serve`; the model comes first
    env: tuple[tuple[str, str], ...]  # sorted, no secrets
    # What the argv and environment do beyond their face value, for the plan to say.
    effects: tuple[str, ...] = ()

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)


def _json(value: Any) -> str:
    # Canonical JSON so renders are byte-identical.
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


# The OpenAI-compatible server as a module, for a local Python (`vllm serve MODEL` is this with
# `--model MODEL`; vLLM's entrypoints/openai/api_server.py).
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# Multi-node: vLLM's Ray executor spans the nodes of one engine (docs: serving/parallelism_scaling).
RAY_EXECUTOR = ("--distributed-executor-backend", "ray")
# The data-parallel coordinator's port on the leader (vLLM 0.32 ParallelConfig.data_parallel_rpc_port).
DP_RPC_PORT = 29550


class NodeRole(NamedTuple):
    """One node's part in a layout that spans nodes (a LeaderWorkerSet pod).

    `leader_address` and `start_rank` are shell words the pod's command expands (the target
    supplies them, e.g. ${LWS_LEADER_ADDRESS}); the adapter only spells the flags."""

    leader: bool
    leader_address: str
    start_rank: str


def multi_node_args(deployment: Deployment, role: NodeRole) -> list[str]:
    """What a layout that spans nodes adds to `vllm serve` on one node.

    TP within a node and PP across nodes: the leader runs the engine with the Ray executor; the
    workers only join its Ray cluster (no vllm serve). Data parallelism across nodes (vLLM's
    docs, serving/data_parallel_deployment): every node runs `vllm serve` with its local rank
    count, the leader's address and the coordinator port; the others also `--headless` with
    their first rank. Without the local count, vLLM starts all ranks on the leader."""
    layout = deployment.layout
    if layout.over_ray:
        return list(RAY_EXECUTOR) if role.leader else []
    args = [
        "--data-parallel-size-local", str(layout.data_local),
        "--data-parallel-address", role.leader_address,
        "--data-parallel-rpc-port", str(DP_RPC_PORT),
    ]  # fmt: skip
    if not role.leader:
        args += ["--headless", "--data-parallel-start-rank", role.start_rank]
    return args


def build_invocation(deployment: Deployment, *, node: NodeRole | None = None) -> EngineInvocation:
    """The argv after `vllm serve` and the environment for the plan. `node`: this pod's part in
    a layout that spans nodes (the Kubernetes LeaderWorkerSet), whose flags come before the
    user's extra_args."""
    refuse_owned_flags(deployment)  # extra_args come last: an owned flag there would win
    s = deployment.plan.settings
    args: list[str] = [deployment.model.reference, "--served-model-name", s.model.served_name]
    for section in _SECTIONS:
        args += section(s)
    if node is not None:
        args += multi_node_args(deployment, node)
    args += list(s.engine.extra_args)
    env, effects = _environment(s)
    return EngineInvocation(image=s.engine.image, args=tuple(args), env=env, effects=effects)


def _parallel_args(s: PlanSettings) -> list[str]:
    par = s.parallelism
    args = ["--tensor-parallel-size", str(par.tensor)]
    if par.pipeline > 1:
        args += ["--pipeline-parallel-size", str(par.pipeline)]
    if par.data > 1:
        args += ["--data-parallel-size", str(par.data)]
    if par.expert:
        args.append("--enable-expert-parallel")
    if par.decode_context > 1:
        args += ["--decode-context-parallel-size", str(par.decode_context)]
    return args


def _cache_args(s: PlanSettings) -> list[str]:
    args: list[str] = []
    if s.cache.kv_dtype != "auto":
        args += ["--kv-cache-dtype", KV_CACHE_DTYPE[s.cache.kv_dtype]]
    if s.cache.indexer_dtype != "auto":
        args += ["--attention-config", _json({"indexer_kv_dtype": _INDEXER_DTYPE[s.cache.indexer_dtype]})]
    if s.cache.block_size is not None:
        args += ["--block-size", str(s.cache.block_size)]
    if s.attention_backend:
        args += ["--attention-backend", s.attention_backend]
    return args


def _speculative_args(s: PlanSettings) -> list[str]:
    spec = s.speculative
    if spec.method == "none":
        return []
    # The DSpark draft ships inside the checkpoint's dspark/ folder: no draft model path.
    config: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": spec.tokens}
    if spec.draft_attention_backend:
        config["attention_backend"] = spec.draft_attention_backend
    if spec.draft_sampling:
        config["draft_sample_method"] = spec.draft_sampling
    return ["--speculative-config", _json(config)]


def _moe_args(s: PlanSettings) -> list[str]:
    return ["--moe-backend", s.moe.backend] if s.moe.backend != "auto" else []


def _multimodal_args(s: PlanSettings) -> list[str]:
    mm = s.multimodal
    if mm.text_only:
        return ["--language-model-only"]
    args: list[str] = []
    limits = {name: 0 for name, on in (("image", mm.image), ("video", mm.video)) if not on}
    if limits:
        args += ["--limit-mm-per-prompt", _json(limits)]
    if mm.encoder_data_parallel and mm.encoder_attention_backend:
        args += ["--mm-encoder-tp-mode", "data", "--mm-encoder-attn-backend", mm.encoder_attention_backend,
                 "--mm-processor-cache-type", "shm"]  # fmt: skip
    return args


def _serving_args(s: PlanSettings) -> list[str]:
    serving = s.serving
    args = ["--max-model-len", str(serving.max_model_len)]
    if serving.max_num_seqs is not None:
        args += ["--max-num-seqs", str(serving.max_num_seqs)]
    args += ["--gpu-memory-utilization", f"{serving.gpu_memory_utilization:g}"]
    if serving.tool_call_parser:
        args += ["--enable-auto-tool-choice", "--tool-call-parser", serving.tool_call_parser]
    if serving.reasoning_parser:
        args += ["--reasoning-parser", serving.reasoning_parser]
    if serving.trust_remote_code:
        args.append("--trust-remote-code")
    if serving.shutdown_timeout:
        args += ["--shutdown-timeout", str(serving.shutdown_timeout)]
    return args


# The argv's sections in the order vLLM's own examples write them (the goldens pin this order).
_SECTIONS: tuple[Callable[[PlanSettings], list[str]], ...] = (
    _parallel_args, _cache_args, _speculative_args, _moe_args, _multimodal_args, _serving_args,
)  # fmt: skip


def _environment(s: PlanSettings) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """The engine's environment (sorted, no secrets) and what it does beyond its face value."""
    env: dict[str, str] = {}
    effects: list[str] = []
    if s.moe.backend == "aiter":
        env.update(_AITER_MOE_ENV)
        effects.append(
            "VLLM_ROCM_USE_AITER=1 switches on every AITER path whose switch defaults on: "
            + ", ".join(AITER_DEFAULT_ON)
        )
    if s.moe.expert_requantization == "mxfp8":
        effects.append(
            "the AITER MoE path re-quantizes the NVFP4 experts to MXFP8 at load (caches stay as set)"
        )
    env.update(s.runtime.env)
    return tuple(sorted(env.items())), tuple(effects)


def native_command(deployment: Deployment, python: str) -> list[str]:
    """The API server run from a local Python, with the same engine flags and the bind address
    and port that the container runtime gets from its port mapping."""
    model, *rest = build_invocation(deployment).args
    network = deployment.network
    return [python, "-m", API_SERVER_MODULE, "--model", model, *rest,
            "--host", network.bind, "--port", str(network.port)]  # fmt: skip
