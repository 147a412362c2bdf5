"""The vLLM engine adapter: the only code that knows vLLM's flag spellings.

It turns a plan into the argv that follows `vllm serve` (the image's entrypoint) and the
environment the engine needs. Secrets are never part of it: they travel by reference.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from m31ctl.deployment import Deployment, KvTransfer, Layout
from m31ctl.engine import owned
from m31ctl.errors import InputError
from m31ctl.plan.disaggregation import KV_TRANSFER_FLAG
from m31ctl.plan.settings import PlanSettings
from m31ctl.timeline import ENGINE_READY_ENV

if TYPE_CHECKING:
    from m31ctl.plan import Plan

# huggingface_hub's offline switch (vLLM reads the cache only).
OFFLINE_ENV = "HF_HUB_OFFLINE"
# What only the engine reads: a download step run with the engine's environment leaves them out.
ENGINE_ONLY_ENV = (OFFLINE_ENV, ENGINE_READY_ENV)

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

    @property
    def serve_argv(self) -> tuple[str, ...]:
        """The whole command where a renderer must name it: `vllm serve` and the args."""
        return (*SERVE_COMMAND, *self.args)


def _json(value: Any) -> str:
    # Canonical JSON so renders are byte-identical.
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


# The OpenAI-compatible server as a module, for a local Python (`vllm serve MODEL` is this with
# `--model MODEL`; vLLM's entrypoints/openai/api_server.py).
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# `vllm serve`: the vLLM images' ENTRYPOINT (vllm/vllm-openai and vllm/vllm-openai-rocm, vLLM's
# docker/Dockerfile and docker/Dockerfile.rocm), which the argv follows (the model first). Spelled
# here for the renderers that must name it: a Kubernetes pod's script, a Compose start that
# exports the API key before it. m31ctl's CPU image has its own (`vllm-serve`, the same argv).
SERVE_COMMAND = ("vllm", "serve")
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


# The KV transfer of a P/D role engine (vllm/envs.py; config/kv_transfer.py).
SIDE_CHANNEL_HOST_ENV = "VLLM_NIXL_SIDE_CHANNEL_HOST"
SIDE_CHANNEL_PORT_ENV = "VLLM_NIXL_SIDE_CHANNEL_PORT"
# Where a role advertises its NIXL side channel when the target names no address: its own host
# (both roles on one host, natively). vLLM's default, "localhost", is a name ZMQ binds to only
# where it resolves; an address never needs resolving.
LOOPBACK_SIDE_CHANNEL = "127.0.0.1"


def kv_transfer_args(kv: KvTransfer) -> list[str]:
    """The role's --kv-transfer-config: the connector and its side of the pair. The load
    failure policy is written only when it is not vLLM's default (fail)."""
    config: dict[str, Any] = {"kv_connector": kv.connector.vllm_name, "kv_role": kv.role.kv_role}
    if kv.load_failure_policy != "fail":
        config["kv_load_failure_policy"] = kv.load_failure_policy
    return [KV_TRANSFER_FLAG, _json(config)]


def kv_transfer_env(kv: KvTransfer, side_channel_host: str) -> dict[str, str]:
    """What the connector reads from the environment: NIXL's handshake side channel (the host
    the role binds and advertises to its peer; vLLM adds the data-parallel index to the port)
    and UCX's transports."""
    env: dict[str, str] = {}
    if kv.connector.uses_ucx:
        env[SIDE_CHANNEL_HOST_ENV] = side_channel_host
        env[SIDE_CHANNEL_PORT_ENV] = str(kv.side_channel_port)
        if kv.ucx_transports:
            env["UCX_TLS"] = kv.ucx_transports
        if kv.ucx_net_devices:
            env["UCX_NET_DEVICES"] = kv.ucx_net_devices
    return env


