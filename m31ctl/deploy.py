"""Launching a plan on a runtime: the one preflight every runtime shares, then the runtime.

It sits above both doctor/ (whose checks gate the launch) and runtime/ (which starts the
server), so neither imports the other's caller.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from m31ctl.deployment import Deployment, require_fit
from m31ctl.doctor import preflight
from m31ctl.runtime import get_runtime
from m31ctl.runtime.base import DryRun, LaunchOptions, LaunchResult, Runtime
from m31ctl.runtime.gates import unknown_gates
from m31ctl.runtime.launching import OFFLINE_ENV


def launch(
    deployment: Deployment,
    runtime_name: str,
    options: LaunchOptions,
    deep: bool = True,
    fetch: Callable[[Deployment], bool] | None = None,
) -> LaunchResult:
    """Check the host (GPUs, memory, model path, API key, and what the runtime needs, such as
    the Docker Engine, and with `deep` the engine's own torch and an all-reduce on the plan's GPUs,
    seconds before a download of hundreds of GB), then `fetch` the checkpoint (m31ctl pull; True
    when it pulled one), then let the runtime converge on the plan. Nothing starts if a check fails."""
    runtime = get_runtime(runtime_name)
    require_fit(deployment)
    checks = preflight(deployment, gate_ids(runtime), options.environ, deep=runtime_name if deep else None)
    for result in checks:
        if result.status == "warn":
            options.report(f"warning: {result.title}: {result.message}")
    if fetch is not None and fetch(deployment):
        # The pinned snapshot is in the cache: the engine reads it without asking the hub again.
        options = dataclasses.replace(options, environ={**options.environ, OFFLINE_ENV: "1"})
    if options.diagnostics is None:
        options = dataclasses.replace(options, diagnostics=lambda: _diagnostics(deployment))
    return runtime.launch(deployment, options)


def gate_ids(runtime: Runtime) -> tuple[str, ...]:
    """The ids of the checks that gate a launch on `runtime`. A gate that no registered check
    carries is a bug (a check renamed in doctor), refused here rather than left out of the
    preflight: a launch must never start with fewer checks than its runtime asked for."""
    from m31ctl.doctor.checks import all_checks

    missing = unknown_gates(runtime.gates, {check.id for check in all_checks()})
    if missing:
        raise RuntimeError(
            f"the {runtime.name} runtime gates launches on checks doctor does not have: "
            + ", ".join(gate.value for gate in missing)
        )
    return tuple(gate.value for gate in runtime.gates)


def _diagnostics(deployment: Deployment) -> dict[str, Any]:
    """For a stalled launch's triage bundle: the doctor's report and each GPU's memory now."""
    from m31ctl.doctor import diagnose_plan, report_json

    found = diagnose_plan(deployment)
    return {
        "doctor": report_json(found.report),
        "gpus": [g.model_dump(mode="json") for g in found.probe_hardware.gpus],
    }


def dry_run(deployment: Deployment, runtime_name: str) -> DryRun:
    return get_runtime(runtime_name).dry_run(deployment)
