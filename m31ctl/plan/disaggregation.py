"""Prefill/decode disaggregation as plan rules: the KV connectors and their facts, the settings
each role runs with, and what refuses a pair before anything starts.

A disaggregated plan is one plan: the prefill and decode engines are the plan's settings with the
role's parallelism, port and name (`role_settings`), so every rule, render and runtime that knows
one engine knows each role. What is refused here is what vLLM would refuse only once both roles
run, after the download: a connector without hybrid KV support for a model whose indexer cache is
its own KV group, a connector the platform lacks, a connector m31ctl cannot pair (MoRIIO: its router
runs only in discovery mode), roles whose NIXL compatibility hash differs, and ports that clash
on one host.
"""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from m31ctl import vllm_argv as argv
from m31ctl.errors import InputError
from m31ctl.hardware import Hardware, Platform, vendor_facts
from m31ctl.plan.catalog import ModelFacts
from m31ctl.plan.engine_check import check_engine
from m31ctl.plan.layers import Layer
from m31ctl.plan.rdma import RDMA_UCX_TRANSPORTS, ucx_net_devices
from m31ctl.plan.rdma import SETTING as RDMA_SETTING
from m31ctl.plan.settings import DisaggregatedRole, Parallelism, PlanSettings


class Role(str, Enum):
    """A side of the pair; its value is the settings key under `disaggregation`."""

    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def kv_role(self) -> str:
        """vLLM's kv_role (config/kv_transfer.py): prefill produces the KV, decode consumes it."""
        return _KV_ROLES[self]


_KV_ROLES = {Role.PREFILL: "kv_producer", Role.DECODE: "kv_consumer"}
ROLES = (Role.PREFILL, Role.DECODE)


class RolePorts(NamedTuple):
    api: int
    side_channel: int  # the first; data-parallel rank i listens on side_channel + i


# Both roles may share a host: distinct API ports, and side channels 100 apart so neither role's
# data-parallel ranks reach the other's (vLLM's own default, 5600, is prefill's).
ROLE_PORTS = {Role.PREFILL: RolePorts(8100, 5600), Role.DECODE: RolePorts(8200, 5700)}


def role_ports(settings: PlanSettings, role: Role) -> RolePorts:
    spec: DisaggregatedRole = getattr(settings.disaggregation, role.value)
    default = ROLE_PORTS[role]
    return RolePorts(spec.port or default.api, spec.side_channel_port or default.side_channel)


class Connector(NamedTuple):
    """A KV connector vLLM 0.32 registers (distributed/kv_transfer/kv_connector/factory.py)."""

    vllm_name: str  # kv_transfer_config.kv_connector
    router_name: str | None  # vllm-router's --kv-connector; None: the router cannot pair it
    # Declares SupportsHMA: with the hybrid KV cache manager on (MiniMax-M3's indexer cache is its
    # own KV group), vLLM refuses any other connector at start (factory.py: "does not support HMA").
    hybrid: bool
    platforms: frozenset[Platform]
    uses_ucx: bool  # NIXL moves the KV over UCX (UCX_TLS, UCX_NET_DEVICES)
    source: str
    # Why m31ctl refuses to pair it although vLLM and vllm-router know it; None: it pairs.
    unpaired: str | None = None


# vllm-router 0.1.17 (the pinned image, recipes/defaults.yaml) takes --kv-connector moriio only
# with --vllm-discovery-address: with the fixed --prefill/--decode URLs m31ctl renders it exits 1
# at start (config validation, run here: "MoRI-IO KV connector requires service discovery to be
# enabled (ZMQ addresses are obtained via instance registration)"). In discovery mode each role
# registers from its kv_connector_extra_config (vllm 0.32 moriio/moriio_common.py
# MoRIIOConfig.from_vllm_config: http_port is required, proxy_ip and proxy_ping_port start the
# heartbeat, moriio_connector.py _start_heartbeat) at get_ip() or host_ip, not the loopback the
# roles listen on. Rendering that for every target is unproven here (no AMD GPU; the CPU build
# has no MORI-IO engine), so the plan refuses it (docs/decisions.md).
MORIIO_UNPAIRED = (
    "vllm-router 0.1.17 pairs it only in ZMQ discovery mode (with fixed --prefill/--decode URLs "
    'it exits at start: "MoRI-IO KV connector requires service discovery"), where each role '
    "registers from kv_connector_extra_config (proxy_ip, proxy_ping_port, http_port; vllm 0.32 "
    "moriio_common.py), and m31ctl renders neither"
)


