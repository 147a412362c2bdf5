"""Runtime shapes: the limits vLLM meets only under load, and the MoE layout it really builds.

A plan that starts can still die at its first large batch: these rules read the shapes the
engine will run (decode rows per kernel launch, the ranks each MoE layer spans, where its
collectives go) and settle them before launch: a limit the plan leaves open is set (with the
rule as its source), a value past it is refused, and what vLLM does without being asked
(flattening the MoE over DP x TP, TCP for a collective that has no RDMA) is stated. Each rule
names the vLLM source it reads (vLLM 0.32/0.33, the NVIDIA MiniMax-M3 path; vllm-engine-facts.md
"Limits that only show under load").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from m31ctl.errors import RuleViolation
from m31ctl.hardware import Hardware, Platform, vendor_facts
from m31ctl.plan.catalog import ModelFacts
from m31ctl.plan.layers import Layer, Setting, Source
from m31ctl.plan.settings import Parallelism, PlanSettings

# models/minimax_m3/nvidia/msa_cutlass_sparse_decode.py: "fmha_sm100 plans one row per query
# head. Keep every cached plan within the fixed planner allocation"; should_prepare_decode_metadata
# takes the CUTLASS path only while decode requests x query length x query heads <= this, and
# nvidia/sparse_attention_msa.py raises "MiniMax M3 NVFP4 KV cache has no Triton decode fallback".
MAX_QUERY_HEAD_ROWS = 65536
DECODE_ROWS_SOURCE = (
    "vLLM 0.32/0.33 vllm/models/minimax_m3/nvidia/msa_cutlass_sparse_decode.py _MAX_QUERY_HEAD_ROWS "
    "= 65536 (should_prepare_decode_metadata: decode requests x (1 + speculative tokens) x query heads "
    'per rank); nvidia/sparse_attention_msa.py ("NVFP4 KV cache has no Triton decode fallback")'
)
MOE_SOURCE = "vLLM 0.32/0.33 vllm/model_executor/layers/fused_moe/config.py FusedMoEParallelConfig.make"
EXPERT_DECISION = (
    "data parallelism on a MoE model: expert parallelism (whole experts per rank, all-to-all "
    f"dispatch) rather than vLLM's default, every expert sliced over DP x TP [{MOE_SOURCE}; vLLM docs "
    "serving/expert_parallel_deployment]"
)


class RuntimeRule(NamedTuple):
    id: str
    key: str
    summary: str
    source: str


RUNTIME_RULES: tuple[RuntimeRule, ...] = (
    RuntimeRule(
        "vllm-nvfp4-decode-rows",
        "serving.max_num_seqs",
        "NVIDIA, NVFP4 KV cache, MiniMax-M3: max_num_seqs x (1 + speculative tokens) x query heads per "
        "rank <= 65536; set to the limit when unset (vLLM's default is 1024), refused above it",
        DECODE_ROWS_SOURCE,
    ),
    RuntimeRule(
        "m31-expert-parallel-decided",
        "parallelism.expert",
        "a MoE plan with data parallelism that leaves parallelism.expert unset gets expert "
        "parallelism; the plan states the MoE layout vLLM builds (EP or TP over DP x TP ranks)",
        MOE_SOURCE,
    ),
    RuntimeRule(
        "m31-moe-group-split",
        "parallelism.nodes",
        "warning: a MoE group that fits one node is spread over several, its collectives on the network",
        MOE_SOURCE,
    ),
    RuntimeRule(
        "m31-cross-node-moe-rdma",
        "fabric.rdma",
        "warning: MoE collectives across nodes on GPUs with fabric.rdma unset fall back to TCP sockets in NCCL",
        "NCCL: without an IB/RoCE device the NET/Socket transport is used (NCCL_DEBUG=INFO); "
        "vLLM docs serving/expert_parallel_deployment (multi-node EP needs RDMA)",
    ),
)


class MoELayout(NamedTuple):
    """The MoE layer as vLLM builds it for a layout: one group of DP x TP ranks per pipeline
    stage, expert-parallel or tensor-parallel over every expert. FusedMoEParallelConfig.make
    flattens the MoE's tensor parallelism over DP x TP: with expert parallelism the group is
    EP{ranks} x TP1 (whole experts, 1/ranks of them per GPU), without it EP1 x TP{ranks} (a
    1/ranks slice of every expert per GPU)."""

    ranks: int
    expert: bool
    nodes: int  # the nodes one group spans
    fits_one_node: bool  # the whole group would fit one node of the host
    pipeline: int = 1  # stages, each with a group of its own over its layers

    @property
    def expert_parallel(self) -> bool:
        """vLLM's use_ep: expert parallelism asked for, over more than one rank."""
        return self.expert and self.ranks > 1

    @property
    def expert_size(self) -> int:
        """The expert-parallel group (vLLM's ep_size): the ranks the experts are divided over."""
        return self.ranks if self.expert_parallel else 1

    @property
    def tensor_size(self) -> int:
        """The MoE's tensor-parallel group (vLLM's tp_size after flattening): the ranks each
        expert is sliced over."""
        return 1 if self.expert_parallel else self.ranks

    def experts_per_gpu(self) -> str:
        if self.ranks == 1:
            return "every expert, whole"
        if self.expert_parallel:
            return f"1/{self.ranks} of the experts, whole"
        return f"every expert, a 1/{self.ranks} slice of each"

    def how(self) -> str:
        """The layout in words."""
        if self.ranks == 1:
            return "one rank holds every expert"
        how = (
            f"expert parallelism over {self.ranks} ranks (EP{self.ranks}: 1/{self.ranks} of the experts, whole, per GPU)"
            if self.expert_parallel
            else f"every expert's tensor parallelism flattened over DP x TP = {self.ranks} ranks "
            f"(TP{self.ranks}: 1/{self.ranks} of each expert per GPU; no --enable-expert-parallel)"
        )
        where = f", across {self.nodes} nodes" if self.nodes > 1 else ""
        stages = f", one group in each of {self.pipeline} pipeline stages" if self.pipeline > 1 else ""
        return f"{how}{where}{stages}"

    def describe(self) -> str:
        """The layout in words, with its source."""
        return f"{self.how()} [{MOE_SOURCE}]"