def build_invocation(
    deployment: Deployment, *, node: NodeRole | None = None, side_channel_host: str = LOOPBACK_SIDE_CHANNEL
) -> EngineInvocation:
    """The argv after `vllm serve` and the environment for the plan. `node`: this pod's part in
    a layout that spans nodes (the Kubernetes LeaderWorkerSet), whose flags come before the
    user's extra_args. `side_channel_host`: a P/D role's address its peer reaches it at (a word
    the target supplies, e.g. the pod IP from the downward API). The user's extra_args come
    last, as given: a flag m31ctl owns there was refused once, before (refuse_owned_flags)."""
    if deployment.disaggregated is not None:
        raise InputError(
            f"{deployment.name} is a prefill/decode group: its engines are its roles "
            "(deployment.disaggregated.prefill and .decode), each invoked on its own"
        )
    s = deployment.plan.settings
    args: list[str] = [
        deployment.model.reference,
        *_revision_args(deployment),
        "--served-model-name",
        s.model.served_name,
    ]
    for section in _SECTIONS:
        args += section(s)
    if node is not None:
        args += multi_node_args(deployment, node)
    kv = deployment.kv_transfer
    if kv is not None:
        args += kv_transfer_args(kv)
    args += list(s.engine.extra_args)
    env, effects = _environment(deployment)
    if kv is not None:
        env = tuple(sorted({**dict(env), **kv_transfer_env(kv, side_channel_host)}.items()))
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
    attention: dict[str, Any] = {}
    if s.cache.indexer_dtype != "auto":
        attention["indexer_kv_dtype"] = _INDEXER_DTYPE[s.cache.indexer_dtype]
    if s.cache.indexer_context_parallel:  # vLLM 0.33 config/attention.py minimax_m3_indexer_cp
        attention["minimax_m3_indexer_cp"] = True
    if attention:
        args += ["--attention-config", _json(attention)]
    if s.cache.block_size is not None:
        args += ["--block-size", str(s.cache.block_size)]
    if s.cache.cpu_offload_gib is not None:
        args += ["--kv-offloading-backend", "native", "--kv-offloading-size", f"{s.cache.cpu_offload_gib:g}"]
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
        args += ["--mm-encoder-tp-mode", "data", "--mm-encoder-attn-backend", mm.encoder_attention_backend]
        # vLLM uses the shared-memory processor cache with one data-parallel rank only (DP > 1:
        # "processor_only", vllm/multimodal/cache/factories.py _get_cache_type).
        if s.parallelism.data == 1:
            args += ["--mm-processor-cache-type", "shm"]
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


def _revision_args(deployment: Deployment) -> list[str]:
    """A checkpoint pinned at a commit (the rendered targets download it first): vLLM reads that
    snapshot, and the tokenizer's revision follows the model's (vllm/config/model.py)."""
    commit = deployment.model.commit
    return ["--revision", commit] if commit else []