CONNECTORS: dict[str, Connector] = {
    "nixl": Connector(
        "NixlConnector", "nixl", True, frozenset({Platform.CUDA, Platform.ROCM, Platform.CPU}), True,
        "vllm 0.32 kv_connector/v1/nixl/connector.py (SupportsHMA); nixl/utils.py "
        "_NIXL_SUPPORTED_DEVICE lists cuda and cpu (PR #28356), ROCm reports device type cuda",
    ),
    "moriio": Connector(
        "MoRIIOConnector", "moriio", True, frozenset({Platform.ROCM}), False,
        "vllm 0.32 kv_connector/v1/moriio/moriio_connector.py:225 (SupportsHMA); AMD's MORI-IO "
        "RDMA library (ROCm/mori); vllm-router --kv-connector moriio", MORIIO_UNPAIRED,
    ),
    "mooncake": Connector(
        "MooncakeConnector", "mooncake", True, frozenset({Platform.CUDA, Platform.ROCM}), False,
        "vllm 0.32 kv_connector/v1/mooncake/mooncake_connector.py:703 (SupportsHMA); "
        "vllm-router --kv-connector mooncake",
    ),
    "lmcache": Connector(
        "LMCacheConnectorV1", None, False, frozenset({Platform.CUDA, Platform.ROCM}), False,
        "vllm 0.32 kv_connector/v1/lmcache_connector.py (no SupportsHMA)",
    ),
}  # fmt: skip

# UCX transports NIXL uses per platform when the plan names none: NVIDIA copies through CUDA and
# IPC within a node and TCP across (llm-d's P/D guides; fabric.rdma: plan/rdma.py's); the CPU
# build moves host memory over TCP, shared memory and self (measured here: notes/pd-disaggregation.md).
UCX_TRANSPORTS = {
    Platform.CUDA: "cuda_copy,cuda_ipc,tcp",
    Platform.ROCM: "rocm_copy,rocm_ipc,tcp",
    Platform.CPU: "tcp,self,sm",
}

KV_TRANSFER_FLAG = "--kv-transfer-config"  # vLLM's spelling, which the adapter emits per role
COMPATIBILITY_SOURCE = "vllm 0.32 kv_connector/v1/nixl/metadata.py compute_nixl_compatibility_hash"


def role_parallelism(plan_par: Parallelism, role: DisaggregatedRole) -> Parallelism:
    """A role's layout: its own tensor, data and nodes; pipeline, expert and decode-context
    parallelism from the plan (expert decided over the roles' layouts: engine_settings). A role
    is one engine: data parallelism defaults to 1."""
    return plan_par.model_copy(
        update={
            "tensor": role.tensor or plan_par.tensor,
            "data": role.data or 1,
            "nodes": role.nodes or 1,
            "fill_host": False,
        }
    )


def role_settings(settings: PlanSettings, role: Role) -> PlanSettings:
    """The settings the role's engine runs with: the plan's, with the role's layout, port, name
    and what it may set apart (image, KV dtype, attention backend; refused unless equal)."""
    pd = settings.disaggregation
    spec: DisaggregatedRole = getattr(pd, role.value)
    runtime = settings.runtime
    return settings.model_copy(
        update={
            "parallelism": role_parallelism(settings.parallelism, spec),
            "engine": settings.engine.model_copy(update={"image": spec.image or settings.engine.image}),
            "cache": settings.cache.model_copy(update={"kv_dtype": spec.kv_dtype or settings.cache.kv_dtype}),
            "attention_backend": spec.attention_backend or settings.attention_backend,
            # The engines are the router's upstreams: loopback on their host, never the API bind.
            "runtime": runtime.model_copy(
                update={
                    "port": role_ports(settings, role).api,
                    "bind": "127.0.0.1",
                    "container_name": f"{runtime.container_name}-{role.value}",
                    "env": {**runtime.env, **spec.env},
                }
            ),
        }
    )


