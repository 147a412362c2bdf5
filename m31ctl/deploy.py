"""Launching a plan on a runtime: the one preflight every runtime shares, then the runtime.

It sits above both doctor/ (whose checks gate the launch) and runtime/ (which starts the
server), so neither imports the other's caller.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import sys
from collections.abc import Callable
from typing import Any

from m31ctl.deployment import Deployment, require_fit
from m31ctl.doctor import diagnose_plan, preflight, report_json
from m31ctl.doctor.base import CheckResult
from m31ctl.doctor.remembered import key_for, recall, remember
from m31ctl.engine.adapter import OFFLINE_ENV
from m31ctl.errors import InputError
from m31ctl.pair import on_one_host
from m31ctl.plan.layers import FlagSet
from m31ctl.probe import ProbeReport, detect
from m31ctl.runtime import RUNTIMES, get_runtime
from m31ctl.runtime.protocol import DryRun, LaunchOptions, LaunchResult, Runtime
from m31ctl.timeline import ENGINE_READY_ENV
from m31ctl.timeline import conflicts as clock_conflicts


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
    refuse_group(deployment, runtime_name)
    # A P/D group's engines are its roles: each is checked as the engine it is (its own
    # kv-transfer config, port and environment); a warning both share is said once.
    warned: set[tuple[str, str]] = set()
    probe = detect()
    for engine in deployment.engines:
        checks = _gate(engine, runtime, options, probe, deep)
        for result in checks:
            if result.status == "warn" and (result.title, result.message) not in warned:
                warned.add((result.title, result.message))
                options.report(f"warning: {result.title}: {result.message}")
    pulled = fetch is not None and fetch(deployment)
    engine_downloads = not pulled and not deployment.model.local
    for warning in timeout_warnings(deployment, options.timeout, engine_downloads):
        options.report(f"warning: {warning}")
    for conflict in clock_conflicts(deployment.timeline, dict(deployment.plan.settings.runtime.env)):
        options.report(f"warning: {conflict.message}")
    if pulled:
        # The pinned snapshot is in the cache: the engine reads it without asking the hub again.
        options = dataclasses.replace(options, environ={**options.environ, OFFLINE_ENV: "1"})
    elif engine_downloads:
        options = _engine_downloads(deployment, options)
    if options.diagnostics is None:
        options = dataclasses.replace(options, diagnostics=lambda: _diagnostics(deployment))
    return runtime.launch(deployment, options)


def _gate(
    engine: Deployment, runtime: Runtime, options: LaunchOptions, probe: ProbeReport, deep: bool
) -> list[CheckResult]:
    """The preflight of one engine. The deep checks run unless they already passed for this
    plan, engine and host (doctor/remembered.py): then the launch says so and skips them, and a
    deep pass is written down for the next launch."""
    key = key_for(runtime, engine, probe.hardware, options.environ) if deep else None
    passed = recall(key) if key else None
    if passed is not None:
        options.report(passed.line())
        deep, key = False, None
    checks = preflight(
        engine, runtime.gates, options.environ, probe=probe, deep=runtime.name if deep else None
    )
    if key is not None:
        remember(key, engine, checks)
    return checks


def _engine_downloads(deployment: Deployment, options: LaunchOptions) -> LaunchOptions:
    """No pull before the engine (--no-pull): vLLM fetches the checkpoint inside its engine
    core's start, so its ready limit and launch's wait cover the download too."""
    timeline = deployment.timeline
    environ = {**options.environ, ENGINE_READY_ENV: str(timeline.engine_ready_with_download_s)}
    timeout = options.timeout if options.timeout is not None else float(timeline.start_s)
    return dataclasses.replace(options, environ=environ, timeout=timeout)


def timeout_warnings(deployment: Deployment, timeout: float | None, engine_downloads: bool) -> list[str]:
    """A --timeout shorter than what the plan's timeline needs: the launch gives up on a start
    the engine would finish (both settings named)."""
    if timeout is None:
        return []
    timeline = deployment.timeline
    needed = timeline.start_s if engine_downloads else timeline.ready_s
    if timeout >= needed:
        return []
    what = (
        f"the download ({timeline.download_s} s, runtime.download_mbps) plus the start ({timeline.ready_s} s)"
        if engine_downloads
        else f"the start ({timeline.ready_s} s: runtime.load_and_compile_s={timeline.load_s} and the API)"
    )
    return [f"--timeout {timeout:g} is shorter than {what}: launch gives up on a start that may finish"]


def _diagnostics(deployment: Deployment) -> dict[str, Any]:
    """For a stalled launch's triage bundle: the doctor's report and each GPU's memory now."""
    found = diagnose_plan(deployment)
    return {
        "doctor": report_json(found.report),
        "gpus": [g.model_dump(mode="json") for g in found.probe_hardware.gpus],
    }


def refuse_group(deployment: Deployment, runtime_name: str) -> None:
    """A P/D group on a runtime that cannot run one, or wider than this host: one line, before
    any check, download or start (m31ctl/pair.py on_one_host: the one refusal of a wide pair)."""
    if deployment.disaggregated is None:
        return
    if not get_runtime(runtime_name).runs_groups:
        able = [name for name in RUNTIMES if get_runtime(name).runs_groups]
        raise InputError(
            f"the {runtime_name} runtime does not launch a P/D plan (prefill, decode and router)",
            hint=f"launch it with --runtime {' or '.join(able)}, or render it (m31ctl render "
            "--target compose or --target k8s) and run that",
        )
    on_one_host(deployment, "launch")


def dry_run(deployment: Deployment, runtime_name: str) -> DryRun:
    refuse_group(deployment, runtime_name)
    return get_runtime(runtime_name).dry_run(deployment)


def launch_sets(sets: tuple[str, ...], name: str | None, port: int | None) -> tuple[str, ...]:
    """launch's --name and --port as the settings they stand for, after the user's --set ones.
    Flags are values, not JSON: encoded so `--name true` stays the string "true". Each keeps its
    flag as its source: an error about it names `--port`, not a `--set #N` nobody typed."""
    flags = []
    if name is not None:
        flags.append(FlagSet(f"runtime.container_name={json.dumps(name)}", "--name"))
    if port is not None:
        flags.append(FlagSet(f"runtime.port={port}", "--port"))
    return (*sets, *flags)


def preflight_hint(exc: Exception, d: Deployment, runtime_name: str, plan_argv: list[str]) -> str | None:
    """A failed preflight's next step for this launch: doctor with the same plan options
    (`plan_argv`) and runtime (a bare `m31ctl doctor --deep` checks the probed host's default plan
    instead), and on the native runtime the setting that names the Python."""
    hint = getattr(exc, "hint", None)
    if not hint or "m31ctl doctor" not in hint:
        return hint
    doctor_cmd = shlex.join(["m31ctl", "doctor", "--deep", "--runtime", runtime_name, *plan_argv, "--json"])
    if "runtime.native_python" in str(exc):
        python = d.plan.settings.runtime.native_python or sys.executable
        return (
            f"point runtime.native_python at a Python with vLLM (it is {python}: "
            f"--set runtime.native_python=PATH); the whole report: `{doctor_cmd}`"
        )
    return re.sub(r"`m31ctl doctor[^`]*`", f"`{doctor_cmd}`", hint)
