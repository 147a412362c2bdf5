"""The runtime reserve: what vLLM's GPU worker takes out of `memory x gpu_memory_utilization`
besides the weights before it sizes the KV cache, modelled from its parts as vLLM profiles them,
instead of one constant.

vLLM 0.26.0 vllm/v1/worker/gpu_worker.py determine_available_memory (and 0.32.0's, which
measures the same parts as "total consumed" plus the transient peak headroom):

    requested = ceil(total x gpu_memory_utilization)      v1/worker/utils.py request_memory, where
                                                           total is CUDA's (cudaMemGetInfo), not NVML's
    available = requested - weights - torch_peak_increase - non_torch_increase - cudagraph_estimate

vllm/utils/mem_utils.py memory_profiling names the parts: weights ("memory used by PyTorch when
loading the model weights"), the peak of torch allocations during profile_run (a dummy forward
pass of max_num_batched_tokens tokens, then the sampler over min(max_num_seqs, tokens) rows of
logits: gpu_model_runner.py profile_run / _dummy_sampler_run), the growth of memory outside
torch since the worker's first snapshot (cuBLAS workspaces, NCCL, attention-backend buffers),
and, when CUDA graphs are captured, the graph pool the profiler estimates
(profile_cudagraph_memory; VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS is on by default since 0.21).

m31ctl's budget is `memory x utilization - weights - reserve` with `memory` the probe's (NVML)
total, so the reserve here also holds `utilization x` what the driver keeps out of CUDA's total.
What each part is measured or estimated from is said beside it; docs/gpu-rehearsal.md compares
the result with vLLM's own figures on a real H200.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

GIB = 1024**3

# NVML's total less CUDA's on the lent H200: NVML reports 150,754,820,096 bytes and, with no
# process on the GPU, 150,109,880,320 free (tests/fixtures/gpu/device-h200x1/nvml-capture.json);
# torch.cuda.mem_get_info() gives that free figure as CUDA's total
# (tests/fixtures/gpu/h200-vllm026/torch-memory.json). Other GPUs: not measured, taken as 0.
DRIVER_HIDDEN_BYTES = {"H200": 150_754_820_096 - 150_109_880_320}

# Memory outside torch that the worker's profile finds grown since its first snapshot: cuBLAS
# and cuBLASLt workspaces, the one-rank NCCL communicator, FlashAttention's scheduler metadata.
# Independent of the model's size and of gpu_memory_utilization. 0.24 GiB: vLLM 0.26 on the
# H200 took 0.27 GiB besides the KV cache for a 0.4M-parameter model at utilization 0.1 (13.98
# GiB requested, "Available KV cache memory: 13.71 GiB"; ../shared/notes/gpu-vllm-on-device.md),
# of which about 0.03 GiB is the activation peak below.
NON_TORCH_BYTES = int(0.24 * GIB)

# The CUDA graph pool vLLM's profiler estimates before capture; the tiny model's graphs took
# "0.07 GiB" on the H200 (gpu-vllm-on-device.md; vLLM logs "Graph capturing finished in 1 secs,
# took 0.07 GiB"). It grows with the number of capture sizes and the hidden size; a constant here.
CUDA_GRAPH_BYTES = int(0.07 * GIB)

# vLLM 0.26 engine/arg_utils.py _set_default_args: the API server's max_num_batched_tokens and
# max_num_seqs when the user sets neither: 8192 and 1024 on a GPU of at least 70 GiB that is not
# an A100, 2048 and 256 otherwise.
LARGE_GPU_BYTES = 70 * GIB
DEFAULT_BATCHED_TOKENS = {True: 8192, False: 2048}
DEFAULT_MAX_SEQS = {True: 1024, False: 256}

# Flags after which vLLM neither compiles nor captures graphs.
EAGER_FLAGS = ("--enforce-eager", "-O0")
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "bf16": 2, "fp16": 2}
# Copies of the logits the sampler holds at its peak (float32 logits, the softmaxed
# probabilities, the top-k/top-p sort's values): vllm/v1/sample/ops/topk_topp_sampler.py.
SAMPLER_LOGIT_COPIES = 3


class ModelShape(NamedTuple):
    """The dimensions an activation peak depends on (a dense decoder's config.json)."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype_bytes: int


class Reserve(NamedTuple):
    """The parts, in bytes, per rank."""

    activation: int  # torch's peak increase during profile_run
    non_torch: int
    cuda_graphs: int  # 0 without graphs
    driver_hidden: int  # utilization x (NVML total - CUDA total)
    batched_tokens: int
    max_seqs: int

    @property
    def total(self) -> int:
        return self.activation + self.non_torch + self.cuda_graphs + self.driver_hidden

    @property
    def total_gib(self) -> float:
        return self.total / GIB


def model_shape(config_path: Path) -> ModelShape | None:
    """The shape from a checkpoint's config.json; None where it lacks what a dense model has."""
    try:
        data: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    data = data.get("text_config") or data
    try:
        hidden = int(data["hidden_size"])
        heads = int(data["num_attention_heads"])
        return ModelShape(
            hidden=hidden,
            intermediate=int(data.get("intermediate_size") or 4 * hidden),
            heads=heads,
            kv_heads=int(data.get("num_key_value_heads") or heads),
            head_dim=int(data.get("head_dim") or hidden // heads),
            vocab=int(data["vocab_size"]),
            dtype_bytes=_DTYPE_BYTES.get(str(data.get("torch_dtype") or data.get("dtype")), 2),
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None


def activation_bytes(shape: ModelShape, batched_tokens: int, max_seqs: int, tensor: int = 1) -> int:
    """The peak of profile_run: per token of the dummy batch, the residual and the hidden state
    plus the larger of attention's working set (q, k, v and the output) and the MLP's (gate and
    up, then the activation), sharded by TP; then the sampler's float32 logits for
    min(max_num_seqs, tokens) rows, which live after the forward pass's tensors are freed."""
    attention = (2 * shape.heads + 2 * shape.kv_heads) * shape.head_dim // tensor
    mlp = 3 * shape.intermediate // tensor
    forward = batched_tokens * shape.dtype_bytes * (2 * shape.hidden + max(attention, mlp))
    rows = min(max_seqs, batched_tokens)
    sampler = rows * shape.vocab * 4 * SAMPLER_LOGIT_COPIES
    return max(forward, sampler)


def driver_hidden_bytes(product: str | None) -> int:
    """What the driver keeps out of CUDA's total on this product (probe names: "NVIDIA H200")."""
    return next((size for name, size in DRIVER_HIDDEN_BYTES.items() if name in (product or "")), 0)


def _flag_value(args: tuple[str, ...], flag: str) -> int | None:
    for i, arg in enumerate(args):
        value = arg.split("=", 1)[1] if arg.startswith(flag + "=") else None
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        if value is not None:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def reserve(
    shape: ModelShape,
    *,
    memory_per_gpu_bytes: int,
    product: str | None,
    utilization: float,
    max_num_seqs: int | None,
    extra_args: tuple[str, ...],
    tensor: int = 1,
) -> Reserve:
    large = memory_per_gpu_bytes >= LARGE_GPU_BYTES and "A100" not in (product or "")
    tokens = _flag_value(extra_args, "--max-num-batched-tokens") or DEFAULT_BATCHED_TOKENS[large]
    seqs = max_num_seqs or DEFAULT_MAX_SEQS[large]
    graphs = not any(arg in EAGER_FLAGS for arg in extra_args)
    return Reserve(
        activation=activation_bytes(shape, tokens, seqs, tensor),
        non_torch=NON_TORCH_BYTES,
        cuda_graphs=CUDA_GRAPH_BYTES if graphs else 0,
        driver_hidden=int(utilization * driver_hidden_bytes(product)),
        batched_tokens=tokens,
        max_seqs=seqs,
    )


def plan_reserve(config_path: Path, deployment: Any) -> Reserve | None:
    """The modelled reserve for a plan whose checkpoint's config.json is on this host; None where
    the config does not give a dense model's shape (the recipe's constant then stands)."""
    shape = model_shape(config_path)
    if shape is None:
        return None
    plan = deployment.plan
    settings = plan.settings
    return reserve(
        shape,
        memory_per_gpu_bytes=plan.hardware.memory_per_gpu_bytes,
        product=plan.hardware.product,
        utilization=settings.serving.gpu_memory_utilization,
        max_num_seqs=settings.serving.max_num_seqs,
        extra_args=tuple(settings.engine.extra_args),
        tensor=settings.parallelism.tensor,
    )
