"""Launching a plan on a runtime: the one preflight every runtime shares, then the runtime.

It sits above both doctor/ (whose checks gate the launch) and runtime/ (which starts the
server), so neither imports the other's caller.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shlex
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from m31ctl.deployment import Deployment, require_fit
from m31ctl.doctor import diagnose_plan, preflight, report_json
from m31ctl.doctor.base import CheckResult
from m31ctl.doctor.remembered import key_for, recall, remember
from m31ctl.engine.adapter import OFFLINE_ENV
from m31ctl.errors import CheckFailed, ConflictError, HostPreconditionError, InputError, M31Error
from m31ctl.names import check_name
from m31ctl.netaddr import port_free
from m31ctl.pair import on_one_host
from m31ctl.plan.layers import FlagSet
from m31ctl.probe import ProbeReport, detect
from m31ctl.runtime import RUNTIMES, bluegreen, get_runtime, previous
from m31ctl.runtime.bluegreen import GateVerdict
from m31ctl.runtime.launching import api_key_for
from m31ctl.runtime.planrecord import record_of, recorded_deployment
from m31ctl.runtime.protocol import DryRun, LaunchOptions, LaunchResult, Replacement, Runtime
from m31ctl.runtime.readiness import models
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


# ---------------------------------------------------------------------------------------------
# blue-green on one host (launch --blue-green, --rollback; m31ctl/runtime/bluegreen.py decides)

# The gate: verify's checks against the new server (its Deployment, its runtime), run by the CLI,
# since served/ is the CLI's to call (tests/test_architecture.py SERVED_USERS).
Gate = Callable[[Deployment, str], GateVerdict]


class Switch(NamedTuple):
    """What a blue-green launch needs beyond a launch's options."""

    gate: Gate
    accept_downtime: bool  # --accept-downtime: no question where the GPUs are not free beside
    rollback_command: str  # the one command that puts the replaced plan back


def blue_green(
    asked: Deployment,
    runtime_name: str,
    options: LaunchOptions,
    switch: Switch,
    deep: bool = True,
    fetch: Callable[[Deployment], bool] | None = None,
) -> LaunchResult:
    """Replace the deployment's live server with the asked plan: the new one in the other slot,
    on GPUs and a port the live one leaves free, through the gate, then the live one stopped;
    where its GPUs are needed, after saying the downtime and asking. Nothing live to replace is
    a launch; a live server that runs the plan already is left unchanged."""
    if asked.disaggregated is not None:
        raise InputError(
            "launch --blue-green replaces one engine; a P/D plan runs as a group of three",
            hint="roll a P/D plan out on Kubernetes (kubernetes.rollout=surge), or launch it without --blue-green",
        )
    live = _live(runtime_name, asked.name)
    if live is None:
        options.report(f"no server of {asked.name} runs: nothing to replace; launching it")
        return launch(asked, runtime_name, options, deep, fetch)
    if bluegreen.serves(live, record_of(asked, os.getcwd())):
        return _unchanged(asked, live, runtime_name, options, deep, fetch)
    placement = _placement(asked, live)
    cut = bluegreen.cutover(placement)
    if not cut.beside:
        return _with_downtime(asked, live, placement, cut, runtime_name, options, switch, deep, fetch)
    new = _placed(asked, bluegreen.other_slot(asked.name, live.name), _port(asked, live), cut.gpus)
    on = f" on GPU {', '.join(map(str, cut.gpus))}" if cut.gpus else ""
    options.report(
        f"blue-green: starting {new.name} at {new.network.local_url}{on}; {live.name} serves meanwhile"
    )
    gated = _start_and_gate(new, live, runtime_name, options, switch, deep, fetch, serving=True)
    _replace_live(asked.name, live, runtime_name, options)
    return _switched(gated, live, cut.gpus, None, switch)


def _unchanged(
    asked: Deployment,
    live: bluegreen.Live,
    runtime_name: str,
    options: LaunchOptions,
    deep: bool,
    fetch: Callable[[Deployment], bool] | None,
) -> LaunchResult:
    """The live server runs the asked plan: nothing changes where it serves; one still loading
    is launched as it was placed, which the flow adopts and waits for."""
    served = asked.plan.settings.model.served_name
    if served in (models(live.endpoint, api_key_for(asked, options.environ)) or []):
        options.report(f"{live.name} serves this plan already, on {live.endpoint}")
        return LaunchResult(
            "unchanged", live.name, runtime_name, live.endpoint, live.plan_hash or asked.plan.hash, True
        )
    port = urlsplit(live.endpoint).port or asked.network.port
    return launch(_placed(asked, live.name, port, ()), runtime_name, options, deep, fetch)


