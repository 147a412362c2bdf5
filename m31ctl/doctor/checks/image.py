"""Checks of the engine image: here or pullable, and its own vLLM accepting the plan's argv."""

from __future__ import annotations

import dataclasses
import re

from m31ctl.checks import CheckStatus
from m31ctl.deployment import Deployment
from m31ctl.doctor.base import CheckContext, Outcome
from m31ctl.engine.adapter import build_invocation
from m31ctl.engine.validate import schema_from_data, validate
from m31ctl.runtime.engine_api import local_image, registry_error
from m31ctl.runtime.images import engine_schema, runs_router


def image(ctx: CheckContext) -> Outcome:
    plan = ctx.require_plan()
    name = plan.settings.engine.image
    client = ctx.engine()
    img = local_image(client, name)
    if img is not None:
        return Outcome(CheckStatus.OK, f"{name} present locally ({img.short_id})")
    problem = registry_error(client, name)
    if problem is not None:
        said, remedy = registry_said(problem)
        return Outcome(CheckStatus.WARN, f"{name} is not present locally, and {said}", remedy)
    return Outcome(CheckStatus.OK, f"{name} not present locally; the registry has it (launch pulls it)")


# What a registry's refusal means, by the words the Engine passes on from it (Docker's
# distribution errors and Go's net errors), most specific first: (words, what it means, remedy).
_UNREACHED = "pull it where the registry is reachable, or `docker load` it"
_UNASKED = "its registry could not be asked: "
_REGISTRY_SAYS = (
    (
        ("no such host", "server misbehaving"),
        _UNASKED + "{host} does not resolve here (no DNS or network)",
        _UNREACHED,
    ),
    (("timeout", "deadline exceeded"), _UNASKED + "{host} did not answer in time", _UNREACHED),
    (
        ("connection refused", "connection reset", "unreachable"),
        _UNASKED + "{host} cannot be reached",
        _UNREACHED,
    ),
    (
        ("unauthorized", "denied", "authentication required"),
        "{host} refused to say without credentials (a private image, or none of that name)",
        "`docker login {host}`, or check engine.image's name",
    ),
    (
        ("manifest unknown", "not found", "no such image"),
        "{host} has no such image or tag",
        "check engine.image's name and tag (--set engine.image=NAME:TAG)",
    ),
)


def registry_said(problem: str) -> tuple[str, str]:
    """docker-py's text for a refused registry look-up ("500 Server Error for http+docker://...:
    Internal Server Error ("Get "https://registry-1.docker.io/v2/": dial tcp: ... no such host")")
    as one clause in m31ctl's words and its remedy; the Engine's URL and status line left out."""
    inner = problem.split(' ("', 1)[1].removesuffix('")') if ' ("' in problem else problem
    found = re.search(r"https?://([^/\"\s]+)", inner)
    host = found.group(1) if found else "its registry"
    low = inner.lower()
    for words, meaning, remedy in _REGISTRY_SAYS:
        if any(w in low for w in words):
            return meaning.format(host=host), remedy.format(host=host)
    # Anything else: the registry's own last words, without the Engine's request line.
    last = inner.rsplit(": ", 1)[-1].strip().rstrip(".")[:100]
    return f"{_UNASKED}{host}: {last}", _UNREACHED


def engine(ctx: CheckContext) -> Outcome:
    """Each engine's argv and environment (a P/D group's prefill and decode, each with its own
    image) against the vLLM inside its image."""
    outcomes = [_engine_accepts(ctx, one) for one in ctx.require_deployment().engines]
    if len(outcomes) == 1:
        return outcomes[0]
    worst = max(outcomes, key=lambda o: SEVERITY[o.status])
    roles = [one.kv_transfer.role.value for one in ctx.require_deployment().engines if one.kv_transfer]
    said = "; ".join(f"{role}: {o.message}" for role, o in zip(roles, outcomes, strict=True))
    return dataclasses.replace(worst, message=said)


# Which of several engines' outcomes the check reports as its own status: the worst.
SEVERITY = {CheckStatus.OK: 0, CheckStatus.SKIP: 1, CheckStatus.WARN: 2, CheckStatus.FAIL: 3}


def _engine_accepts(ctx: CheckContext, deployment: Deployment) -> Outcome:
    name = deployment.plan.settings.engine.image
    image = local_image(ctx.engine(), name)
    if image is None:
        return Outcome(
            CheckStatus.SKIP,
            f"{name} is not present locally, so its own vLLM cannot be asked",
            "pull it, then run doctor again (plan-time validation used the vLLM 0.32 schema)",
        )
    data = engine_schema(ctx.engine(), image)
    findings = validate(build_invocation(deployment), schema_from_data(data, name))
    if findings:
        return Outcome(
            CheckStatus.FAIL,
            f"the image's vLLM {data.get('version')} would reject {findings[0].line()}"
            + (f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""),
            "fix the setting, or use an image whose vLLM supports it",
        )
    return Outcome(CheckStatus.OK, f"argv and environment match the vLLM {data.get('version')} inside {name}")


def router(ctx: CheckContext) -> Outcome:
    """A P/D plan's router image runs vllm-router: vLLM's images do not carry it, and a router
    started from one crash-loops on 'vllm-router: not found' (issue 49)."""
    group = ctx.require_deployment().disaggregated
    if group is None:
        return Outcome(CheckStatus.SKIP, "not a prefill/decode plan: no router")
    name = group.router.image
    found = local_image(ctx.engine(), name)
    if found is None:
        return Outcome(
            CheckStatus.SKIP,
            f"{name} is not present locally, so whether it runs vllm-router cannot be asked",
            "pull it, then run doctor again",
        )
    if not runs_router(ctx.engine(), found):
        return Outcome(
            CheckStatus.FAIL,
            f"{name} has no vllm-router to run (`vllm-router --help` failed in it)",
            "set disaggregation.router.image to vllm-router's own image (the default, vllm/vllm-router) "
            "or one that installs it",
        )
    return Outcome(CheckStatus.OK, f"{name} runs vllm-router")


def applies_to_a_pair(deployment: Deployment | None) -> bool:
    return deployment is not None and deployment.disaggregated is not None
