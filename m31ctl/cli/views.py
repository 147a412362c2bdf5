"""What `plan`, `probe` and `validate` return and print: their results' JSON and text views (and
the pieces capacity and launch share)."""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from m31ctl.cli.output import console, text_view
from m31ctl.cli.screen import for_stderr, print_command, print_paragraph, print_table
from m31ctl.engine.adapter import build_invocation
from m31ctl.engine.validate import GroupValidation, PlanValidation
from m31ctl.hardware import Hardware
from m31ctl.plan.catalog import match_recipe
from m31ctl.plan.runtime_shapes import MOE_SOURCE

if TYPE_CHECKING:
    from m31ctl.capacity.memory import Band, Fit, GeometryOrigin, Sensitivity
    from m31ctl.deployment import Deployment
    from m31ctl.engine.router import RouterInvocation
    from m31ctl.probe import ProbeReport
    from m31ctl.timeline import Timeline

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
        "geometry": geometry_json(fit.geometry),
    }


def geometry_json(origin: GeometryOrigin) -> dict[str, Any]:
    """Which geometry sized the KV cache: whose, what, where it was read, and what is unpublished."""
    return {
        "model": origin.model,
        "name": origin.name,
        "source": origin.source,
        "published": origin.published,
        "unpublished": list(origin.unpublished),
    }


def geometry_line(origin: GeometryOrigin) -> str:
    """'geometry of MiniMax-M3 (MXFP8): MiniMax-M3-preview's (...), from recipes/models.yaml;
    every value published' (or the values that are not: 'unpublished: sparse_layers=60')."""
    shown = "every value published" if origin.published else f"unpublished: {', '.join(origin.unpublished)}"
    return f"geometry of {origin.model}: {origin.name}, from {origin.source}; {shown}"


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
    group = deployment.disaggregated
    # A P/D plan runs two engines and a router: each is under "disaggregation", the single-engine
    # keys describe the decode engine (where the client's tokens come from).
    inv = build_invocation(group.decode if group else deployment)
    body = {
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
        "timeline": timeline_json(deployment.timeline),
        "warnings": list(plan.warnings),
    }
    if group:
        body["disaggregation"] = disaggregation_json(deployment)
    body["moe_layout"] = moe_layout_json(group.decode if group else deployment)
    return body


def moe_layout_json(engine: Deployment) -> dict[str, Any] | None:
    """The MoE layer as vLLM builds it for the engine's layout (Plan.moe_layout); None for a
    dense model."""
    plan = engine.plan
    moe = plan.moe_layout
    if moe is None:
        return None
    expert_source = plan.provenance.get("parallelism.expert")
    return {
        "ranks": moe.ranks,
        "expert_parallel": moe.expert_parallel,
        "expert_parallel_size": moe.expert_size,
        "tensor_parallel_size": moe.tensor_size,
        "experts_per_gpu": moe.experts_per_gpu(),
        "pipeline_stages": moe.pipeline,
        "nodes": moe.nodes,
        "description": moe.how(),
        "source": MOE_SOURCE,
        "expert_parallel_source": str(expert_source) if expert_source else "schema default",
    }


def _engine_json(engine: Deployment) -> dict[str, Any]:
    inv = build_invocation(engine)
    return {
        "name": engine.name,
        "kv_role": engine.kv_transfer.role.kv_role if engine.kv_transfer else None,
        "port": engine.network.port,
        "gpus": engine.layout.gpus,
        "gpu_indices": list(engine.gpus.indices),
        "nodes": engine.layout.nodes,
        "image": inv.image,
        "argv": list(inv.args),
        "env": inv.env_dict,
        "moe_layout": moe_layout_json(engine),
    }


# The front's program is shipped text (engine/router_front.py): the plan shows its name, not 260
# lines of it, in the place of `python3 -c`'s argument.
FRONT_PROGRAM = "<m31ctl/engine/router_front.py>"


