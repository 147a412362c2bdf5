"""What `plan`, `probe` and `capacity` print: JSON payloads and human tables."""

from __future__ import annotations

import json
import shlex
import sys
from typing import TYPE_CHECKING, Any

from m31ctl.cli.output import console, emit_json
from m31ctl.engine.adapter import build_invocation
from m31ctl.hardware import Hardware
from m31ctl.plan.recipes import match_recipe

if TYPE_CHECKING:
    from m31ctl.capacity.model import Band, Fit, Sensitivity
    from m31ctl.deployment import Deployment
    from m31ctl.doctor import DoctorReport
    from m31ctl.engine.validate import PlanValidation
    from m31ctl.probe import ProbeReport
    from m31ctl.runtime.smoke import SmokeReport

GB = 1e9


def hardware_json(hw: Hardware) -> dict[str, Any]:
    data = hw.model_dump(mode="json")
    data["memory_per_gpu_gib"] = round(hw.memory_per_gpu_gib, 1)
    return data


def _band_json(band: Band) -> dict[str, Any]:
    return {"low": band.low, "high": band.high, "below": band.below, "above": band.above}


def _sensitivity_json(sensitivity: Sensitivity | None) -> dict[str, Any] | None:
    if sensitivity is None:
        return None
    return {
        "gpu_memory_utilization": _band_json(sensitivity.utilization),
        "runtime_reserve_gib": _band_json(sensitivity.reserve_gib),
    }


def fit_json(fit: Fit) -> dict[str, Any]:
    per_token = fit.kv_bytes_per_token
    return {
        "layout": fit.layout,
        "context": fit.context,
        "sequences": fit.sequences,
        "sequences_published_basis": fit.sequences_published_basis,
        "kv_cache_tokens": fit.kv_cache_tokens,
        "kv_blocks_per_gpu": fit.kv_blocks,
        "kv_bytes_per_token": {
            "per_gpu": True,
            "main_attention": round(per_token.main_attention, 2),
            "indexer": round(per_token.indexer, 2),
            "total": round(per_token.total, 2),
        },
        "weights_per_gpu_gb": round(fit.weights_per_gpu_bytes / GB, 2),
        "kv_budget_per_gpu_gb": round(fit.kv_budget_per_gpu_bytes / GB, 2),
        "kv_per_sequence_gb": round(fit.kv_bytes_per_sequence / GB, 3),
        "sensitivity": _sensitivity_json(fit.sensitivity),
        "sensitivity_published_basis": _sensitivity_json(fit.sensitivity_published_basis),
    }


def capacity_line(fit: Fit) -> str:
    """One line: what the engine holds, and the launch post's figure beside it."""
    if not fit.fits:
        line = f"does not fit: not one {fit.context}-token sequence fits ({fit.layout})"
    else:
        line = (
            f"{fit.sequences} sequences of {fit.context} tokens stay resident ({fit.layout}; "
            f"{fit.kv_cache_tokens:,} KV tokens per engine)"
        )
    if fit.sequences_published_basis is not None:
        line += f"; {fit.sequences_published_basis} on the launch post's basis (main attention only)"
    return line


def sensitivity_line(fit: Fit, published: bool = False) -> str | None:
    """'68 holds for gpu_memory_utilization 0.905-0.940 (lower: 64, higher: 72) and a runtime
    reserve of ...': the band of each input (the other fixed) that keeps the answer."""
    s = fit.sensitivity_published_basis if published else fit.sensitivity
    answer = fit.sequences_published_basis if published else fit.sequences
    if s is None:
        return None

    def edges(band: Band, lower: str, higher: str) -> str:
        parts = [f"{lower}: {band.below}" if band.below is not None else None]
        parts.append(f"{higher}: {band.above}" if band.above is not None else None)
        shown = [p for p in parts if p]
        return f" ({', '.join(shown)})" if shown else ""

    u, r = s.utilization, s.reserve_gib
    label = f"{answer} (launch post's basis)" if published else str(answer)
    return (
        f"{label} holds for gpu_memory_utilization {u.low:.3f}-{u.high:.3f}"
        f"{edges(u, 'lower', 'higher')} and a runtime reserve of {r.low:.1f}-{r.high:.1f} GiB"
        f"{edges(r, 'less', 'more')}"
    )


