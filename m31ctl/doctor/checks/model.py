"""Checks of what the server reads: the checkpoint (complete, or room to download it), the
Hugging Face token, the API key, and whether the plan's sequences fit the KV cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from m31ctl.capacity.fit import capacity_warning, plan_fit
from m31ctl.capacity.host_tier import HostMemoryNeed, host_memory_need, largest_tier_gib, size_text
from m31ctl.checkpoint import cached_snapshot
from m31ctl.checks import CheckStatus
from m31ctl.deployment import Deployment
from m31ctl.doctor.base import CheckContext, Outcome
from m31ctl.doctor.checks.host import without_docker
from m31ctl.redact import SECRET_ENV

GB = 1e9
# The layers a user writes (a -f file; a --set, or the flag that stands for one): a value from
# them is the user's choice, one from the defaults, the recipe or a rule is the plan's.
USERS_LAYERS = ("file", "--set")


def snapshot(deployment: Deployment) -> Path | None:
    """The checkpoint directory: a local one, or the cached snapshot vLLM would read offline."""
    model = deployment.model
    if model.host_path is not None:
        return Path(model.host_path) if Path(model.host_path).is_dir() else None
    return cached_snapshot(deployment.hf_cache, model.reference)


def checkpoint_state(deployment: Deployment) -> tuple[str, str]:
    """("complete" | "partial" | "absent", why): every shard model.safetensors.index.json names is
    present with a plausible size, and the dspark/ draft too when the plan uses DSpark."""
    directory = snapshot(deployment)
    if directory is None:
        return "absent", "not downloaded"
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map") or {}
        except (OSError, ValueError):
            return "partial", f"{index} is unreadable"
        shards = sorted(set(weight_map.values()))
    else:
        shards = [p.name for p in directory.glob("*.safetensors")]
        if not shards:
            return "partial", f"{directory} has no weights (no model.safetensors.index.json, no .safetensors)"
    missing = [s for s in shards if not (directory / s).is_file() or (directory / s).stat().st_size < 1024]
    if missing:
        return "partial", f"{len(missing)} of {len(shards)} shards missing or empty (e.g. {missing[0]})"
    draft = deployment.draft
    if draft.used and draft.folder and not (directory / draft.folder).is_dir():
        return "partial", f"the {draft.folder} draft the plan uses is missing"
    return "complete", f"{len(shards)} shards in {directory}"


def _checkpoint(ctx: CheckContext) -> tuple[str, str]:
    """checkpoint_state once per doctor run: the checkpoint, disk and hf-token checks all ask."""
    deployment = ctx.require_deployment()
    found: tuple[str, str] = ctx.once("checkpoint", lambda: checkpoint_state(deployment))
    return found


def checkpoint(ctx: CheckContext) -> Outcome:
    state, why = _checkpoint(ctx)
    if state == "complete":
        return Outcome(CheckStatus.OK, f"checkpoint complete: {why}")
    if state == "partial":
        return Outcome(
            CheckStatus.FAIL,
            f"checkpoint incomplete: {why}",
            "finish the download (huggingface-cli download REPO) or remove the partial snapshot",
        )
    return Outcome(CheckStatus.OK, "not downloaded yet: launch downloads it (see the disk check)")


def disk(ctx: CheckContext) -> Outcome:
    deployment = ctx.require_deployment()
    plan = deployment.plan
    local = deployment.model.host_path
    if local is not None:  # a local checkpoint directory, mounted as it is
        if Path(local).is_dir():
            return Outcome(CheckStatus.OK, f"local checkpoint {local}")
        return Outcome(
            CheckStatus.FAIL,
            f"the model path {local} does not exist",
            "create it (scripts/rehearse makes the rehearsal model) or --set model.path=...",
        )
    if _checkpoint(ctx)[0] == "complete":
        return Outcome(CheckStatus.OK, f"checkpoint already in {deployment.hf_cache}")
    path = Path(deployment.hf_cache)
    probe_path = path
    while not probe_path.exists():
        probe_path = probe_path.parent
    free = shutil.disk_usage(probe_path).free
    need = plan.model.checkpoint_gb * GB
    if free < need:
        return Outcome(
            CheckStatus.FAIL,
            f"{free / GB:.0f} GB free at {probe_path}; the checkpoint needs {need / GB:.1f} GB",
            "free space, or point runtime.hf_cache at a larger disk (--set runtime.hf_cache=/data/hf)",
        )
    return Outcome(
        CheckStatus.OK, f"{free / GB:.0f} GB free at {probe_path} for the {need / GB:.1f} GB checkpoint"
    )


def hf_token(ctx: CheckContext) -> Outcome:
    deployment = ctx.require_deployment()
    if _checkpoint(ctx)[0] == "complete":
        return Outcome(CheckStatus.OK, "checkpoint cached; no token needed to start")
    token_file = Path(deployment.hf_cache) / "token"
    if any(ctx.env.get(name) for name in SECRET_ENV if name != deployment.secrets.api_key):
        return Outcome(CheckStatus.OK, "Hugging Face token present in the environment (not shown)")
    if token_file.exists():
        return Outcome(CheckStatus.OK, f"Hugging Face token present in {token_file} (not shown)")
    return Outcome(
        CheckStatus.WARN,
        "no Hugging Face token: anonymous downloads are rate limited",
        "export HF_TOKEN (m31ctl passes it by reference, never in argv)",
    )


def api_key(ctx: CheckContext) -> Outcome:
    name = ctx.require_deployment().secrets.api_key
    if name is None:
        return Outcome(CheckStatus.OK, "the server takes no API key (loopback only)")
    if ctx.env.get(name):
        return Outcome(CheckStatus.OK, f"{name} is set (not shown)")
    return Outcome(
        CheckStatus.FAIL,
        f"runtime.api_key is set but {name} is not in the environment",
        f"export {name} (m31ctl passes it by reference, never in argv)",
    )


def capacity(ctx: CheckContext) -> Outcome:
    """The plan's sequences in the GPUs' KV cache, and its host tier (cache.cpu_offload_gib) in
    this host's memory: a tier the host cannot hold fails here, before a launch loads the weights."""
    deployment = ctx.require_deployment()
    tier = host_tier_outcome(ctx, deployment)
    if tier is not None and tier.status is CheckStatus.FAIL:
        return tier
    fit = plan_fit(deployment)
    warned = tier is not None and tier.status is CheckStatus.WARN
    also = f"; {tier.message}" if warned and tier is not None else ""
    if not fit.fits:
        warning = capacity_warning(deployment) or ""
        return Outcome(CheckStatus.WARN, warning + also, "lower serving.max_model_len or add GPUs")
    basis = fit.sequences_published_basis
    published = "" if basis is None else f"; {basis} on the launch post's basis (main attention only)"
    fits = (
        f"{fit.sequences} sequences of {fit.context} tokens fit ({fit.layout}, "
        f"{fit.kv_cache_tokens:,} KV tokens per engine){published}"
    )
    admitted = deployment.plan.settings.serving.max_num_seqs
    if admitted is not None and admitted > fit.sequences:
        # What the engine does with more than fit: it admits them, then preempts or queues.
        engine = (
            f"vLLM admits up to {admitted} sequences, and past {fit.sequences} at full length it "
            "preempts or queues the rest"
        )
        source = deployment.plan.provenance.get("serving.max_num_seqs")
        if source is not None and source.layer in USERS_LAYERS:  # the user's choice: a warning
            return Outcome(
                CheckStatus.WARN,
                f"serving.max_num_seqs={admitted} ({source}) but only {fits}; {engine}{also}",
                f"lower it to what fits (--set serving.max_num_seqs={fit.sequences}), lower "
                "serving.max_model_len, or add GPUs",
            )
        # The plan's own default, which the user never set: what the engine will do, no warning.
        fits += f"; {engine} (serving.max_num_seqs={admitted}, the plan's default)"
    status, remedy = CheckStatus.OK, ""
    if tier is not None:
        status, also, remedy = tier.status, f"; {tier.message}", tier.remedy
    return Outcome(status, fits + also, remedy)