def engine_settings(settings: PlanSettings) -> tuple[tuple[str, PlanSettings], ...]:
    """The engines the plan runs, each as (who, its settings): the plan's own for one server,
    each role's for a P/D pair. The runtime shapes (plan/runtime_shapes.py) run over these at
    plan time, so a role's tensor and data size are what its decode row limit and expert
    decision read; the values they settle are the plan's, which every role inherits."""
    if not settings.disaggregation.enabled:
        return (("", settings),)
    return tuple((role.value, role_settings(settings, role)) for role in ROLES)


def pair_wider_than_host(prefill_gpus: int, decode_gpus: int, product: str | None, count: int) -> str:
    """What a pair that one host cannot hold needs, in the words every refusal and note uses
    (m31ctl/pair.py's refusal, the plan's note)."""
    return (
        f"the prefill/decode pair needs {prefill_gpus + decode_gpus} GPUs ({prefill_gpus} prefill, "
        f"{decode_gpus} decode) on one host and a {product} host has {count}"
    )


def connector_of(settings: PlanSettings) -> Connector:
    return CONNECTORS[settings.disaggregation.connector]


def ucx_transports(settings: PlanSettings, hw: Hardware) -> str:
    """UCX_TLS for a role: the setting, else RDMA's where fabric.rdma is set (plan/rdma.py),
    else the platform's."""
    platform = vendor_facts(hw.vendor).platform
    if settings.disaggregation.ucx_transports:
        return settings.disaggregation.ucx_transports
    if settings.fabric.rdma is not None and platform in RDMA_UCX_TRANSPORTS:
        return RDMA_UCX_TRANSPORTS[platform]
    return UCX_TRANSPORTS[platform]


def ucx_devices(settings: PlanSettings) -> str | None:
    """UCX_NET_DEVICES for a role: the setting, else fabric.rdma's HCA ports, else None (UCX's choice)."""
    return settings.disaggregation.ucx_net_devices or ucx_net_devices(settings.fabric.rdma)


def _unused_rdma(settings: PlanSettings) -> tuple[str, ...]:
    """fabric.rdma where nothing the plan runs leaves its container: no target renders it."""
    pd = settings.disaggregation
    over_nodes = settings.parallelism.nodes > 1 or any(
        getattr(pd, role.value).nodes not in (None, 1) for role in ROLES
    )
    if over_nodes or (pd.enabled and CONNECTORS[pd.connector].uses_ucx):
        return ()
    return (
        f"{RDMA_SETTING} is set, but the plan runs one engine on one node (no collective or KV "
        "crosses a node): no target renders it",
    )