def _live(runtime_name: str, base: str) -> bluegreen.Live | None:
    running = {
        s.name: bluegreen.Live(s.name, s.runtime, s.endpoint, s.plan_hash, s.plan, s.gpus)
        for s in get_runtime(runtime_name).servers()
        if s.running and s.endpoint and s.name in bluegreen.slots(base)
    }
    return bluegreen.live_slot(base, running)


def _placement(asked: Deployment, live: bluegreen.Live) -> bluegreen.GpuPlacement:
    """The host's GPUs as the new server meets them: the live server's (by what its runtime says
    it was given, else its plan's count from the first), others' busy ones, and the free."""
    hw = asked.plan.hardware
    need = asked.layout.gpus_per_node if asked.vendor.gpus else 0
    count = need
    if live.record is not None:
        with contextlib.suppress(InputError):  # a record another m31ctl wrote: its count unknown
            count = recorded_deployment(live.record).layout.gpus_per_node
    held = bluegreen.held_gpus(hw, live.gpus, count) if need else ()
    return bluegreen.place_gpus(hw, held, need, asked.plan.settings.serving.gpu_memory_utilization)


def _port(asked: Deployment, live: bluegreen.Live) -> int:
    """The plan's own port where the live server does not hold it, else the next free above."""
    live_port = urlsplit(live.endpoint).port
    bind = asked.network.bind
    preferred = asked.network.port if asked.network.port != live_port else asked.network.port + 1
    return bluegreen.choose_port(preferred, {live_port} if live_port else set(), lambda p: port_free(bind, p))


def _placed(asked: Deployment, name: str, port: int, gpus: tuple[int, ...]) -> Deployment:
    """The asked plan in a slot: its name and port set (the plan the new server records, which
    verify and status read back), and the GPUs chosen for it."""
    settings = asked.plan.settings
    runtime = settings.runtime.model_copy(update={"container_name": check_name(name, "--name"), "port": port})
    plan = asked.plan._replace(settings=settings.model_copy(update={"runtime": runtime}))
    placed = asked._replace(plan=plan, name=name, network=asked.network._replace(port=port))
    return placed._replace(gpus=bluegreen.selection_of(plan.hardware, gpus)) if gpus else placed


def _start_and_gate(
    new: Deployment,
    live: bluegreen.Live,
    runtime_name: str,
    options: LaunchOptions,
    switch: Switch,
    deep: bool,
    fetch: Callable[[Deployment], bool] | None,
    serving: bool,
) -> tuple[LaunchResult, GateVerdict]:
    """Launch `new` and run the gate on it. A new server that does not start or fails the gate
    is stopped, and the error says who serves now (`serving`: the live server still does)."""
    after = (
        f"{live.name} keeps serving on {live.endpoint}"
        if serving
        else f"nothing serves; `{switch.rollback_command}` starts the previous plan again"
    )
    try:
        # The slot holds nothing that serves (the live server is the other one): a server left in
        # it, of another plan, is replaced without a question.
        result = launch(new, runtime_name, dataclasses.replace(options, detach=False, yes=True), deep, fetch)
    except M31Error as exc:
        _discard(new.name, runtime_name, options)
        exc.message = f"blue-green: {new.name} did not start: {exc.message}; {after}"
        raise
    options.report(f"gate: verify's checks against {new.name} at {result.endpoint}")
    verdict = switch.gate(new, runtime_name)
    if not verdict.ok:
        _discard(new.name, runtime_name, options)
        raise CheckFailed(
            f"blue-green: {new.name} failed the gate ({'; '.join(verdict.failed)}); it is stopped and {after}",
            hint=f"run the same checks on a server of this plan: m31ctl verify --name {new.name}",
        )
    passed = [c for c in verdict.checks if c not in verdict.skipped]
    skipped = f"; skipped: {', '.join(verdict.skipped)}" if verdict.skipped else ""
    options.report(f"gate passed: {', '.join(passed)}{skipped}")
    return result, verdict


