"""What `plan`, `probe` and `capacity` print: JSON payloads and human tables."""

from __future__ import annotations

import json
import shlex
from typing import Any

from m31ctl.capacity import Fit
from m31ctl.engine.adapter import build_invocation
from m31ctl.hardware import Hardware
from m31ctl.output import console
from m31ctl.plan import Plan
from m31ctl.probe import ProbeReport

GB = 1e9


def hardware_json(hw: Hardware) -> dict[str, Any]:
    data = hw.model_dump(mode="json")
    data["memory_per_gpu_gib"] = round(hw.memory_per_gpu_gib, 1)
    return data


def fit_json(fit: Fit) -> dict[str, Any]:
    return {
        "layout": fit.layout,
        "context": fit.context,
        "sequences": fit.sequences,
        "weights_per_gpu_gb": round(fit.weights_per_gpu_bytes / GB, 2),
        "kv_budget_per_gpu_gb": round(fit.kv_budget_per_gpu_bytes / GB, 2),
        "kv_per_sequence_gb": round(fit.kv_bytes_per_sequence / GB, 3),
    }


def plan_json(plan: Plan, fit: Fit | None) -> dict[str, Any]:
    """The stable `plan --json` object (documented in the README)."""
    inv = build_invocation(plan)
    return {
        "plan_hash": plan.hash,
        "recipe": plan.recipe.recipe,
        "recipe_status": plan.recipe.status,
        "recipe_file": plan.recipe.path,
        "variant": plan.variant,
        "profile": plan.profile,
        "gpus_needed": plan.gpus_needed,
        "hardware": hardware_json(plan.hardware),
        "image": inv.image,
        "argv": list(inv.args),
        "env": inv.env_dict,
        "settings": plan.settings_dict(),
        "provenance": {key: source for key, _value, source in plan.explain()},
        "capacity": fit_json(fit) if fit else None,
        "warnings": list(plan.warnings),
    }


def serve_command(plan: Plan) -> str:
    inv = build_invocation(plan)
    return shlex.join(["vllm", "serve", *inv.args])


def print_plan(plan: Plan, fit: Fit | None, explain: bool) -> None:
    from rich.text import Text

    from m31ctl.output import table

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
            f"the plan uses {plan.gpus_needed}"
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
        line = (
            f"{fit.sequences} sequences of {fit.context} tokens stay resident ({fit.layout})"
            if fit.fits
            else f"does not fit: not one {fit.context}-token sequence fits ({fit.layout})"
        )
        out.print(Text(f"Capacity: {line}"))
    for warning in plan.warnings:
        out.print(Text(f"warning: {warning}", style="yellow"))
    out.print()
    inv = build_invocation(plan)
    command = shlex.join([*(f"{k}={v}" for k, v in inv.env), "vllm", "serve", *inv.args])
    out.print(Text(f"Command (image {inv.image}):"))
    out.print(Text(command), soft_wrap=True)


def print_probe(report: ProbeReport, recipe_line: str) -> None:
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