def moe_layout(par: Parallelism, hw: Hardware) -> MoELayout:
    ranks = par.tensor * par.data
    per_node = max(1, par.gpus // par.nodes)
    # Pipeline stages span nodes one per node: a stage's MoE group stays within its node.
    nodes = 1 if par.pipeline > 1 else max(1, -(-ranks // per_node))
    return MoELayout(ranks, par.expert, nodes, ranks <= hw.count, par.pipeline)


class DecodeRowLimit(NamedTuple):
    max_num_seqs: int
    heads_per_rank: int
    query_len: int

    def why(self) -> str:
        return (
            f"the CUTLASS sparse decode for an NVFP4 KV cache plans decode requests x {self.query_len} "
            f"query tokens (1 + speculative) x {self.heads_per_rank} query heads per rank, at most "
            f"{MAX_QUERY_HEAD_ROWS} rows: at most {self.max_num_seqs} decoding requests per engine, "
            "with no fallback past it (the engine dies under load, not at start-up)"
        )


def decode_row_limit(
    settings: PlanSettings, hw: Hardware, attention_heads: int | None
) -> DecodeRowLimit | None:
    """The NVIDIA MiniMax-M3 NVFP4 decode's request limit for the layout, or None where the
    plan does not run that kernel (another cache dtype, ROCm, the CPU build, another model)."""
    if (
        attention_heads is None
        or settings.cache.kv_dtype != "nvfp4"
        or vendor_facts(hw.vendor).platform is not Platform.CUDA
    ):
        return None
    heads = max(1, attention_heads // settings.parallelism.tensor)
    query_len = 1 + (settings.speculative.tokens or 0)
    return DecodeRowLimit(MAX_QUERY_HEAD_ROWS // (heads * query_len), heads, query_len)


# The engines a plan runs, each as (who, its settings): ("", the plan's) for one server; in a
# prefill/decode plan each role's (plan/disaggregation.py engine_settings), which inherit the
# plan's parallelism.expert and serving.max_num_seqs: the rules run on each role's own layout
# and settle the one value every role can run.
Engines = Sequence[tuple[str, PlanSettings]]


def _culprit(merged: Layer, key: str) -> str:
    setting = merged.get(key)
    return str(setting.source) if setting else "schema default"


def _whose(who: str) -> str:
    return f"the {who} role's " if who else ""


def decide_expert(
    settings: PlanSettings, merged: Layer, model: ModelFacts, engines: Engines = ()
) -> tuple[PlanSettings, Layer]:
    """Expert parallelism decided explicitly: a MoE plan with data parallelism (in any of its
    engines) that does not say gets it (the plan shows the rule as the value's source); one that
    says keeps its choice."""
    par = settings.parallelism
    if "parallelism.expert" in merged or model.expert_weights == "none":
        return settings, merged
    deciding = [
        (who, e.parallelism.data) for who, e in engines or (("", settings),) if e.parallelism.data >= 2
    ]
    if not deciding:
        return settings, merged
    roles = "; ".join(f"{_whose(who)}DP{data}" for who, data in deciding if who)
    detail = f"runtime shape: {EXPERT_DECISION}" + (
        f" (decided by {roles}; both roles run it)" if roles else ""
    )
    source = Source("engine rule", detail=detail)
    decided = settings.model_copy(update={"parallelism": par.model_copy(update={"expert": True})})
    return decided, {**merged, "parallelism.expert": Setting(True, source)}


def decode_limits(
    engines: Engines, hw: Hardware, attention_heads: int | None
) -> list[tuple[str, DecodeRowLimit]]:
    """Each engine's decode row limit, where it runs that kernel."""
    found = [(who, decode_row_limit(e, hw, attention_heads)) for who, e in engines]
    return [(who, limit) for who, limit in found if limit is not None]


def apply_decode_limit(
    settings: PlanSettings, merged: Layer, hw: Hardware, attention_heads: int | None, engines: Engines = ()
) -> tuple[PlanSettings, Layer]:
    """serving.max_num_seqs within the decode row limit of every engine of the plan: set to the
    smallest when the plan leaves it to vLLM (whose default on these GPUs is 1024,
    vllm/engine/arg_utils.py), refused above any (a refusal names the role it breaks)."""
    limits = decode_limits(engines or (("", settings),), hw, attention_heads)
    if not limits:
        return settings, merged
    wanted = settings.serving.max_num_seqs
    for who, limit in limits:
        if wanted is not None and wanted > limit.max_num_seqs:
            raise RuleViolation(
                f"{f'disaggregation.{who}: ' if who else ''}serving.max_num_seqs={wanted} breaks runtime "
                f"rule 'vllm-nvfp4-decode-rows': {_whose(who)}{limit.why()} [{DECODE_ROWS_SOURCE}]",
                where=_culprit(merged, "serving.max_num_seqs"),
                hint=f"set serving.max_num_seqs to {limit.max_num_seqs} or less, or fewer speculative tokens",
            )
    if wanted is not None:
        return settings, merged
    who, limit = min(limits, key=lambda found: found[1].max_num_seqs)
    role = f" for {_whose(who)}layout (both roles run it)" if who else ""
    source = Source(
        "engine rule",
        detail=f"runtime rule vllm-nvfp4-decode-rows{role}: at most {limit.max_num_seqs} decoding requests "
        f"({limit.heads_per_rank} query heads per rank x {limit.query_len} query tokens x requests "
        f"<= {MAX_QUERY_HEAD_ROWS})",
    )
    serving = settings.serving.model_copy(update={"max_num_seqs": limit.max_num_seqs})
    capped = settings.model_copy(update={"serving": serving})
    return capped, {**merged, "serving.max_num_seqs": Setting(limit.max_num_seqs, source)}


def shape_warnings(
    settings: PlanSettings, hw: Hardware, model: ModelFacts, engines: Engines = ()
) -> tuple[str, ...]:
    """For each engine: a MoE group split over the network though it fits a node, and MoE
    collectives across nodes with no RDMA resource (NCCL then uses TCP sockets, silently). The
    layout itself is stated in the plan (Plan.moe_layout), not warned."""
    if model.expert_weights == "none":
        return ()
    notes: list[str] = []
    for who, engine in engines or (("", settings),):
        notes += [f"{who}: {note}" if who else note for note in _engine_shape_warnings(engine, hw)]
    return tuple(notes)


def _engine_shape_warnings(settings: PlanSettings, hw: Hardware) -> list[str]:
    par = settings.parallelism
    moe = moe_layout(par, hw)
    notes: list[str] = []
    if par.nodes > 1 and par.pipeline == 1 and moe.fits_one_node:
        notes.append(
            f"the layout's {moe.ranks}-rank MoE group fits one node of {hw.count} GPUs, yet "
            f"parallelism.nodes={par.nodes} puts {moe.ranks // par.nodes} ranks on each node: every MoE "
            "layer's collective crosses the network; use parallelism.nodes=1 (or more data-parallel "
            "ranks per node)"
        )
    # The CPU build has no NCCL and refuses fabric.rdma (plan/rdma.py): nothing to advise there.
    gpus = vendor_facts(hw.vendor).platform is not Platform.CPU
    if moe.nodes > 1 and settings.fabric.rdma is None and gpus:
        notes.append(
            f"the MoE collectives span {moe.nodes} nodes and fabric.rdma is unset: NCCL then runs every "
            "MoE layer's all-to-all, at every step, over TCP sockets without a warning "
            "(NCCL_DEBUG=INFO shows 'NET/Socket'); set fabric.rdma (the pods' RDMA device resource, e.g. "
            "fabric.rdma.resource=rdma/ib, and NCCL_IB_HCA from the HCA ports in fabric.rdma.devices)"
        )
    return notes