def _environment(deployment: Deployment) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """The engine's environment (sorted, no secrets) and what it does beyond its face value."""
    s = deployment.plan.settings
    # vLLM's own limit on the engine's start (vllm/envs.py, default 600 s) raised to the load
    # budget: under the default a longer load exits, and every restart policy loops on it.
    env: dict[str, str] = {ENGINE_READY_ENV: str(deployment.timeline.engine_ready_s)}
    if deployment.model.commit:
        # The snapshot is in the cache before the engine starts: a restart never downloads, and
        # a repo that moved on cannot hand the engine other files.
        env[OFFLINE_ENV] = "1"
    effects: list[str] = []
    if s.moe.backend == "aiter":
        env.update(_AITER_MOE_ENV)
        effects.append(
            "VLLM_ROCM_USE_AITER=1 switches on every AITER path whose switch defaults on: "
            + ", ".join(AITER_DEFAULT_ON)
        )
    if s.moe.expert_requantization == "mxfp8":
        # Nothing reaches the engine: stock vLLM 0.33 has no code path that re-quantizes NVFP4
        # experts at load (docs/decisions.md), so the setting only changes what capacity counts.
        effects.append(
            "moe.expert_requantization=mxfp8 is a capacity assumption for an image that re-quantizes "
            "the NVFP4 experts to MXFP8 at load (capacity counts them at 8.25 bits); no code path in "
            "stock vLLM 0.33 does so and m31ctl passes the engine nothing for it"
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


# What the adapter emits, and so owns: engine.extra_args may not set it again (m31ctl/engine/owned.py).
def _everything_on() -> list[PlanSettings]:
    """Settings that switch every argv section of the adapter on (several: multimodal's modes
    exclude each other, and a flag may depend on the layout)."""
    base = {
        "model": {"id": "x", "path": "x", "served_name": "x"},
        "engine": {"image": "x"},
        "attention_backend": "x",
        "cache": {
            "kv_dtype": "fp8",
            "indexer_dtype": "fp8",
            "indexer_context_parallel": True,
            "block_size": 128,
            "cpu_offload_gib": 1,
        },
        "speculative": {
            "method": "dspark",
            "tokens": 1,
            "draft_attention_backend": "x",
            "draft_sampling": "greedy",
        },
        "moe": {"backend": "x"},
        "serving": {
            "max_num_seqs": 1,
            "tool_call_parser": "x",
            "reasoning_parser": "x",
            "trust_remote_code": True,
            "shutdown_timeout": 1,
        },
    }
    wide = {"tensor": 2, "pipeline": 2, "data": 2, "expert": True, "decode_context": 2}
    encoder = {"image": False, "encoder_data_parallel": True, "encoder_attention_backend": "x"}
    return [
        PlanSettings.model_validate({**base, "parallelism": parallelism, "multimodal": multimodal})
        for parallelism in (wide, {})  # some flags depend on the layout (one DP rank: shm cache)
        for multimodal in (encoder, {"text_only": True})
    ]


@cache
def emitted_flags() -> frozenset[str]:
    """Every flag the adapter can put into `vllm serve`'s argv (its sections, and the multi-node
    flags of a leader and a worker, over Ray and without)."""
    flags: set[str] = {"--served-model-name", KV_TRANSFER_FLAG}  # the latter: each P/D role's
    for settings in _everything_on():
        for section in _SECTIONS:
            flags.update(a for a in section(settings) if a.startswith("--"))
    for pipeline, data in ((2, 1), (1, 2)):
        layout = Layout(
            nodes=2,
            gpus_per_host=8,
            gpus_per_node=8,
            tensor=8,
            pipeline=pipeline,
            data=data,
            expert=False,
            data_local=1,
        )
        for leader in (True, False):
            role = NodeRole(leader, "$LEADER", "$RANK")
            fake = cast("Deployment", SimpleNamespace(layout=layout))
            flags.update(a for a in multi_node_args(fake, role) if a.startswith("--"))
    return frozenset(flags)


def owned_settings(version: str | None = None) -> dict[str, str]:
    """The flags this adapter owns -> the setting that owns each (m31ctl/engine/owned.py)."""
    return owned.owned_settings(emitted_flags(), version)


def owned_flag(arg: str, version: str = "0.32.0") -> str | None:
    """The owned flag (canonical) `arg` sets when vLLM `version` parses it, or None."""
    return owned.owned_flag(arg, emitted_flags(), version)


def refuse_owned_flags(plan: Plan) -> None:
    """Raise InputError for the first owned flag in engine.extra_args. vLLM keeps the last value of
    a repeated flag and extra_args come last in every engine's argv, so one there would win over
    the plan's. Decided once, for the plan a command acts on (m31ctl/commands.py deployment()),
    before anything is rendered, started or shown; build_invocation then reads extra_args as given
    (a P/D group's roles keep the group's)."""
    version = plan.settings.engine.schema_version
    source = plan.provenance.get("engine.extra_args")
    where = str(source) if source else None
    key = owned.overridden_key(plan.settings.engine.extra_args)
    if key is not None:
        raise InputError(
            f"engine.extra_args sets {key} through {owned.HF_OVERRIDES}, which rewrites the checkpoint's "
            "config that the recipe, capacity and the engine rules read the model from: they would "
            "describe another model than vLLM loads",
            where=where,
            hint=f"remove it; {owned.HF_OVERRIDES} may set RoPE scaling only (text_config.rope_scaling)",
        )
    for arg in plan.settings.engine.extra_args:
        flag = owned_flag(arg, version)
        if flag is None:
            continue
        setting = owned_settings(version)[flag]
        spelled = arg.split("=", 1)[0]
        named = flag if spelled == flag else f"{spelled!r} (vLLM's {flag})"
        raise InputError(
            f"engine.extra_args sets {named}, which m31ctl sets from {setting}: the container, "
            "probes, rendered files and capacity would describe another server than vLLM runs",
            where=where,
            hint=f"remove it from engine.extra_args and set {setting}",
        )
