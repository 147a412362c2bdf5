"""The Deployment: every fact that acting on a plan needs, derived once from the Plan.

The plan says what to serve (settings with sources); the Deployment says how it lands on hosts:
where the checkpoint comes from, how the layout falls on nodes, how long each phase may take,
where the API listens, which secrets it reads by name, and what the GPU vendor needs. Every
consumer (the engine adapter, container specs, both runtimes, the render targets, doctor,
capacity, lock) reads these values; none derives them again, so they cannot disagree.

Deriving reads two facts of the calling process, the user's home and the working directory (to
expand `~` and relative model paths once, with m31ctl/checkpoint.py); they are parameters, so the
derivation stays a pure function of its inputs.
"""

from __future__ import annotations

from typing import NamedTuple

from m31ctl.checkpoint import ModelSource, host_path, model_source
from m31ctl.errors import HostPreconditionError
from m31ctl.hardware import Hardware, VendorFacts, vendor_facts
from m31ctl.netaddr import local_url
from m31ctl.plan import Plan
from m31ctl.plan.disaggregation import (
    ROLES,
    Connector,
    Role,
    connector_of,
    role_ports,
    role_settings,
    ucx_devices,
    ucx_transports,
)
from m31ctl.plan.rdma import Rdma, engine_rdma
from m31ctl.redact import API_KEY_ENV, HF_TOKEN_ENV
from m31ctl.timeline import RouterTimeline, Timeline, TimelineInputs, router_timeline, timeline_of

# The port vLLM listens on inside a container (published to runtime.port on the host).
CONTAINER_PORT = 8000
HF_CACHE_IN_CONTAINER = "/root/.cache/huggingface"
# The cache a system service uses when the plan leaves runtime.hf_cache at its built-in default
# (`~/...`, the renderer's home, which means nothing on the server a unit is installed on).
SERVICE_HF_CACHE = "/var/lib/m31ctl/huggingface"


class Layout(NamedTuple):
    """How the parallel layout falls on nodes. Every node of a layout that spans nodes holds the
    same share (a LeaderWorkerSet stamps one template per role), so one per-node figure holds."""

    nodes: int
    gpus_per_host: int  # what one node (the probed or simulated host) has
    gpus_per_node: int  # what the layout uses on each node
    tensor: int
    pipeline: int
    data: int
    expert: bool
    # Data-parallel ranks each node runs (the others' ranks start at node index x this).
    data_local: int

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def spans_nodes(self) -> bool:
        return self.nodes > 1

    @property
    def over_ray(self) -> bool:
        """Pipeline stages across nodes run as one engine over Ray; data-parallel ranks across
        nodes need no Ray (vLLM's multi-node data-parallel deployment)."""
        return self.spans_nodes and self.pipeline > 1

    def start_rank(self, node: int) -> int:
        return node * self.data_local

    @property
    def fits(self) -> bool:
        return self.gpus_per_node <= self.gpus_per_host