def plan_json(deployment: Deployment, fit: Fit | None) -> dict[str, Any]:
    """The stable `plan --json` object (documented in the README)."""
    plan = deployment.plan
    inv = build_invocation(deployment)
    return {
        "plan_hash": plan.hash,
        "recipe": plan.recipe.recipe,
        "recipe_status": plan.recipe.status,
        "recipe_file": plan.recipe.path,
        "variant": plan.variant,
        "profile": plan.profile,
        "gpus_needed": plan.gpus_needed,
        "nodes": deployment.layout.nodes,
        "hardware": hardware_json(plan.hardware),
        "image": inv.image,
        "argv": list(inv.args),
        "env": inv.env_dict,
        "engine_notes": list(inv.effects),
        "requirements": plan.recipe.recommended.model_dump(mode="json", exclude_none=True),
        "settings": plan.settings_dict(),
        "provenance": {key: source for key, _value, source in plan.explain()},
        "capacity": fit_json(fit) if fit else None,
        "warnings": list(plan.warnings),
    }


def _gpus_used(deployment: Deployment) -> str:
    layout = deployment.layout
    if layout.spans_nodes:
        return f"{layout.gpus_per_node} on each of {layout.nodes} nodes ({layout.gpus} GPUs)"
    return str(layout.gpus_per_node)


def print_plan(deployment: Deployment, fit: Fit | None, explain: bool) -> None:
    from rich.text import Text

    from m31ctl.cli.output import table

    plan = deployment.plan
    out = console()
    hw = plan.hardware
    out.print(
        Text(
            f"Plan {plan.hash}: recipe {plan.recipe.recipe} ({plan.recipe.status}), variant {plan.variant}, "
            f"profile {plan.profile}",
            style="bold",
        )
    )
    out.print(
        Text(
            f"Hardware: {hw.count}x {hw.product}, {hw.memory_per_gpu_gib:.0f} GiB each, from {hw.source}; "
            f"the plan uses {_gpus_used(deployment)}"
        )
    )
    columns = ["setting", "value", "source"] if explain else ["setting", "value"]
    t = table(None, columns)
    for key, value, source in plan.explain():
        if not explain and value in (None, [], {}, ()):
            continue  # unset values say nothing; --explain shows them all
        row = [Text(key), Text(json.dumps(value))] + ([Text(source)] if explain else [])
        t.add_row(*row)
    out.print(t)
    if fit:
        out.print(Text(f"Capacity: {capacity_line(fit)}"))
    inv = build_invocation(deployment)
    requirements = plan.recipe.recommended
    if requirements.cuda_driver:
        out.print(
            Text(f"Requires: a driver supporting CUDA {requirements.cuda_driver} (recommended by the recipe)")
        )
    if requirements.rocm:
        out.print(Text(f"Requires: ROCm {requirements.rocm}"))
    for note in inv.effects:
        out.print(Text(f"Engine: {note}"))
    for warning in plan.warnings:
        out.print(Text(f"warning: {warning}", style="yellow"))
    out.print()
    command = shlex.join([*(f"{k}={v}" for k, v in inv.env), "vllm", "serve", *inv.args])
    out.print(Text(f"Command (image {inv.image}):"))
    out.print(Text(command), soft_wrap=True)


def probe_json(report: ProbeReport) -> dict[str, Any]:
    hw = report.hardware
    found = match_recipe(hw)
    recipe: dict[str, Any] = (
        {
            "name": found.recipe.recipe,
            "min_gpus": found.recipe.match.min_gpus,
            "enough_gpus": found.enough_gpus(hw),
        }
        if found.recipe
        else {"name": None, "reason": found.reason}
    )
    return {
        "hardware": hardware_json(hw),
        "recipe": recipe,
        "visible_devices_from": report.visibility,
        "attempts": [{"method": a.method, "ok": a.ok, "detail": a.detail} for a in report.attempts],
    }


def _recipe_line(hw: Hardware) -> str:
    found = match_recipe(hw)
    if found.recipe is None:
        return str(found.reason)
    needed = found.recipe.match.min_gpus
    short = "" if found.enough_gpus(hw) else f"; needs {needed} GPUs, this host has {hw.count}"
    return f"{found.recipe.recipe} ({found.recipe.description}){short}"


