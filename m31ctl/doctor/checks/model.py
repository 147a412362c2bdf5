"""Checks of what the server reads: the checkpoint (complete, or room to download it), the
Hugging Face token, the API key, and whether the plan's sequences fit the KV cache."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from m31ctl.capacity.fit import capacity_warning, plan_fit
from m31ctl.checkpoint import cached_snapshot
from m31ctl.checks import CheckStatus
from m31ctl.deployment import Deployment
from m31ctl.doctor.base import CheckContext, Outcome
from m31ctl.redact import SECRET_ENV

GB = 1e9


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
    deployment = ctx.require_deployment()

    warning = capacity_warning(deployment)
    if warning:
        return Outcome(CheckStatus.WARN, warning, "lower serving.max_model_len / max_num_seqs or add GPUs")
    fit = plan_fit(deployment)
    basis = fit.sequences_published_basis
    published = "" if basis is None else f"; {basis} on the launch post's basis (main attention only)"
    return Outcome(
        CheckStatus.OK,
        f"{fit.sequences} sequences of {fit.context} tokens fit ({fit.layout}, "
        f"{fit.kv_cache_tokens:,} KV tokens per engine){published}",
    )