def layout_of(plan: Plan) -> Layout:
    par = plan.settings.parallelism
    total = par.tensor * par.pipeline * par.data
    nodes = par.nodes
    # resolve() refused layouts that do not divide over the nodes: the share is exact here.
    return Layout(
        nodes=nodes,
        gpus_per_host=plan.hardware.count,
        gpus_per_node=total // nodes,
        tensor=par.tensor,
        pipeline=par.pipeline,
        data=par.data,
        expert=par.expert,
        data_local=max(1, par.data // nodes),
    )


def timeline_for(plan: Plan, model: ModelSource, layout: Layout) -> Timeline:
    """The plan's clocks (m31ctl/timeline.py), from the facts they depend on."""
    runtime = plan.settings.runtime
    return timeline_of(
        TimelineInputs(
            checkpoint_gb=plan.model.checkpoint_gb,
            local_checkpoint=model.local,
            download_mbps=runtime.download_mbps,
            load_and_compile_s=runtime.load_and_compile_s,
            startup_timeout=runtime.startup_timeout,
            shutdown_timeout=plan.settings.serving.shutdown_timeout,
            nodes=layout.nodes,
            over_ray=layout.over_ray,
        )
    )


class Network(NamedTuple):
    bind: str  # an IP address literal (settings refuse names: `docker -p localhost:...` fails)
    port: int  # on the host
    container_port: int

    @property
    def local_url(self) -> str:
        """Where this host reaches the server."""
        return local_url(self.bind, self.port)


class Draft(NamedTuple):
    """The checkpoint's speculative-decoding draft: its folder inside the checkpoint (DSpark's ships
    in dspark/, seed 000) and whether the plan drafts with it. Pull and the rendered downloads
    fetch the folder only when it is used; doctor requires it then."""

    folder: str | None  # "dspark/"; None when the model has no draft folder
    used: bool

    @property
    def skipped(self) -> str | None:
        """The download pattern that leaves the folder out, when the plan does not use it."""
        return f"{self.folder.rstrip('/')}/*" if self.folder and not self.used else None


# Where DSpark drafts live in a checkpoint when the model facts do not say (the launch post).
DSPARK_FOLDER = "dspark/"


def draft_of(plan: Plan) -> Draft:
    used = plan.settings.speculative.method == "dspark"
    folder = (plan.model.draft or {}).get("location") or (DSPARK_FOLDER if used else None)
    return Draft(folder, used)


class Secrets(NamedTuple):
    """The secrets the server reads from its environment, by name only (never their values)."""

    names: tuple[str, ...]
    required: tuple[str, ...]  # the server must not start without these (fail closed)

    @property
    def api_key(self) -> str | None:
        return API_KEY_ENV if API_KEY_ENV in self.names else None


def secrets_of(plan: Plan) -> Secrets:
    if plan.settings.runtime.api_key:
        return Secrets((HF_TOKEN_ENV, API_KEY_ENV), (API_KEY_ENV,))
    # HF_TOKEN stays optional: public checkpoints download without it.
    return Secrets((HF_TOKEN_ENV,), ())


class GpuSelection(NamedTuple):
    """Which GPUs of the host the server gets, when the plan was made from this host's probe
    (which honours *_VISIBLE_DEVICES): NVIDIA by UUID, AMD by render node. Empty for a simulated
    host, where the container runtime picks by count (NVIDIA) or gets every device (AMD).
    `indices`: the host's GPU indices, set where engines share a host (a P/D pair's roles take
    GPUs 0..n-1 and n..n+m-1), so a runtime never hands both the same GPUs by count."""

    uuids: tuple[str, ...]
    render_nodes: tuple[str, ...]
    indices: tuple[int, ...] = ()


def gpu_selection(hw: Hardware, count: int, first: int | None = None) -> GpuSelection:
    """The `count` GPUs from index `first` (None: the host's first GPUs, picked by count where
    the host is simulated)."""
    indices = tuple(range(first, first + count)) if first is not None else ()
    if hw.simulated:
        return GpuSelection((), (), indices)
    chosen = hw.gpus[first or 0 :][:count]
    uuids = tuple(g.uuid for g in chosen if g.uuid)
    nodes = tuple(g.render_node for g in chosen if g.render_node)
    return GpuSelection(uuids if len(uuids) == count else (), nodes if len(nodes) == count else (), indices)


class KvTransfer(NamedTuple):
    """A P/D role engine's part in the KV transfer (plan/disaggregation.py has the rules)."""

    role: Role
    connector: Connector
    side_channel_port: int
    ucx_transports: str | None  # None where the connector does not use UCX
    ucx_net_devices: str | None
    load_failure_policy: str


class Router(NamedTuple):
    """vllm-router in front of the pair: where clients reach it and how it pairs."""

    name: str  # its container, unit, Kubernetes objects
    image: str
    network: Network  # runtime.bind and runtime.port: the API clients use
    connector: str  # vllm-router's --kv-connector
    policy: str
    metrics_port: int  # 0: chosen free at launch; rendered files use RENDERED_ROUTER_METRICS_PORT
    health_check_interval_s: int
    health_check_timeout_s: int


# vllm-router's Prometheus port in rendered files (its default, vllm-project/router); launch picks
# a free one instead when disaggregation.router.metrics_port is 0.
RENDERED_ROUTER_METRICS_PORT = 29000


class Listener(NamedTuple):
    """A port a part of the deployment listens on, and the setting that moves it."""

    setting: str
    bind: str
    port: int


class Disaggregated(NamedTuple):
    """A P/D deployment's parts: each role engine is a Deployment of its own (derived from the
    role's settings), and the router is the one endpoint."""

    prefill: Deployment
    decode: Deployment
    router: Router

    @property
    def roles(self) -> tuple[Deployment, Deployment]:
        return (self.prefill, self.decode)

    @property
    def gpus(self) -> int:
        return sum(role.layout.gpus for role in self.roles)

    @property
    def router_timeline(self) -> RouterTimeline:
        """The router's clocks, from its roles' timelines (timeline.router_timeline)."""
        longest = max(role.plan.settings.serving.max_model_len for role in self.roles)
        return router_timeline([role.timeline for role in self.roles], longest)

    @property
    def fits_one_host(self) -> bool:
        """Both roles on one node of the host: Compose, a script, systemd or launch can run the
        pair (m31ctl/pair.py refuses it otherwise); only Kubernetes places the roles on nodes of
        their own."""
        return all(not role.layout.spans_nodes for role in self.roles) and (
            not self.prefill.vendor.gpus or self.gpus <= self.prefill.layout.gpus_per_host
        )


class Deployment(NamedTuple):
    plan: Plan
    name: str  # the server's name: container, unit, Kubernetes objects, native state
    model: ModelSource
    hf_cache: str  # absolute, on the host
    # A system service's cache (systemd): hf_cache if named, else SERVICE_HF_CACHE (`~/` is the renderer's).
    service_hf_cache: str
    layout: Layout
    timeline: Timeline
    network: Network
    secrets: Secrets
    vendor: VendorFacts
    gpus: GpuSelection
    draft: Draft
    # A P/D role engine's KV transfer; None for an aggregated server and for the group itself.
    kv_transfer: KvTransfer | None = None
    # A P/D plan's parts (role engines and router); None for an aggregated server.
    disaggregated: Disaggregated | None = None
    rdma: Rdma | None = None  # its part of fabric.rdma (plan/rdma.py engine_rdma)

    @property
    def simulated(self) -> bool:
        return self.plan.hardware.simulated

    @property
    def engines(self) -> tuple[Deployment, ...]:
        """The vLLM engines this deployment runs: a P/D group's roles, else itself."""
        return self.disaggregated.roles if self.disaggregated else (self,)

    @property
    def answering_engine(self) -> Deployment:
        """The engine whose /metrics describe what clients are served: a P/D group's decode role
        (its prompts arrive as KV from prefill; the router exports only its own metrics), else
        this server itself."""
        return self.disaggregated.decode if self.disaggregated else self

    @property
    def listeners(self) -> tuple[Listener, ...]:
        """Every port this deployment's processes listen on, on their host: the endpoint, and for a
        P/D group each role's API port and NIXL side-channel ports (one per data-parallel rank,
        nixl/base_scheduler.py) and the router's metrics port when it is fixed."""
        found = [Listener("runtime.port", self.network.bind, self.network.port)]
        group = self.disaggregated
        if group is None:
            return tuple(found)
        for role in group.roles:
            assert role.kv_transfer is not None  # a role engine of the group
            key = f"disaggregation.{role.kv_transfer.role.value}"
            found.append(Listener(f"{key}.port", role.network.bind, role.network.port))
            first = role.kv_transfer.side_channel_port
            found += [
                Listener(f"{key}.side_channel_port", role.network.bind, first + rank)
                for rank in range(role.layout.data_local)
            ]
        if group.router.metrics_port:
            found.append(
                Listener("disaggregation.router.metrics_port", self.network.bind, group.router.metrics_port)
            )
        return tuple(found)

    @property
    def serving_gpus(self) -> int:
        """The GPUs that serve this deployment's requests: every engine's (a P/D group's prefill
        and decode together), what per-GPU throughput and a GPU-hour price divide by."""
        return sum(engine.layout.gpus for engine in self.engines)

    @property
    def serving_nodes(self) -> int:
        """The nodes those GPUs are on: a P/D pair on one host is one node, else each role's own
        (Kubernetes places the roles on nodes of their own); what a node-hour price multiplies."""
        if self.disaggregated is not None and self.disaggregated.fits_one_host:
            return 1
        return sum(engine.layout.nodes for engine in self.engines)

    @property
    def hardware(self) -> Hardware:
        return self.plan.hardware


class _HostPaths(NamedTuple):
    """The plan's host paths, read once for every engine (a P/D pair's roles share them)."""

    model: ModelSource
    hf_cache: str
    service_hf_cache: str


class _PairRules(NamedTuple):
    """A P/D plan's roles (prefill first), each with its KV transfer, and the router."""

    roles: tuple[tuple[Plan, KvTransfer], ...]
    router: Router


def derive(
    plan: Plan, *, home: str | None = None, cwd: str | None = None, commit: str | None = None
) -> Deployment:
    """The one Deployment of `plan` (home and cwd default to this process's). `commit`: the hub
    commit to pin a hub checkpoint at (resolved by the caller: the lock's, or the hub's answer
    at render time); ignored for a local checkpoint.

    One pass, each source asked once, in order: the host's paths (checkpoint.py), a P/D plan's
    role rules (plan/disaggregation.py), then each engine's facts with its clocks last."""
    model = model_source(plan.settings.model.path, home, cwd)
    hf_cache = host_path(plan.settings.runtime.hf_cache, "runtime.hf_cache", home)
    if commit is not None and not model.local:
        model = model._replace(commit=commit)
    service_hf_cache = hf_cache if _named_by_user(plan, "runtime.hf_cache") else SERVICE_HF_CACHE
    paths = _HostPaths(model, hf_cache, service_hf_cache)
    pair = _pair_rules(plan) if plan.settings.disaggregation.enabled else None
    engines = _derive_engines(pair.roles if pair else ((plan, None),), plan.hardware, paths)
    if pair is None:
        return engines[0]
    prefill, decode = engines
    # The group is named and reached as the plan's server; its engine facts are prefill's (its
    # secrets too: a role reads the plan's runtime.api_key).
    return prefill._replace(
        plan=plan,
        name=plan.settings.runtime.container_name,
        network=pair.router.network,
        kv_transfer=None,
        disaggregated=Disaggregated(prefill, decode, pair.router),
    )


def _pair_rules(plan: Plan) -> _PairRules:
    """Each role's engine plan (its own layout, port, name) and KV transfer; the router on the
    plan's API address."""
    settings, runtime = plan.settings, plan.settings.runtime
    pd = settings.disaggregation
    connector = connector_of(settings)
    ucx = connector.uses_ucx
    roles = tuple(
        (
            plan._replace(settings=role_settings(settings, role)),
            KvTransfer(
                role=role,
                connector=connector,
                side_channel_port=role_ports(settings, role).side_channel,
                ucx_transports=ucx_transports(settings, plan.hardware) if ucx else None,
                ucx_net_devices=ucx_devices(settings) if ucx else None,
                load_failure_policy=pd.load_failure_policy,
            ),
        )
        for role in ROLES
    )
    router = Router(
        name=f"{runtime.container_name}-router",
        image=pd.router.image or settings.engine.image,
        network=Network(runtime.bind, runtime.port, CONTAINER_PORT),
        connector=connector.router_name or connector.vllm_name,
        policy=pd.router.policy,
        metrics_port=pd.router.metrics_port,
        health_check_interval_s=pd.router.health_check_interval_s,
        health_check_timeout_s=pd.router.health_check_timeout_s,
    )
    return _PairRules(roles, router)


def _derive_engines(
    engines: tuple[tuple[Plan, KvTransfer | None], ...], hw: Hardware, paths: _HostPaths
) -> list[Deployment]:
    """Each engine with the GPUs it gets. One server: the host's first GPUs (picked by count where
    the host is simulated). A P/D pair's roles that share the host take its GPUs in turn (decode
    after prefill); a pair wider than the host runs each role on a node of its own (Kubernetes
    places them), from that node's GPU 0."""
    needs = [layout_of(engine).gpus_per_node for engine, _ in engines]
    shares_host = not vendor_facts(hw.vendor).gpus or sum(needs) <= hw.count
    first = 0 if len(engines) > 1 else None
    derived: list[Deployment] = []
    for (engine, kv), need in zip(engines, needs, strict=True):
        gpus = gpu_selection(hw, need, first)
        derived.append(_derive_engine(engine, paths, gpus, kv))
        if first is not None and shares_host:
            first += need
    return derived


def _derive_engine(plan: Plan, paths: _HostPaths, gpus: GpuSelection, kv: KvTransfer | None) -> Deployment:
    runtime = plan.settings.runtime
    layout = layout_of(plan)
    return Deployment(
        plan=plan,
        name=runtime.container_name,
        model=paths.model,
        hf_cache=paths.hf_cache,
        service_hf_cache=paths.service_hf_cache,
        layout=layout,
        network=Network(runtime.bind, runtime.port, CONTAINER_PORT),
        secrets=secrets_of(plan),
        vendor=vendor_facts(plan.hardware.vendor),
        gpus=gpus,
        draft=draft_of(plan),
        kv_transfer=kv,
        rdma=engine_rdma(plan.settings, layout.spans_nodes, kv is not None and kv.connector.uses_ucx),
        # The clocks last: they are read from the facts above (the checkpoint's source, the layout).
        timeline=timeline_for(plan, paths.model, layout),
    )


def _named_by_user(plan: Plan, key: str) -> bool:
    """Whether a layer beyond the built-in defaults set `key` (a recipe, a file, --set)."""
    source = plan.provenance.get(key)
    return source is not None and source.layer != "defaults"


def require_fit(deployment: Deployment) -> None:
    """Each node must have the GPUs the layout puts on it (plan, render, launch refuse otherwise;
    doctor reports it). A layout wider than one host is a choice (parallelism.nodes), never implied."""
    if deployment.disaggregated is not None:
        # Each role is an engine that must fit its nodes; whether both share one host is the
        # single-host targets' question (Disaggregated.fits_one_host), not the plan's.
        for role in deployment.disaggregated.roles:
            require_fit(role)
        return
    plan, layout = deployment.plan, deployment.layout
    hw = plan.hardware
    minimum = plan.recipe.match.min_memory_gib
    if hw.count and hw.memory_per_gpu_gib < minimum:
        raise HostPreconditionError(
            f"the {plan.recipe.recipe} recipe needs {minimum:g} GiB per GPU; "
            f"{hw.product} has {hw.memory_per_gpu_gib:.1f} GiB",
            hint="use GPUs with more memory",
        )
    # The CPU rehearsal's ranks are processes, not devices: any count fits its one host.
    if deployment.vendor.gpus and not layout.fits:
        where = f"each {hw.product} host ({hw.source})" if deployment.simulated else "this host"
        per_node = "" if layout.nodes == 1 else f" on each of {layout.nodes} nodes"
        # The product that makes the count: DP8 x TP4 = 32 GPUs says which setting to lower.
        product = f"TP{layout.tensor} x PP{layout.pipeline} x DP{layout.data} = {layout.gpus} GPUs"
        spread = (
            "spread the layout over nodes with --set parallelism.nodes=N (rendered for Kubernetes)"
            if layout.nodes == 1
            else f"more nodes (parallelism.nodes={layout.nodes} now), or a smaller parallelism.tensor or .data"
        )
        raise HostPreconditionError(
            f"the plan needs {layout.gpus_per_node} GPUs{per_node} ({product}; {plan.recipe.recipe}, profile "
            f"{plan.profile}) and {where} has {hw.count}",
            hint=f"use a host with more GPUs, another profile, or {spread}",
        )