def pair_fabric_warnings(settings: PlanSettings, hw: Hardware, model: ModelFacts) -> tuple[str, ...]:
    """A P/D pair whose roles cannot share a node, on GPUs, with no RDMA: every prompt's KV
    crosses the network over UCX's TCP transport. A pair that fits one node is kept on one by
    every target (Kubernetes: render/pd.py's podAffinity), so it is not warned."""
    if settings.fabric.rdma is not None:
        return _unused_rdma(settings)
    if not settings.disaggregation.enabled:
        return ()
    platform = vendor_facts(hw.vendor).platform
    if platform not in RDMA_UCX_TRANSPORTS:
        return ()
    prefill, decode = (role_settings(settings, role).parallelism for role in ROLES)
    if prefill.nodes > 1 or decode.nodes > 1:
        why = "a role spans nodes"
    elif prefill.gpus + decode.gpus > hw.count:
        why = f"{prefill.gpus} + {decode.gpus} GPUs, each {hw.product} node has {hw.count}"
    else:
        return ()
    dtype, length = settings.cache.kv_dtype, settings.serving.max_model_len
    per_token = model.published_kv_bytes_per_token.get(dtype)
    cost = (
        f" (at least {per_token:,} bytes a token at {dtype}, the published main-attention figure: "
        f"{per_token * length / 1e9:.1f} GB for a {length:,}-token prompt)"
        if per_token
        else ""
    )
    return (
        f"prefill and decode run on different nodes ({why}) and {RDMA_SETTING} is unset: every prompt's "
        f"KV crosses the network over UCX's TCP transport{cost}, where RDMA would read it GPU to GPU; "
        f"set {RDMA_SETTING} (the pods' RDMA device resource, e.g. {RDMA_SETTING}.resource=rdma/ib, and "
        f"the HCA ports in {RDMA_SETTING}.devices)",
    )


# --- the rules ------------------------------------------------------------------------------


class _Pairing(NamedTuple):
    key: str  # the role setting that may differ
    factor: str  # as vLLM's compatibility hash names it


_PAIRING_FACTORS = (
    _Pairing("image", "the vLLM version (the image)"),
    _Pairing("kv_dtype", "the KV cache dtype"),
    _Pairing("attention_backend", "the attention backend"),
)


def check_disaggregation(settings: PlanSettings, merged: Layer, hw: Hardware, model: ModelFacts) -> None:
    """Refuse (InputError, exit 2) a disaggregated plan whose roles cannot serve as a pair."""
    if not settings.disaggregation.enabled:
        return
    for problem in (
        _layout_problem,
        _extra_args_problem,
        _connector_problem,
        _pairing_problem,
        _port_problem,
    ):
        found = problem(settings, hw, model)
        if found:
            key, why, hint = found
            setting = merged.get(key)
            raise InputError(f"{key}: {why}", where=str(setting.source) if setting else None, hint=hint)


_Problem = tuple[str, str, str] | None


def _layout_problem(settings: PlanSettings, hw: Hardware, model: ModelFacts) -> _Problem:
    par = settings.parallelism
    if par.nodes > 1 or par.data > 1 or par.fill_host:
        return (
            "parallelism.nodes" if par.nodes > 1 else "parallelism.data",
            "a disaggregated plan lays out each role on its own (parallelism.nodes, .data and "
            ".fill_host apply to an aggregated server)",
            "set disaggregation.prefill.nodes / .data and disaggregation.decode.nodes / .data instead",
        )
    return None


def _extra_args_problem(settings: PlanSettings, hw: Hardware, model: ModelFacts) -> _Problem:
    # The adapter writes each role's --kv-transfer-config; one in extra_args (appended last)
    # would win over it in every spelling vLLM reads.
    version = settings.engine.schema_version
    for token in settings.engine.extra_args:
        if argv.canonical(token, version).flag == KV_TRANSFER_FLAG:
            return (
                "engine.extra_args",
                f"{token.split('=', 1)[0]} sets what disaggregation.* writes for each role (the connector "
                "and kv_role)",
                "remove it from engine.extra_args and set disaggregation.connector",
            )
    return None


