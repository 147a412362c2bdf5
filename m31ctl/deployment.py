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

import math
from typing import NamedTuple

from m31ctl.checkpoint import ModelSource, host_path, model_source
from m31ctl.errors import HostPreconditionError
from m31ctl.hardware import Hardware, VendorFacts, vendor_facts
from m31ctl.netaddr import local_url
from m31ctl.plan import Plan
from m31ctl.redact import API_KEY_ENV, HF_TOKEN_ENV

# The port vLLM listens on inside a container (published to runtime.port on the host).
CONTAINER_PORT = 8000
HF_CACHE_IN_CONTAINER = "/root/.cache/huggingface"
# How long the runtime waits beyond vLLM's own drain window (serving.shutdown_timeout) before it
# kills: the engine's workers exit after the API server, and a kill mid-exit leaves GPU memory held.
STOP_MARGIN_S = 30
# Megabits in a gigabyte (decimal units, as checkpoint sizes and link speeds are quoted).
_MBIT_PER_GB = 8000


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


class Budgets(NamedTuple):
    """Seconds each phase may take, from the plan (docs/decisions.md: startup budget)."""

    download_s: int  # 0 for a local checkpoint
    load_and_compile_s: int
    startup_s: int  # from start to ready
    drain_s: int  # vLLM's own drain on SIGTERM (serving.shutdown_timeout)
    stop_s: int  # what the runtime waits before it kills


def budgets_of(plan: Plan, model: ModelSource) -> Budgets:
    runtime = plan.settings.runtime
    download = (
        0 if model.local else math.ceil(plan.model.checkpoint_gb * _MBIT_PER_GB / runtime.download_mbps)
    )
    startup = runtime.startup_timeout
    if startup is None:
        # A 250.1 GB checkpoint at 1 Gbit/s is 2,001 s; below about 560 Mbit/s it alone passes an hour.
        startup = download + runtime.load_and_compile_s
    drain = plan.settings.serving.shutdown_timeout
    return Budgets(download, runtime.load_and_compile_s, startup, drain, drain + STOP_MARGIN_S)


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
    host, where the container runtime picks by count (NVIDIA) or gets every device (AMD)."""

    uuids: tuple[str, ...]
    render_nodes: tuple[str, ...]


def gpu_selection(hw: Hardware, count: int) -> GpuSelection:
    if hw.simulated:
        return GpuSelection((), ())
    chosen = hw.gpus[:count]
    uuids = tuple(g.uuid for g in chosen if g.uuid)
    nodes = tuple(g.render_node for g in chosen if g.render_node)
    return GpuSelection(uuids if len(uuids) == count else (), nodes if len(nodes) == count else ())


class Deployment(NamedTuple):
    plan: Plan
    name: str  # the server's name: container, unit, Kubernetes objects, native state
    model: ModelSource
    hf_cache: str  # absolute, on the host
    layout: Layout
    budgets: Budgets
    network: Network
    secrets: Secrets
    vendor: VendorFacts
    gpus: GpuSelection
    draft: Draft

    @property
    def simulated(self) -> bool:
        return self.plan.hardware.simulated

    @property
    def hardware(self) -> Hardware:
        return self.plan.hardware


def derive(plan: Plan, *, home: str | None = None, cwd: str | None = None) -> Deployment:
    """The one Deployment of `plan` (home and cwd default to this process's)."""
    runtime = plan.settings.runtime
    model = model_source(plan.settings.model.path, home, cwd)
    layout = layout_of(plan)
    return Deployment(
        plan=plan,
        name=runtime.container_name,
        model=model,
        hf_cache=host_path(runtime.hf_cache, "runtime.hf_cache", home),
        layout=layout,
        budgets=budgets_of(plan, model),
        network=Network(runtime.bind, runtime.port, CONTAINER_PORT),
        secrets=secrets_of(plan),
        vendor=vendor_facts(plan.hardware.vendor),
        gpus=gpu_selection(plan.hardware, layout.gpus_per_node),
        draft=draft_of(plan),
    )


def require_fit(deployment: Deployment) -> None:
    """Each node must have the GPUs the layout puts on it (plan, render, launch refuse otherwise;
    doctor reports it). A layout wider than one host is a choice (parallelism.nodes), never implied."""
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
        raise HostPreconditionError(
            f"the plan needs {layout.gpus_per_node} GPUs{per_node} ({plan.recipe.recipe}, profile "
            f"{plan.profile}) and {where} has {hw.count}",
            hint="use a host with more GPUs, another profile, or spread the layout over nodes "
            "with --set parallelism.nodes=N (rendered for Kubernetes)",
        )