def print_probe(report: ProbeReport) -> None:
    recipe_line = _recipe_line(report.hardware)
    out = console()
    hw = report.hardware
    if hw.count == 0:
        out.print("No GPU found.")
    else:
        out.print(
            f"[bold]{hw.count}x {hw.product}[/bold]  {hw.vendor} {hw.family or 'unsupported'} "
            f"(arch {hw.arch}), {hw.memory_per_gpu_gib:.1f} GiB each"
        )
        facts = [
            ("driver", hw.driver_version),
            ("CUDA driver", hw.cuda_driver_version),
            ("ROCm", hw.rocm_version),
            (
                "MIG",
                {True: "enabled", False: "disabled"}.get(hw.mig_enabled)
                if hw.mig_enabled is not None
                else None,
            ),
            (
                "NVLink",
                {True: "all pairs", False: "not between all pairs"}.get(hw.nvlink)
                if hw.nvlink is not None
                else None,
            ),
            (
                "xGMI",
                {True: "all pairs", False: "not between all pairs"}.get(hw.xgmi)
                if hw.xgmi is not None
                else None,
            ),
            (
                "fabric",
                f"clique {hw.fabric.clique_id}, cluster {hw.fabric.cluster_uuid}" if hw.fabric else None,
            ),
            ("visible devices", report.visibility),
        ]
        for label, value in facts:
            if value:
                out.print(f"  {label:<16}{value}")
        for gpu in hw.gpus:
            out.print(
                f"  GPU {gpu.index}  {gpu.name}  {gpu.pci_device_id or ''}  {gpu.bus_id or ''}  "
                f"{gpu.memory_total_bytes / 2**30:.1f} GiB  {gpu.uuid or ''}".rstrip(),
                markup=False,
            )
        for note in hw.notes:
            out.print(f"  note: {note}")
    out.print(f"Recipe: {recipe_line}")
    for attempt in report.attempts:
        out.print(
            f"  probe {attempt.method}: {'ok' if attempt.ok else 'unavailable'} ({attempt.detail})",
            markup=False,
        )


def print_validation(report: PlanValidation, as_json: bool) -> None:
    """`m31ctl validate`: every finding on stderr, or the JSON report."""
    if as_json:
        emit_json(report.to_json())
        return
    for finding in report.findings:
        sys.stderr.write(f"m31ctl: {finding.line()}\n")
    if report.ok:
        inv = report.invocation
        sys.stdout.write(
            f"ok: {len(inv.args)} argv elements and {len(inv.env)} environment variables "
            f"match vLLM {report.schema.version} ({inv.image})\n"
        )


def print_doctor(report: DoctorReport) -> None:
    from rich.text import Text

    from m31ctl.cli.output import table

    out = console()
    if report.plan is None:
        out.print(Text(f"No plan for this host: {report.plan_error}"))
    else:
        p = report.plan
        out.print(
            f"Plan {p.hash}: recipe {p.recipe.recipe}, variant {p.variant}, profile {p.profile}, "
            f"{p.gpus_needed} GPUs",
            markup=False,
        )
    colors = {"ok": "green", "warn": "yellow", "fail": "red", "skip": "dim"}
    t = table(None, ["check", "status", "finding", "remedy"])
    for r in report.results:
        t.add_row(r.title, Text(r.status, style=colors[r.status]), Text(r.message), Text(r.remedy))
    out.print(t)
    s = report.summary()
    out.print(f"{s['ok']} ok, {s['warn']} warn, {s['fail']} fail, {s['skip']} skip")


def print_smoke(report: SmokeReport, as_json: bool) -> None:
    from m31ctl.redact import redact

    if as_json:
        emit_json(report.to_json())
        return
    # Redacted line by line: a server's answer (quoted in a failed check, or its model name) may
    # echo the API key it was sent.
    for check in report.checks:
        mark = "FAIL" if check.failed else "ok  "
        sys.stdout.write(redact(f"{mark} {check.id}: {check.message}") + "\n")
    if report.ttft_s is not None:
        rate = f"{report.tokens_per_s:.1f} tokens/s" if report.tokens_per_s else "rate n/a"
        sys.stdout.write(
            redact(
                f"time to first token {report.ttft_s * 1000:.0f} ms, {rate}, "
                f"chat latency {report.latency_s or 0:.2f} s ({report.model} at {report.endpoint})"
            )
            + "\n"
        )