def _connector_problem(settings: PlanSettings, hw: Hardware, model: ModelFacts) -> _Problem:
    name = settings.disaggregation.connector
    connector = CONNECTORS[name]
    platform = vendor_facts(hw.vendor).platform
    if platform not in connector.platforms:
        usable = sorted(n for n, c in CONNECTORS.items() if platform in c.platforms and _pairs(c))
        return (
            "disaggregation.connector",
            f"{connector.vllm_name} does not run on {platform.value} ({connector.source})",
            f"use disaggregation.connector={' or '.join(usable)}",
        )
    if model.geometry.sparse_layers is not None and not connector.hybrid:
        return (
            "disaggregation.connector",
            f"{connector.vllm_name} does not declare hybrid KV cache support, and {model.display_name}'s "
            'sparse-attention indexer cache is its own KV group: vLLM refuses it at start ("does not '
            'support HMA", kv_connector/factory.py), and turning the hybrid manager off would drop the '
            f"indexer cache from the transfer ({connector.source})",
            "use disaggregation.connector=nixl",
        )
    if connector.router_name is None:
        return (
            "disaggregation.connector",
            f"vllm-router cannot pair {connector.vllm_name} (its --kv-connector takes nixl, mooncake, moriio)",
            "use disaggregation.connector=nixl",
        )
    if connector.unpaired:
        return (
            "disaggregation.connector",
            f"m31ctl cannot pair {connector.vllm_name} yet: {connector.unpaired}",
            f"use disaggregation.connector=nixl, which runs on {platform.value} too",
        )
    return None


def _pairs(connector: Connector) -> bool:
    """Whether a plan may name the connector: hybrid KV support, and a router pairing m31ctl renders."""
    return connector.hybrid and connector.router_name is not None and connector.unpaired is None


def _pairing_problem(settings: PlanSettings, hw: Hardware, model: ModelFacts) -> _Problem:
    prefill, decode = (role_settings(settings, role) for role in ROLES)
    effective = {
        "image": (prefill.engine.image, decode.engine.image),
        "kv_dtype": (prefill.cache.kv_dtype, decode.cache.kv_dtype),
        "attention_backend": (prefill.attention_backend, decode.attention_backend),
    }
    for pairing in _PAIRING_FACTORS:
        p, d = effective[pairing.key]
        if p != d:
            side = "decode" if getattr(settings.disaggregation.decode, pairing.key) is not None else "prefill"
            return (
                f"disaggregation.{side}.{pairing.key}",
                f"prefill and decode differ in {pairing.factor} ({p!r} and {d!r}): the KV handshake "
                f"refuses engines whose compatibility hash differs ({COMPATIBILITY_SOURCE}), so the "
                "pair would start and never transfer a block",
                f"give both roles the same {pairing.key} (upgrade prefill and decode together)",
            )
    return None


def _port_problem(settings: PlanSettings, hw: Hardware, model: ModelFacts) -> _Problem:
    pd = settings.disaggregation
    ports: list[tuple[str, range]] = [
        ("runtime.port", range(settings.runtime.port, settings.runtime.port + 1))
    ]
    for role in ROLES:
        own = role_ports(settings, role)
        ranks = role_parallelism(settings.parallelism, getattr(pd, role.value)).data
        ports += [
            (f"disaggregation.{role.value}.port", range(own.api, own.api + 1)),
            (
                f"disaggregation.{role.value}.side_channel_port",
                range(own.side_channel, own.side_channel + ranks),
            ),
        ]
    if pd.router.metrics_port:
        ports.append(
            ("disaggregation.router.metrics_port", range(pd.router.metrics_port, pd.router.metrics_port + 1))
        )
    seen: dict[int, str] = {}
    for key, span in ports:
        clash = next((port for port in span if port in seen), None)
        if clash is not None:
            return (
                key,
                f"port {clash} is also {seen[clash]}: the roles, the router and the side channels "
                "(one port per data-parallel rank) share one host's ports",
                f"give {key} a port of its own",
            )
        seen.update(dict.fromkeys(span, key))
    return None


def check_role_engines(settings: PlanSettings, merged: Layer, hw: Hardware) -> tuple[str, ...]:
    """The engine rules (plan/engine_rules.py) for each role's engine: a role is a vLLM server of
    its own, refused as one. A refusal names the role; warnings say which role they are about."""
    warnings: list[str] = []
    for role in ROLES:
        try:
            found = check_engine(role_settings(settings, role), merged, hw)
        except InputError as exc:
            raise type(exc)(
                f"disaggregation.{role.value}: {exc.message}", where=exc.where, hint=exc.hint
            ) from None
        warnings += [f"{role.value}: {w}" for w in found]
    return tuple(dict.fromkeys(warnings))
