"""Checks of the engine image: here or pullable, and its own vLLM accepting the plan's argv."""

from __future__ import annotations

from m31ctl.doctor.base import Context, Outcome
from m31ctl.runtime.engine_api import local_image, registry_error


def image(ctx: Context) -> Outcome:
    plan = ctx.require_plan()
    name = plan.settings.engine.image
    client = ctx.engine()
    img = local_image(client, name)
    if img is not None:
        return Outcome("ok", f"{name} present locally ({img.short_id})")
    problem = registry_error(client, name)
    if problem is not None:
        return Outcome(
            "warn",
            f"{name} is not present locally and its registry did not answer ({problem[:120]})",
            "pull it where the registry is reachable, or `docker load` it",
        )
    return Outcome("ok", f"{name} not present locally; the registry has it (launch pulls it)")


def engine(ctx: Context) -> Outcome:
    plan = ctx.require_plan()
    from m31ctl.engine.adapter import build_invocation
    from m31ctl.engine.validate import schema_from_data, validate

    name = plan.settings.engine.image
    image = local_image(ctx.engine(), name)
    if image is None:
        return Outcome(
            "skip",
            f"{name} is not present locally, so its own vLLM cannot be asked",
            "pull it, then run doctor again (plan-time validation used the vLLM 0.32 schema)",
        )
    from m31ctl.runtime.images import engine_schema

    data = engine_schema(ctx.engine(), image)
    findings = validate(build_invocation(ctx.require_deployment()), schema_from_data(data, name))
    if findings:
        return Outcome(
            "fail",
            f"the image's vLLM {data.get('version')} would reject {findings[0].line()}"
            + (f" (+{len(findings) - 1} more)" if len(findings) > 1 else ""),
            "fix the setting, or use an image whose vLLM supports it",
        )
    return Outcome("ok", f"argv and environment match the vLLM {data.get('version')} inside {name}")