def meminfo(root: Path) -> dict[str, int]:
    """/proc/meminfo under `root` in bytes (MemTotal, MemAvailable, ...); {} where unreadable."""
    try:
        text = (root / "proc/meminfo").read_text()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        words = rest.split()
        if words and words[0].isdigit():
            found[name.strip()] = int(words[0]) * (1024 if words[1:2] == ["kB"] else 1)
    return found


def host_tier_outcome(ctx: CheckContext, deployment: Deployment) -> Outcome | None:
    """The host tier against this host: its memory (/proc/meminfo under ctx.host_root) and, where
    the tier goes to the host's own /dev/shm (CUDA, run natively or with the host's IPC), that
    /dev/shm's free space, which vLLM 0.32 checks at start (check_shm_free_space). None without a
    tier."""
    need = host_memory_need(deployment)
    if need is None:
        return None
    if without_docker(ctx):  # a process of this host: runtime.shm_size sizes nothing
        need = need._replace(shm_bytes=0)
    tier = need.tier
    said = f"{tier.spelled()} of host memory{need.beside()}"
    memory = meminfo(ctx.host_root)
    total, available = memory.get("MemTotal"), memory.get("MemAvailable")
    if total is None:
        return Outcome(
            CheckStatus.WARN, f"host tier: {said}; this host's memory is unknown (no /proc/meminfo)"
        )
    largest = largest_tier_gib(need, total)
    if need.total > total:
        return Outcome(
            CheckStatus.FAIL,
            f"host tier: {said}, this host has {size_text(total)} (MemTotal): vLLM pins the tier at start",
            f"lower cache.cpu_offload_gib to at most {largest}{need.shm_to_match()}"
            if largest
            else "lower runtime.shm_size",
        )
    shm = _host_shm_short(ctx, need)
    if shm is not None:
        return shm
    if available is not None and need.total > available:
        return Outcome(
            CheckStatus.WARN,
            f"host tier: {said}, {size_text(available)} of this host's {size_text(total)} is available now "
            "(MemAvailable): pinning the tier would push other processes out or wake the OOM killer",
            "stop what holds the host's memory, or lower cache.cpu_offload_gib",
        )
    left = f", {size_text(available)} available" if available is not None else ""
    return Outcome(CheckStatus.OK, f"host tier: {said}; this host has {size_text(total)}{left}")


def _host_shm_short(ctx: CheckContext, need: HostMemoryNeed) -> Outcome | None:
    """On CUDA with the host's /dev/shm (native, or runtime.ipc_host), too little free space there
    for the tier: vLLM refuses at start ("Insufficient space in /dev/shm for CPU KV offload")."""
    tier = need.tier
    if not tier.in_shm or need.shm_bytes:
        return None
    folder = ctx.host_root / "dev/shm"
    if not folder.is_dir():
        return None
    free = shutil.disk_usage(folder).free
    if free >= tier.bytes_per_host:
        return None
    return Outcome(
        CheckStatus.FAIL,
        f"host tier: {tier.spelled()} in the host's /dev/shm, which has {size_text(free)} free: vLLM 0.32 "
        "keeps the CUDA tier there and refuses to start with less",
        "enlarge /dev/shm (mount -o remount,size=... /dev/shm) or lower cache.cpu_offload_gib",
    )