def _fronted(deployment: Deployment) -> tuple[RouterInvocation, RouterInvocation]:
    """The router behind its front and the front, as `launch --runtime native` runs them (the
    router on loopback at the containers' port; natively launch takes a free one), the front's
    program by name."""
    from m31ctl.pair import loopback_front_invocation, loopback_router_invocation  # lazy: P/D alone

    assert deployment.disaggregated is not None
    router = loopback_router_invocation(deployment.disaggregated)
    front = loopback_front_invocation(deployment)
    return router, front._replace(argv=(*front.argv[:2], FRONT_PROGRAM, *front.argv[3:]))


def disaggregation_json(deployment: Deployment) -> dict[str, Any]:
    group = deployment.disaggregated
    assert group is not None
    router, front = _fronted(deployment)
    return {
        "prefill": _engine_json(group.prefill),
        "decode": _engine_json(group.decode),
        "router": {"name": group.router.name, "image": router.image, "argv": list(router.argv)},
        "front": {"image": front.image, "argv": list(front.argv)},
        "one_host": group.fits_one_host,
    }


def _print_commands(deployment: Deployment, out: Any) -> None:
    group = deployment.disaggregated
    for engine in deployment.engines:
        inv = build_invocation(engine)
        command = [*(f"{k}={v}" for k, v in inv.env), "vllm", "serve", *inv.args]
        role = f"{engine.kv_transfer.role.value}, " if engine.kv_transfer else ""
        print_paragraph(out, f"Command ({role}image {inv.image}):")
        print_command(out, [shlex.quote(word) for word in command])
    if group:
        router, front = _fronted(deployment)
        print_paragraph(out, f"Command (router, behind its front on loopback; image {router.image}):")
        print_command(out, [shlex.quote(word) for word in router.argv])
        print_paragraph(out, f"Command (the router's front, on the plan's address; image {front.image}):")
        print_command(out, [word if word == FRONT_PROGRAM else shlex.quote(word) for word in front.argv])


def timeline_json(timeline: Timeline) -> dict[str, Any]:
    """The deployment's clock (m31ctl/timeline.py): each phase with its source and setting, and
    the two waits every runtime derives from them."""
    return {
        "phases": [
            {"phase": name, "seconds": clock.seconds, "source": clock.source, "setting": clock.setting}
            for name, clock in timeline.rows()
        ],
        "ready_s": timeline.ready_s,
        "start_s": timeline.start_s,
    }


def clock_line(timeline: Timeline) -> str:
    download = f"download {timeline.download_s} s, then " if timeline.download_s else ""
    return (
        f"{download}the engine ready within {timeline.ready_s} s (load {timeline.load_s} s; vLLM's "
        f"engine-ready limit raised to {timeline.engine_ready_s} s); stop: {timeline.drain_s} s drain, "
        f"kill after {timeline.stop_s} s"
    )


def _gpus_used(deployment: Deployment) -> str:
    layout = deployment.layout
    if layout.spans_nodes:
        return f"{layout.gpus_per_node} on each of {layout.nodes} nodes ({layout.gpus} GPUs)"
    return str(layout.gpus_per_node)


@dataclass(frozen=True)
class PlanShown:
    """`plan`'s result: the deployment and its fit; `explain` and `brief` pick the text's detail."""

    deployment: Deployment
    fit: Fit | None
    explain: bool = False
    brief: bool = False

    def to_json(self) -> dict[str, Any]:
        return plan_json(self.deployment, self.fit)


@text_view(PlanShown)
def _plan_text(shown: PlanShown) -> None:
    print_plan(shown.deployment, shown.fit, shown.explain, brief=shown.brief)