def _discard(name: str, runtime_name: str, options: LaunchOptions) -> None:
    """Stop a new server that will not serve; one already gone (it died loading) is fine."""
    runtime = get_runtime(runtime_name)
    if any(s.name == name for s in runtime.servers()):
        runtime.stop(name, None, False, options.report)


def _replace_live(base: str, live: bluegreen.Live, runtime_name: str, options: LaunchOptions) -> None:
    """Keep the live server's plan for --rollback, then stop it (its drain, as `m31ctl stop`)."""
    if live.record is not None:
        previous.remember(previous.Previous(base, live.name, runtime_name, live.record, time.time()))
    else:
        options.report(f"warning: {live.name} recorded no plan: --rollback cannot put it back")
    options.report(f"stopping {live.name} ({live.endpoint}): the new server serves")
    get_runtime(runtime_name).stop(live.name, None, False, options.report)


def _switched(
    gated: tuple[LaunchResult, GateVerdict],
    live: bluegreen.Live,
    gpus: tuple[int, ...],
    downtime: int | None,
    switch: Switch,
) -> LaunchResult:
    result, verdict = gated
    back = switch.rollback_command
    if downtime is not None and "--accept-downtime" not in back:
        back += " --accept-downtime"  # going back needs the same GPUs: the same downtime, accepted
    rollout = Replacement(live.name, live.endpoint, live.plan_hash, gpus, downtime, verdict.checks, back)
    return dataclasses.replace(result, rollout=rollout)


def _with_downtime(
    asked: Deployment,
    live: bluegreen.Live,
    placement: bluegreen.GpuPlacement,
    cut: bluegreen.Cutover,
    runtime_name: str,
    options: LaunchOptions,
    switch: Switch,
    deep: bool,
    fetch: Callable[[Deployment], bool] | None,
) -> LaunchResult:
    """The live server's GPUs are needed: said, with the downtime (the timeline's start of the
    new server: it serves nothing meanwhile), and asked (--accept-downtime answers; unattended,
    refused, exit 4). Then the live server stops, the new one starts in its slot (its name and
    port: the endpoint stays) and passes the gate."""
    downtime = asked.timeline.ready_s
    cost = f"about {downtime} s without service (the new server's start, plan --explain 'ready')"
    question = f"{placement.why_not()}: replacing {live.name} means {cost}. Stop it and start the new plan?"
    if not (switch.accept_downtime or options.confirm(question)):
        raise ConflictError(
            f"blue-green: {placement.why_not()}; {live.name} not replaced, which would cost {cost}",
            hint="pass --accept-downtime to replace it anyway, or free GPUs to start the new one beside it",
        )
    port = urlsplit(live.endpoint).port or asked.network.port
    new = _placed(asked, live.name, port, cut.gpus)
    if fetch is not None:  # the download while the live server still serves, not in the downtime
        pulled = fetch(new)
        fetch = lambda _d: pulled  # noqa: E731 (the launch below finds the pull done)
    _replace_live(asked.name, live, runtime_name, options)
    gated = _start_and_gate(new, live, runtime_name, options, switch, deep, fetch, serving=False)
    return _switched(gated, live, cut.gpus, downtime, switch)


def rollback_deployment(name: str | None) -> tuple[Deployment, str]:
    """`launch --rollback`: the plan the deployment's last blue-green launch replaced, named as
    the deployment (its slot is chosen again), on this host's GPUs as probed now, with the
    runtime it ran in."""
    bases = [check_name(name, "--name")] if name is not None else previous.kept()
    if len(bases) != 1:
        raise InputError(
            "--rollback needs --name: "
            + (
                f"{len(bases)} deployments keep a previous plan ({', '.join(bases)})"
                if bases
                else "none kept"
            ),
            hint="m31ctl status lists the servers; a blue-green launch keeps the plan it replaces",
        )
    kept = previous.recall(bases[0])
    if kept is None:
        raise HostPreconditionError(
            f"no previous plan of {bases[0]} is kept",
            hint="a launch --blue-green keeps the plan it replaces; roll back with your files (docs/second-day.md)",
        )
    old = recorded_deployment(kept.record)
    if not old.simulated:  # the GPUs' free memory now, not when the old plan was made
        old = old._replace(plan=old.plan._replace(hardware=detect().hardware))
    return _placed(old, kept.base, old.network.port, ()), kept.runtime
