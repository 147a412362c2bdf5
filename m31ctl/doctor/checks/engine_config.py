"""doctor --deep's engine-config: the engine's own dry run. vLLM builds its configuration from the
plan's exact argv (m31ctl/engine/config_check.py, EngineArgs.create_engine_config()) with the
engine's Python, through the same runtime seam as the other deep checks, offline: what vLLM
refuses there it would refuse minutes into a launch, after the download. m31ctl's plan-time
mirrors of vLLM's rules (m31ctl/plan/engine_rules.py) are a fast approximation; this is the
engine's word, quoted as it said it."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from m31ctl.capacity.indexer_cost import indexer_cost
from m31ctl.checks import CheckStatus
from m31ctl.deployment import Deployment
from m31ctl.doctor.base import CheckContext, Outcome, SkipCheck
from m31ctl.doctor.checks.model import snapshot
from m31ctl.doctor.engine_probe import run_engine_script
from m31ctl.engine.adapter import EngineInvocation, build_invocation
from m31ctl.engine.dry_run import CONFIG_CHECK_SCRIPT, EngineConfigCheck
from m31ctl.engine.validate import schema_from_data, validate
from m31ctl.plan.engine_capabilities import lacking_in_version
from m31ctl.runtime.protocol import ScriptRun

# Importing vLLM and building its configuration: 15-40 s natively on two busy cores, up to about
# 160 s in the rehearsal image beside the collective probe there.
ENGINE_CONFIG_TIMEOUT_S = 300.0
# Only the checkpoint's config.json is read; nothing may be downloaded by a check.
OFFLINE = {"HF_HUB_OFFLINE": "1"}

# vLLM's refusal -> the setting that most likely fixes it, most specific first (a decode-context
# refusal also names --tensor-parallel-size). Matched on the words with - and _ read as spaces.
_FIXES: tuple[tuple[str, str], ...] = (
    (
        "vllm cpu omp threads bind",
        "set runtime.env.VLLM_CPU_OMP_THREADS_BIND (one core list per rank, e.g. 0|1)",
    ),
    ("decode context parallel", "change parallelism.decode_context (or parallelism.tensor)"),
    ("pipeline parallel", "change parallelism.pipeline"),
    ("data parallel", "change parallelism.data"),
    ("tensor parallel", "change parallelism.tensor"),
    ("max model len", "lower serving.max_model_len"),
    ("max position embeddings", "lower serving.max_model_len"),
    ("kv cache dtype", "change cache.kv_dtype"),
    ("block size", "change cache.block_size"),
    ("speculative", "change speculative.method / speculative.tokens"),
    ("gpu memory utilization", "change serving.gpu_memory_utilization"),
    ("max num seqs", "change serving.max_num_seqs"),
    ("quantization", "use a checkpoint and image whose quantization this vLLM supports"),
    ("attention backend", "change attention_backend (or the speculative draft's)"),
)


def _words(text: str) -> str:
    """vLLM spells a setting as a flag (--max-num-seqs) or a field (max_num_seqs): one form."""
    return re.sub(r"[-_`]+", " ", text.lower())


def likely_fix(refusal: str, extra_args: tuple[str, ...] = ()) -> str:
    """The setting to change: a flag the refusal names that the plan passes through
    engine.extra_args (no setting of m31ctl's sets it), else the setting the words point to."""
    words = _words(refusal)
    flags = [a.split("=", 1)[0] for a in extra_args if a.startswith("--")]
    passed = [flag for flag in flags if _words(flag).strip() in words]
    if passed:
        return f"engine.extra_args passes {passed[0]}: change or drop it"
    fix = next((f for pattern, f in _FIXES if pattern in words), "change the setting vLLM names")
    return f"{fix}; `m31ctl plan --explain` shows which layer set it"


def config_source(deployment: Deployment) -> Path:
    """The checkpoint's config.json, which vLLM reads to build its configuration. A hub model
    that is not in the plan's cache cannot be asked offline: the check skips."""
    model = deployment.model
    directory = snapshot(deployment)
    if directory is None or not (directory / "config.json").is_file():
        where = model.reference if model.local else f"{model.reference} in {deployment.hf_cache}"
        raise SkipCheck(
            f"no config.json for {where}: vLLM builds its configuration from it, and doctor never downloads",
            "m31ctl pull (or launch) first, then run doctor --deep again",
        )
    return directory / "config.json"


def _answer_data(run: ScriptRun) -> dict[str, Any] | None:
    """config_check.py prints one JSON object (vLLM's own logging goes to stderr)."""
    for line in reversed(run.stdout.splitlines()):
        if line.startswith("{"):
            try:
                data = json.loads(line)
            except ValueError:
                return None
            return data if isinstance(data, dict) else None
    return None


def read_answer(run: ScriptRun) -> EngineConfigCheck | None:
    data = _answer_data(run)
    return EngineConfigCheck.from_json(data) if data is not None else None


def engine_schema(run: ScriptRun) -> dict[str, Any] | None:
    """The schema the engine's own vLLM extracted beside its answer (config_check.py), or None where it could not (an engine older than extract_schema.py knows)."""
    data = _answer_data(run)
    schema = data.get("schema") if data is not None else None
    if isinstance(schema, dict) and isinstance(schema.get("flags"), list):
        return schema
    return None


def lacking(invocation: EngineInvocation, schema: Mapping[str, Any], where: str) -> list[str]:
    """What the plan's argv and environment use that this engine's own vLLM does not accept, in
    m31ctl's validator's words (unknown flags with the closest name, values, JSON keys, removed
    environment variables): an engine older than the schema m31ctl ships (vLLM 0.26 against
    0.32's) is checked against what it has, not what m31ctl expects."""

    engine = schema_from_data(dict(schema), f"the engine's Python ({where})")
    return [finding.line() for finding in validate(invocation, engine)]


def _resolved(values: Mapping[str, Any]) -> str:
    shown = (
        ("tensor_parallel_size", "TP"),
        ("decode_context_parallel_size", "DCP"),
        ("max_model_len", "max_model_len"),
        ("dtype", "dtype"),
        ("kv_cache_dtype", "KV cache"),
        ("block_size", "block size"),
        ("attention_backend", "attention"),
    )
    return ", ".join(f"{label} {values[key]}" for key, label in shown if values.get(key) is not None)


def judge_engine_config(
    run: ScriptRun,
    bound_s: float,
    extra_args: tuple[str, ...] = (),
    invocation: EngineInvocation | None = None,
) -> Outcome:
    """vLLM's answer: its configuration's key values, or its refusal verbatim with a likely fix.
    With the plan's `invocation`, what the plan sets that the engine's own schema lacks fails the
    check first, each named (vLLM's parser would refuse an unknown flag with less to go on)."""
    schema = engine_schema(run) if invocation is not None else None
    if invocation is not None and schema is not None:
        missing = lacking(invocation, schema, run.where)
        if missing:
            shown = "; ".join(missing[:4]) + (f" (+{len(missing) - 4} more)" if len(missing) > 4 else "")
            return Outcome(
                CheckStatus.FAIL,
                f"vLLM {schema.get('version')} {run.where} lacks what the plan sets: {shown}",
                "drop or change those settings for this engine, or use a vLLM that has them",
            )
    if run.timed_out:
        return Outcome(
            CheckStatus.FAIL,
            f"vLLM did not finish building its configuration {run.where} within {bound_s:.0f} s",
            "run config_check.py by hand with the engine's Python (see m31ctl/engine/dry_run.py)",
        )
    answer = read_answer(run)
    if answer is None:
        tail = run.stderr.strip().splitlines()[-1:] or ["no output"]
        return Outcome(
            CheckStatus.FAIL,
            f"the engine's configuration check gave no answer {run.where} (exit {run.exit_code}): {tail[0][:300]}",
            "run `m31ctl doctor --deep --json`; the engine-image check says whether vLLM imports",
        )
    version = f"vLLM {answer.vllm}" if answer.vllm else "vLLM"
    if answer.stage == "import":
        return Outcome(
            CheckStatus.FAIL,
            f"vLLM does not import {run.where}: {answer.refusal}",
            "install vLLM there (runtime.native_python), or use the engine image",
        )
    if not answer.ok:
        refusal = answer.refusal or answer.message or answer.error or "no reason given"
        return Outcome(
            CheckStatus.FAIL,
            f"{version} refuses the plan's configuration {run.where}: {refusal}",
            likely_fix(refusal, extra_args),
        )
    checked = " (argv and environment match its own schema)" if schema is not None else ""
    return Outcome(
        CheckStatus.OK,
        f"{version} ({answer.platform}) builds the plan's configuration {run.where}{checked}: "
        f"{_resolved(answer.resolved)}",
    )


def engine_config(ctx: CheckContext) -> Outcome:
    deployment = ctx.require_deployment()
    config_source(deployment)
    invocation = build_invocation(deployment)
    argv = ["--", *invocation.args]
    run = run_engine_script(ctx, CONFIG_CHECK_SCRIPT, argv, ENGINE_CONFIG_TIMEOUT_S, OFFLINE)
    outcome = judge_engine_config(
        run, ENGINE_CONFIG_TIMEOUT_S, deployment.plan.settings.engine.extra_args, invocation
    )
    return judge_capabilities(outcome, read_answer(run), deployment, run.where)


def judge_capabilities(
    outcome: Outcome, answer: EngineConfigCheck | None, deployment: Deployment, where: str
) -> Outcome:
    """vLLM builds some configurations it cannot run: MiniMax-M3's model code refuses an FP8
    index cache off SM10x before vLLM 0.32 only at model init, after the download. The version
    the engine's Python imported, against the capability table: what it lacks fails the check,
    named with its source and fallback."""
    if outcome.status is not CheckStatus.OK or answer is None or not answer.vllm or not answer.platform:
        return outcome
    plan = deployment.plan
    lacks = lacking_in_version(plan.settings, plan.hardware, answer.vllm, answer.platform)
    if not lacks:
        return outcome
    # The index cache's fallback has a price in KV tokens: said here, where capacity is known.
    cost = (
        indexer_cost(plan.settings, plan.model, "bf16") if plan.settings.cache.indexer_dtype == "fp8" else ""
    )
    return Outcome(
        CheckStatus.FAIL,
        f"vLLM {answer.vllm} {where} builds the plan's configuration but its model code lacks: "
        + "; ".join(lacks)
        + (f" (a bf16 index cache: {cost})" if cost else ""),
        "use the fallback named, or a vLLM that has it (recipes/engines/capabilities.yaml)",
    )