def print_plan(deployment: Deployment, fit: Fit | None, explain: bool, brief: bool = False) -> None:
    plan = deployment.plan
    out = console()
    hw = plan.hardware
    print_paragraph(
        out,
        f"Plan {plan.hash}: recipe {plan.recipe.recipe} ({plan.recipe.status}), variant {plan.variant}, "
        f"profile {plan.profile}",
        style="bold",
    )
    print_paragraph(
        out,
        f"Hardware: {hw.count}x {hw.product}, {hw.memory_per_gpu_gib:.0f} GiB each, from {hw.source}; "
        f"the plan uses {_gpus_used(deployment)}",
    )
    if brief:
        overridden = sorted(
            {key.split(".")[0] for key, _value, source in plan.explain() if "--set" in source}
        )
        print_paragraph(
            out,
            f"Settings: {len(plan.explain())} resolved"
            + (f" ({', '.join(overridden)} set on the command line)" if overridden else "")
            + "; `m31ctl plan --explain` lists each with its source",
        )
    else:
        _print_settings(deployment, explain, out)
    if fit:
        print_paragraph(out, f"Capacity: {capacity_line(fit)}")
    for engine in deployment.engines:
        moe = engine.plan.moe_layout
        if moe is not None:
            role = f" ({engine.kv_transfer.role.value})" if engine.kv_transfer else ""
            print_paragraph(out, f"MoE layout{role}: {moe.describe()}")
    print_paragraph(out, f"Clock: {clock_line(deployment.timeline)}")
    if explain:
        clocks = [
            [name, str(clock.seconds), clock.source, clock.setting]
            for name, clock in deployment.timeline.rows()
        ]
        # A phase's setting is a name to copy into --set: never broken either.
        print_table(out, None, ["phase", "seconds", "from", "changed by"], clocks, names=(0, 3))
    _print_notes(deployment, out)
    out.print()
    _print_commands(deployment, out)


def _print_settings(deployment: Deployment, explain: bool, out: Any) -> None:
    """Each setting and its value (with --explain its source too, and the unset ones)."""
    from rich.text import Text  # lazy: rich is start-up cost that `plan --json` never needs

    columns = ["setting", "value", "source"] if explain else ["setting", "value"]
    rows = []
    for key, value, source in deployment.plan.explain():
        if not explain and value in (None, [], {}, ()):
            continue  # unset values say nothing; --explain shows them all
        rows.append([Text(key), Text(json.dumps(value))] + ([Text(source)] if explain else []))
    print_table(out, None, columns, rows)


def _print_notes(deployment: Deployment, out: Any) -> None:
    """What the recipe recommends of the host, what the engine was told, and the plan's warnings."""
    plan = deployment.plan
    # The recipe's `recommended:`, said as that: doctor warns below it, it refuses nothing.
    recommended = plan.recipe.recommended
    if recommended.cuda_driver:
        print_paragraph(
            out, f"Recommended: a driver supporting CUDA {recommended.cuda_driver} (doctor warns below it)"
        )
    if recommended.rocm:
        print_paragraph(out, f"Recommended: ROCm {recommended.rocm}")
    for note in dict.fromkeys(n for engine in deployment.engines for n in build_invocation(engine).effects):
        print_paragraph(out, f"Engine: {note}")
    for warning in plan.warnings:
        print_paragraph(out, f"warning: {warning}", style="yellow")


@dataclass(frozen=True)
class ProbeShown:
    """`probe`'s result: what was detected, and the recipe that matches it."""

    report: ProbeReport

    def to_json(self) -> dict[str, Any]:
        return probe_json(self.report)


@text_view(ProbeShown)
def _probe_text(shown: ProbeShown) -> None:
    print_probe(shown.report)


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
            print_paragraph(out, f"  note: {note}")
    # Wrapped between phrases: a flag with its value and a `command` are never split.
    print_paragraph(out, f"Recipe: {recipe_line}")
    for attempt in report.attempts:
        print_paragraph(
            out, f"  probe {attempt.method}: {'ok' if attempt.ok else 'unavailable'} ({attempt.detail})"
        )


@text_view(PlanValidation)
def print_validation(report: PlanValidation) -> None:
    """`m31ctl validate`: every finding on stderr, and a line when they allow the plan."""
    _print_engine_validation(report, "")


@text_view(GroupValidation)
def print_group_validation(report: GroupValidation) -> None:
    for role, one in report.roles:
        _print_engine_validation(one, role)


def _print_engine_validation(report: PlanValidation, role: str) -> None:
    """One engine's findings and verdict (`role`: the P/D role it plays, said first)."""
    said = f"{role}: " if role else ""
    for finding in report.findings:
        sys.stderr.write(for_stderr(f"m31ctl: {said}{finding.line()}") + "\n")
    if report.ok:
        inv = report.invocation
        sys.stdout.write(
            f"{'ok' if not role else role + ': ok'}: {len(inv.args)} argv elements and {len(inv.env)} "
            f"environment variables match vLLM {report.schema.version} ({inv.image})\n"
        )
