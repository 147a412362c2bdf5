"""The typed schema of plan settings: what recipes, profiles, override files and
`--set` may say. It speaks the domain (cache dtypes, speculative method), never
vLLM flag spellings: those live in the engine adapter alone."""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator, model_validator

from m31ctl.labels import Label
from m31ctl.names import name_problem
from m31ctl.redact import SECRET_ENV, secret_flag
from m31ctl.units import Size


# Counts are StrictInt: lax mode would read `tensor: true` as 1 and `"8"` as 8.
class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)


CacheDtype = Literal["auto", "nvfp4", "fp8", "bf16"]


class ModelSettings(_Frozen):
    id: str = Field(description="model entry in recipes/models.yaml")
    path: str = Field(description="Hugging Face repo id or a local checkpoint directory")
    served_name: str


class EngineSettings(_Frozen):
    name: Literal["vllm"] = "vllm"
    image: str
    # The vLLM release whose schema the adapter's argv is checked against (m31ctl/engine/schemas);
    # what a day-zero image adds beyond it is declared in schemas/image-extensions.json.
    schema_version: str = "0.32.0"
    # Escape hatch for `vllm serve` flags no recipe key covers; appended last, validated like the rest.
    extra_args: tuple[str, ...] = ()

    @field_validator("extra_args")
    @classmethod
    def _no_secret_flags(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for arg in value:
            # As vLLM's parser reads it (`--api_key`, `--hf-token=x`, `--api-k`): m31ctl.redact.
            flag = secret_flag(arg)
            if flag is not None:
                spelled = arg.split("=", 1)[0]
                # The flag is followed by a colon, never a word: the redactor masks a word there.
                named = flag if spelled == flag else f"{spelled!r} is vLLM's {flag}"
                raise ValueError(
                    f"{named}: it would put a secret into argv (visible in ps, logs and rendered "
                    f"files); {SECRET_FLAGS[flag]}"
                )
        return value


# vLLM flags that carry a secret by value (m31ctl.redact.SECRET_FLAGS), and the by-reference way.
SECRET_FLAGS = {
    "--api-key": "set runtime.api_key=true and export VLLM_API_KEY",
    "--hf-token": "export HF_TOKEN (passed to the engine by name)",
}

# Attention and KV head counts are powers of two and vLLM needs tensor parallelism to divide them.
_POWERS_OF_TWO = (1, 2, 4, 8, 16, 32, 64)


class Parallelism(_Frozen):
    # Hosts the layout spans; the hardware (--hardware or the probe) describes one of them. A
    # layout wider than one host is asked for here, never inferred from a small host.
    nodes: StrictInt = Field(1, ge=1, le=64)
    tensor: StrictInt = Field(1, ge=1, le=64)
    # Pipeline stages: where nodes have fewer GPUs than the tensor-parallel group, TP stays within
    # a node and PP spans the nodes (vLLM's multi-node guide); resolved against the hardware.
    pipeline: StrictInt = Field(1, ge=1, le=16)
    data: StrictInt = Field(1, ge=1, le=1024)
    expert: bool = False
    decode_context: StrictInt = Field(1, ge=1)
    # Fill the host: replicate the layout with data parallelism over every GPU of the host
    # (TP4 on 8 GPUs becomes DP2 x TP4 in one server); resolved against the hardware.
    fill_host: bool = False

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipeline * self.data

    @model_validator(mode="after")
    def _dcp_divides_tp(self) -> Parallelism:
        if self.tensor not in _POWERS_OF_TWO:
            raise ValueError(
                f"parallelism.tensor={self.tensor} must be a power of two (1, 2, 4, 8, ...): the model's "
                "attention heads must divide evenly across tensor-parallel ranks"
            )
        if self.decode_context > 1 and self.tensor % self.decode_context:
            raise ValueError(
                f"parallelism.decode_context ({self.decode_context}) must divide parallelism.tensor ({self.tensor})"
            )
        return self


class CacheSettings(_Frozen):
    kv_dtype: CacheDtype = "auto"
    indexer_dtype: CacheDtype = "auto"
    # Indexer context parallelism: the sparse indexer's scoring sharded over the TP group (vLLM
    # 0.33 --attention-config minimax_m3_indexer_cp; ROCm, TP > 1, bf16/fp8 index cache, -dcp 1).
    indexer_context_parallel: bool = False
    block_size: StrictInt | None = Field(None, ge=1)
    # A CPU tier for the prefix cache (vLLM's native KV offloading, its OffloadingConnector): blocks
    # evicted from GPU memory stay in this many GiB of host memory, summed over the tensor-parallel
    # ranks (vllm/config/cache.py kv_offloading_size), and a prefix hit restores them instead of
    # recomputing the prompt. Every KV cache group goes, the sparse indexer's with the main cache
    # (the connector SupportsHMA). None: no CPU tier.
    cpu_offload_gib: float | None = Field(None, gt=0)


class SpeculativeSettings(_Frozen):
    method: Literal["none", "dspark"] = "none"
    tokens: StrictInt | None = Field(None, ge=1, le=16)
    draft_attention_backend: str | None = None
    draft_sampling: Literal["greedy", "probabilistic"] | None = None

    @model_validator(mode="after")
    def _tokens_follow_method(self) -> SpeculativeSettings:
        if self.method != "none" and self.tokens is None:
            raise ValueError(f"speculative.tokens is required when speculative.method is {self.method}")
        if self.method == "none" and (self.tokens or self.draft_attention_backend or self.draft_sampling):
            raise ValueError(
                "speculative.method is none, so tokens, draft_attention_backend and draft_sampling must be null"
            )
        return self


class MoESettings(_Frozen):
    backend: str = "auto"
    # A capacity assumption, passed to no engine: "mxfp8" counts the experts at 8.25 bits, for a
    # day-zero image whose AITER MoE path re-quantizes NVFP4 experts at load as the launch post says;
    # stock vLLM 0.33 has no such code path (docs/decisions.md, issue 35 audit).
    expert_requantization: Literal["none", "mxfp8"] = "none"

    @model_validator(mode="after")
    def _requantization_needs_aiter(self) -> MoESettings:
        # The launch post places the re-quantization in AITER's MoE path (CDNA4 lacks NVFP4
        # dequantization): the assumption makes sense with that backend only.
        if self.expert_requantization == "mxfp8" and self.backend != "aiter":
            raise ValueError(
                "moe.expert_requantization=mxfp8 happens only in the AITER MoE path (moe.backend=aiter)"
            )
        return self


class Multimodal(_Frozen):
    image: bool = True
    video: bool = True
    # vllm-project/recipes models/MiniMaxAI/MiniMax-M3.yaml, features text_only / encoder_parallel:
    # text-only serving skips loading the vision encoder (frees its memory); the encoder can
    # instead run data-parallel with its own attention backend and a shared-memory processor
    # cache. Upstream calls the two mutually exclusive.
    text_only: bool = False
    encoder_data_parallel: bool = False
    # The encoder's attention backend under encoder_data_parallel (per vendor, set by the recipe).
    encoder_attention_backend: str | None = None

    @model_validator(mode="after")
    def _one_encoder_mode(self) -> Multimodal:
        if self.text_only and self.encoder_data_parallel:
            raise ValueError(
                "multimodal.text_only and multimodal.encoder_data_parallel exclude each other "
                "(text-only serving loads no vision encoder to parallelize)"
            )
        if self.encoder_data_parallel and not self.encoder_attention_backend:
            raise ValueError("multimodal.encoder_data_parallel needs multimodal.encoder_attention_backend")
        return self


class Serving(_Frozen):
    max_model_len: StrictInt = Field(262144, ge=1)
    max_num_seqs: StrictInt | None = Field(None, ge=1)
    gpu_memory_utilization: float = Field(0.92, gt=0, le=1)
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    trust_remote_code: bool = False
    shutdown_timeout: StrictInt = Field(
        30, ge=0, description="seconds vLLM drains in-flight requests on SIGTERM"
    )


class RuntimeSettings(_Frozen):
    # --set runtime.env.X=1 parses 1 as JSON; environment values are strings all the same.
    model_config = ConfigDict(frozen=True, extra="forbid", coerce_numbers_to_str=True, defer_build=True)

    port: StrictInt = Field(8000, ge=1, le=65535)
    # Loopback by default: an open port on all interfaces is a deliberate choice with a key.
    bind: str = "127.0.0.1"
    # Serve with an API key read from VLLM_API_KEY at start (by reference; never in argv).
    api_key: bool = False
    container_name: str = "m31ctl-minimax-m31-flash"
    hf_cache: str = "~/.cache/huggingface"
    ipc_host: bool = False
    shm_size: Size = "64g"
    seccomp_unconfined: bool = False
    # Container ulimits (soft = hard; -1 = unlimited). Unlimited locked memory serves pinned host
    # buffers and RDMA; NVIDIA's container guide asks for a 64 MB stack.
    ulimits: dict[str, StrictInt] = Field(default_factory=lambda: {"memlock": -1, "stack": 67108864})
    # Seconds allowed from start to ready (download, load, compile). Unset: sized from the plan,
    # checkpoint bytes at download_mbps plus load_and_compile_s (container.startup_budget_s).
    startup_timeout: StrictInt | None = Field(None, ge=1)
    download_mbps: float = Field(1000.0, gt=0, description="checkpoint download bandwidth, Mbit/s")
    load_and_compile_s: StrictInt = Field(
        1200, ge=0, description="weight loading, compilation, graph capture"
    )
    env: dict[str, str] = Field(default_factory=dict)
    # `launch --runtime native`: the Python that has vLLM (default: the one running m31ctl).
    native_python: str | None = None

    @field_validator("env")
    @classmethod
    def _no_secrets_by_value(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if name in SECRET_ENV:
                raise ValueError(
                    f"{name} is a secret and is never written into a plan: export {name} where m31ctl, "
                    "docker or systemd runs (launch and the rendered files pass it by name), or put it in "
                    "the Kubernetes Secret"
                )
        return value

    @field_validator("container_name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        problem = name_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("bind")
    @classmethod
    def _bind_is_an_address(cls, value: str) -> str:
        # Docker's -p and Compose take an IP address only ("invalid IP address" for a name), and
        # a name could resolve differently where the server runs.
        try:
            return str(ipaddress.ip_address(value))
        except ValueError:
            raise ValueError(
                "not an IP address: use 127.0.0.1 (this host only), "
                "::1, or 0.0.0.0 / :: (every interface, with runtime.api_key=true)"
            ) from None

    @property
    def exposed(self) -> bool:
        """Whether the API is reachable beyond this host (any bind but a loopback address)."""
        return not ipaddress.ip_address(self.bind).is_loopback

    @model_validator(mode="after")
    def _exposed_needs_key(self) -> RuntimeSettings:
        if self.exposed and not self.api_key:
            raise ValueError(
                f"runtime.bind={self.bind} exposes the server beyond this host, which requires an API key: "
                "also set runtime.api_key=true and provide VLLM_API_KEY"
            )
        return self


class CapacityAssumptions(_Frozen):
    """Inputs of the memory model beyond hardware and model facts (docs/capacity.md)."""

    # Per-GPU memory vLLM's budget cannot give to weights or KV: activations, CUDA graphs,
    # NCCL buffers, the draft model, non-torch allocations. The published 28/76 figures hold
    # for any value from 7.7 to 14.1 GiB; 10 GiB is a round figure inside that band.
    runtime_reserve_gib: float = Field(10.0, ge=0)


class AutoscalingSettings(_Frozen):
    """Copies of one server scaled on vLLM's own load metrics by a KEDA ScaledObject
    (`render --target monitoring` writes it: it reads what the PodMonitor scrapes)."""

    # 1: one copy, no autoscaler. Above it, copies from 1 up to this many; never to zero (a copy
    # takes the timeline's whole start to serve again).
    max_replicas: StrictInt = Field(1, ge=1, le=64)
    # Another copy starts when more requests than this wait per copy (vllm:num_requests_waiting).
    waiting_per_replica: StrictInt = Field(8, ge=1)
    # ...or when the copies' KV cache is this full on average (vllm:kv_cache_usage_perc, 0-1).
    kv_cache_usage: float = Field(0.85, gt=0, le=1)
    # The Prometheus KEDA queries: the Prometheus Operator's own Service for the Prometheus it runs.
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"


class KubernetesSettings(_Frozen):
    """What `render --target k8s` needs beyond the container: scheduling and multi-node network."""

    # Extra node labels to select on (the GPU product label is added from the plan's hardware).
    node_selector: dict[str, str] = Field(default_factory=dict)
    # e.g. [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    tolerations: tuple[dict[str, str], ...] = ()
    cpu: str = "16"  # requested per pod
    memory: Size = "256g"  # requested per pod (page cache for the checkpoint comes on top)
    # The Hugging Face cache claim the manifest creates: the checkpoint lives here.
    hf_cache_size: Size = "600g"
    hf_cache_storage_class: str | None = None
    # Multi-node only: extra resources per pod and variables (e.g. NCCL_SOCKET_IFNAME) for the
    # collective network, as given. RDMA is fabric.rdma, which derives its resource, NCCL_IB_HCA,
    # UCX's transports and devices, IPC_LOCK and /dev/infiniband for every target at once.
    network_resources: dict[str, StrictInt] = Field(default_factory=dict)
    network_env: dict[str, str] = Field(default_factory=dict)
    # A Service puts the API on the cluster network, and vLLM's key guards /v1 only: the pods
    # need VLLM_API_KEY from the Secret unless this says otherwise (runtime.api_key aside).
    require_api_key: bool = True
    # NetworkPolicy peers (podSelector / namespaceSelector / ipBlock objects) admitted to the API
    # port. The default admits the namespace's pods that carry the client label, not every pod:
    # the API key guards /v1 only, and /invocations, /tokenize, /pause and /metrics answer without
    # it on the same port (docs/decisions.md). [] admits none (kubelet probes still pass).
    api_clients: tuple[dict[str, Any], ...] = ({"podSelector": {"matchLabels": {Label.API_CLIENT: "true"}}},)
    # The Pod Security level the pods must pass. baseline leaves out what the Docker targets add
    # for AMD (SYS_PTRACE, seccomp Unconfined), which that level rejects; privileged adds them.
    pod_security: Literal["baseline", "privileged"] = "baseline"
    # How a changed plan replaces the serving pods: recreate stops them before the new ones start
    # (no second copy's GPUs needed; a start's downtime), surge starts one more copy and stops the
    # old only once the new one is ready (its GPUs must be free). render/k8s.py `ROLLOUTS`.
    rollout: Literal["recreate", "surge"] = "recreate"
    # GPUs the cluster keeps free for a surge's second copy; None: not said (plan/rollout.py).
    spare_gpus: StrictInt | None = Field(None, ge=0)
    autoscaling: AutoscalingSettings = Field(default_factory=AutoscalingSettings)


class VerifySettings(_Frozen):
    """`m31ctl verify`'s load and its pass marks; profiles set what their use needs."""

    requests: StrictInt = Field(16, ge=1, le=100000)
    input_len: StrictInt = Field(1024, ge=1)
    output_len: StrictInt = Field(256, ge=1)
    concurrency: StrictInt = Field(8, ge=1)
    # Pass marks (None: measured and reported, not gated). Latencies are p99 over the requests.
    ttft_p99_ms: float | None = Field(None, gt=0)
    tpot_p99_ms: float | None = Field(None, gt=0)
    min_output_throughput: float | None = Field(None, gt=0, description="output tokens/s")
    min_acceptance_length: float | None = Field(
        None, ge=1, description="speculative decoding, tokens per step"
    )


# The KV connectors a disaggregated plan may name (plan/disaggregation.py holds their facts); the
# plan rules refuse, each with its reason, those m31ctl cannot pair (lmcache, moriio), so they stay
# names here rather than fail as unknown values.
ConnectorName = Literal["nixl", "moriio", "mooncake", "lmcache"]


class DisaggregatedRole(_Frozen):
    """One side of a prefill/decode pair: its own parallelism and where it listens. Unset
    parallelism inherits the plan's `parallelism` section."""

    # Environment values are strings (--set ...env.X=1 parses 1 as JSON), as in RuntimeSettings.
    model_config = ConfigDict(frozen=True, extra="forbid", coerce_numbers_to_str=True, defer_build=True)

    tensor: StrictInt | None = Field(None, ge=1, le=64)
    data: StrictInt | None = Field(None, ge=1, le=1024)
    nodes: StrictInt | None = Field(None, ge=1, le=64)
    # The engine's API port on its host (the router, on runtime.port, is what clients reach).
    # None: the role's own default (plan/disaggregation.py ROLE_PORTS).
    port: StrictInt | None = Field(None, ge=1, le=65535)
    # The NIXL handshake's side channel (VLLM_NIXL_SIDE_CHANNEL_PORT); vLLM adds each
    # data-parallel rank's index. None: the role's own default.
    side_channel_port: StrictInt | None = Field(None, ge=1, le=65535)
    # What may differ between the roles only to be refused: the factors of vLLM's NIXL
    # compatibility hash (nixl/metadata.py compute_nixl_compatibility_hash). None: the plan's.
    image: str | None = None
    kv_dtype: CacheDtype | None = None
    attention_backend: str | None = None
    # Added to runtime.env for this role's engine (e.g. the CPU build's thread binding per role).
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("env")
    @classmethod
    def _no_secrets_by_value(cls, value: dict[str, str]) -> dict[str, str]:
        return RuntimeSettings._no_secrets_by_value(value)


class RouterSettings(_Frozen):
    """vllm-router (vllm-project/router), which pairs each request's prefill and decode."""

    # None: the engine image (m31ctl's CPU rehearsal image installs vllm-router; a GPU image
    # without it needs one that has: docs/decisions.md).
    image: str | None = None
    # round_robin: the default cache_aware policy adds a render call to each side per request.
    policy: Literal["round_robin", "random", "cache_aware", "power_of_two"] = "round_robin"
    # Its Prometheus exporter is always on and the router exits if the port is taken; 0: launch
    # picks a free port (rendered files use 29000).
    metrics_port: StrictInt = Field(0, ge=0, le=65535)
    health_check_interval_s: StrictInt = Field(5, ge=1)
    # vllm-router's default (5 s) marked a busy but serving decode unhealthy on a loaded host
    # ("No available workers"; docs/decisions.md, "P/D: real parts").
    health_check_timeout_s: StrictInt = Field(30, ge=1)


class Disaggregation(_Frozen):
    """Prefill/decode disaggregation: a prefill engine (kv_producer) and a decode engine
    (kv_consumer) joined by a KV connector, behind vllm-router on runtime.port."""

    enabled: bool = False
    connector: ConnectorName = "nixl"
    prefill: DisaggregatedRole = Field(default_factory=DisaggregatedRole)
    decode: DisaggregatedRole = Field(default_factory=DisaggregatedRole)
    # UCX transports for NIXL (UCX_TLS); None: the platform's (plan/disaggregation.py).
    ucx_transports: str | None = None
    # UCX_NET_DEVICES: None leaves UCX's choice (every device); the CPU rehearsal names lo.
    ucx_net_devices: str | None = None
    # What decode does when a transfer fails: vLLM's kv_load_failure_policy (fail, the default,
    # or recompute the prompt locally).
    load_failure_policy: Literal["fail", "recompute"] = "fail"
    router: RouterSettings = Field(default_factory=RouterSettings)


# An extended resource's name as the kubelet takes it from a device plugin: a DNS subdomain, a
# slash, a name (Kubernetes "Extended resources"; rdma/ib of the RDMA shared device plugin,
# nvidia.com/hostdev of the SR-IOV network device plugin).
_RESOURCE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
# An HCA port as UCX names it in UCX_NET_DEVICES (openucx faq.md: mlx5_2:1, the device and its port).
_HCA_PORT = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*:[0-9]+$")


class RdmaSettings(_Frozen):
    """The hosts' RDMA fabric (InfiniBand or RoCE): what m31ctl derives every target's RDMA from
    (plan/rdma.py): the pods' device resource, IPC_LOCK and /dev/infiniband, UCX's transports
    and devices for a P/D pair's KV, NCCL_IB_HCA for collectives across nodes."""

    # The device plugin's extended resource each pod asks for, and how many.
    resource: str = "rdma/ib"
    count: StrictInt = Field(1, ge=1, le=64)
    # The HCA ports to use, as UCX names them (mlx5_0:1). None: every HCA the engine sees (UCX's
    # and NCCL's own choice), as where an SR-IOV plugin names the pod's functions itself.
    devices: tuple[str, ...] | None = None

    @field_validator("resource")
    @classmethod
    def _extended_resource(cls, value: str) -> str:
        if not _RESOURCE.match(value) or value.split("/", 1)[0].endswith("kubernetes.io"):
            raise ValueError(
                "not a device plugin's resource: DOMAIN/NAME outside kubernetes.io, e.g. rdma/ib or "
                "nvidia.com/hostdev"
            )
        return value

    @field_validator("devices")
    @classmethod
    def _hca_ports(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        if not value:
            raise ValueError(
                "names no HCA: list the ports to use (e.g. [mlx5_0:1]) or leave fabric.rdma.devices "
                "unset for every HCA the engine sees"
            )
        for device in value:
            if not _HCA_PORT.match(device):
                raise ValueError(
                    f"{device!r} is not an HCA port: UCX and NCCL name one DEVICE:PORT, e.g. mlx5_0:1 "
                    "(`ibv_devinfo` lists them)"
                )
        if len(set(value)) != len(value):
            raise ValueError("names a port twice")
        return value


class FabricSettings(_Frozen):
    """The network between the hosts, where a group's pods or a P/D pair's KV cross it."""

    # None: no RDMA; collectives and KV across nodes run over TCP (the plan warns where they do).
    rdma: RdmaSettings | None = None


class PlanSettings(_Frozen):
    # default_factory, not an instance: an instance built at import would build that model's
    # validator at start-up, which every command would pay.
    model: ModelSettings
    engine: EngineSettings
    parallelism: Parallelism = Field(default_factory=Parallelism)
    attention_backend: str | None = None
    cache: CacheSettings = Field(default_factory=CacheSettings)
    speculative: SpeculativeSettings = Field(default_factory=SpeculativeSettings)
    moe: MoESettings = Field(default_factory=MoESettings)
    multimodal: Multimodal = Field(default_factory=Multimodal)
    serving: Serving = Field(default_factory=Serving)
    runtime: RuntimeSettings = Field(default_factory=RuntimeSettings)
    capacity: CapacityAssumptions = Field(default_factory=CapacityAssumptions)
    kubernetes: KubernetesSettings = Field(default_factory=KubernetesSettings)
    verify: VerifySettings = Field(default_factory=VerifySettings)
    disaggregation: Disaggregation = Field(default_factory=Disaggregation)
    fabric: FabricSettings = Field(default_factory=FabricSettings)

    @model_validator(mode="after")
    def _one_kv_connector(self) -> PlanSettings:
        # vLLM 0.32 turns kv_offloading_size into the KV connector itself, over any the roles set
        # (config/vllm.py _post_init_kv_transfer_config: kv_connector = "OffloadingConnector",
        # kv_role = "kv_both"): a P/D role would lose its NixlConnector and never pair.
        if self.cache.cpu_offload_gib is not None and self.disaggregation.enabled:
            raise ValueError(
                "cache.cpu_offload_gib replaces a prefill/decode role's KV connector in vLLM 0.32 "
                "(its offloading is a KV connector too), so the pair could not transfer KV: unset "
                "cache.cpu_offload_gib or disaggregation.enabled"
            )
        return self
