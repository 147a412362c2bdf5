"""Memory model: how many sequences of a given context stay resident.

Per GPU:  budget = memory x gpu_memory_utilization - weights held by that GPU - runtime reserve.
Weights:  tensor parallelism shards everything across its ranks; with data plus expert
          parallelism each rank holds all dense (non-expert) weights and 1/N of the experts.
KV:       bytes per token by cache dtype (attention and indexer caches together). Under tensor
          parallelism a sequence's KV is spread over the group, so the group's budgets add up;
          under data parallelism a sequence lives on one rank, so each rank fits whole sequences.
docs/capacity.md derives every input; the published 28 / 76 figures fall out of it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from m31ctl.errors import InputError
from m31ctl.plan.recipes import ModelFacts

GIB = 1024**3

# Bits per weight including block scales. NVFP4: 4 bits + an FP8 scale per 16 values = 4.5
# (the launch post); MXFP8: 8 bits + an E8M0 scale per 32 values = 8.25 (OCP MX spec).
BITS_PER_WEIGHT = {"nvfp4": 4.5, "mxfp8": 8.25, "fp8": 8.0, "bf16": 16.0}


def dense_weight_bytes(model: ModelFacts, reference: ModelFacts | None = None) -> float:
    """Bytes of non-expert weights.

    Solved from the checkpoint size and parameter count when experts and dense weights use
    different formats (M3.1: NVFP4 experts, MXFP8 the rest). A model stored in one format
    (M3-MXFP8) cannot be split that way; its dense part is the reference model's, since the
    architecture is the same and both keep dense weights in MXFP8.
    """
    if model.expert_weights == "none":  # a dense model
        return model.checkpoint_gb * 1e9
    be = BITS_PER_WEIGHT[model.expert_weights] / 8
    bd = BITS_PER_WEIGHT[model.dense_weights] / 8
    if be != bd:
        dense_params = (model.checkpoint_gb * 1e9 - be * model.params_total_b * 1e9) / (bd - be)
        return dense_params * bd
    if reference is None or reference.dense_weights != model.dense_weights:
        raise InputError(f"cannot split {model.display_name}'s weights into dense and expert parts")
    return dense_weight_bytes(reference)


@dataclass(frozen=True)
class Layout:
    tensor: int = 1
    data: int = 1
    expert: bool = False

    @property
    def gpus(self) -> int:
        return self.tensor * self.data

    def label(self) -> str:
        if self.data > 1 and self.expert:
            return f"DEP{self.data}" if self.tensor == 1 else f"TP{self.tensor}xDEP{self.data}"
        if self.data > 1:
            return f"TP{self.tensor}xDP{self.data}"
        return f"TP{self.tensor}"


@dataclass(frozen=True)
class MemoryInputs:
    memory_per_gpu_bytes: int
    gpu_memory_utilization: float
    runtime_reserve_gib: float
    checkpoint_bytes: float
    dense_bytes: float
    kv_bytes_per_token: int


@dataclass(frozen=True)
class Fit:
    layout: str
    context: int
    weights_per_gpu_bytes: float
    kv_budget_per_gpu_bytes: float
    kv_bytes_per_sequence: int
    sequences: int  # resident sequences at this context; 0 when not even one fits

    @property
    def fits(self) -> bool:
        return self.sequences > 0


def weights_per_gpu(inputs: MemoryInputs, layout: Layout) -> float:
    experts = inputs.checkpoint_bytes - inputs.dense_bytes
    if layout.expert and layout.data > 1:
        return (inputs.dense_bytes + experts / layout.data) / layout.tensor
    return inputs.checkpoint_bytes / layout.tensor


def kv_budget_per_gpu(inputs: MemoryInputs, layout: Layout) -> float:
    usable = inputs.memory_per_gpu_bytes * inputs.gpu_memory_utilization
    return usable - weights_per_gpu(inputs, layout) - inputs.runtime_reserve_gib * GIB


def resident_sequences(inputs: MemoryInputs, layout: Layout, context: int) -> Fit:
    if context < 1:
        raise InputError("context length must be at least 1 token")
    per_gpu = kv_budget_per_gpu(inputs, layout)
    per_seq = context * inputs.kv_bytes_per_token
    # One tensor-parallel group shares each sequence; data-parallel ranks hold whole sequences.
    group_budget = max(per_gpu, 0.0) * layout.tensor
    sequences = math.floor(group_budget / per_seq) * layout.data
    return Fit(layout.label(), context, weights_per_gpu(inputs, layout), per_gpu, per_seq, sequences)


def longest_context(inputs: MemoryInputs, layout: Layout, sequences: int) -> int:
    """The longest context at which `sequences` sequences stay resident (0 if none)."""
    if sequences < 1:
        raise InputError("the number of sequences must be at least 1")
    per_rank = math.ceil(sequences / layout.data)
    group_budget = max(kv_budget_per_gpu(inputs, layout), 0.0) * layout.tensor
    return int(group_budget // (per_rank * inputs.kv_bytes_per_token))


def parse_context(text: str) -> int:
    """'256k' -> 262144, '1m' -> 1048576, '8192' -> 8192 (binary units: 256K means 262,144)."""
    raw = text.strip().lower()
    scale = {"k": 1024, "m": 1024**2}.get(raw[-1:], 1)
    number = raw[:-1] if scale > 1 else raw
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise InputError(
            f"bad context length {text!r}", hint="use a token count such as 262144, 256k or 1m"
        ) from None
    if value < 1:
        raise InputError(f"bad context length {text!r}", hint="it must be at least one token")
    return value
