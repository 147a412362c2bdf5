"""What launch, status and stop print."""

from __future__ import annotations

import dataclasses
import json as jsonlib
import shlex
import sys
from typing import Any

from m31ctl.container import API_KEY, container_spec
from m31ctl.launcher import LaunchResult, endpoint
from m31ctl.output import console, emit_json, table
from m31ctl.plan import Plan
from m31ctl.render.dockercli import docker_run_argv


def reporter(as_json: bool) -> Any:
    """Progress lines go to stderr, so stdout stays one JSON object under --json."""

    def report(line: str) -> None:
        sys.stderr.write(f"m31ctl: {line}\n")
        sys.stderr.flush()

    return report


def confirm(question: str) -> bool:
    if not sys.stdin.isatty():
        return False
    import typer

    return bool(typer.confirm(question, default=False))


def print_dry_run(plan: Plan, as_json: bool, runtime: str = "docker") -> None:
    from m31ctl.planning import plan_fit
    from m31ctl.views import plan_json, print_plan

    payload: dict[str, Any] = {"plan": plan_json(plan, plan_fit(plan))}
    if runtime == "native":
        from m31ctl.native import command

        argv = command(plan)
        payload["command"] = argv
    else:
        spec = container_spec(plan)
        argv = ["docker", *docker_run_argv(spec, "detached")]
        payload.update(container=dataclasses.asdict(spec), docker_run=argv)
    if as_json:
        emit_json(payload)
        return
    print_plan(plan, plan_fit(plan), explain=False)
    out = console()
    out.print()
    out.print(
        f"{'Process' if runtime == 'native' else 'Container'} (dry run, nothing started):", markup=False
    )
    out.print(shlex.join(argv), markup=False, soft_wrap=True)


def print_result(plan: Plan, result: LaunchResult, as_json: bool) -> None:
    if as_json:
        emit_json(result.to_json())
        return
    out = console()
    verb = {"unchanged": "already serving this plan; nothing changed"}.get(result.action, result.action)
    out.print(f"{result.container}: {verb} (plan {result.plan_hash})", markup=False)
    if not result.ready:
        out.print("started; not waiting for readiness (--detach). `m31ctl status` tells when it is up.")
        return
    if "ready" in result.timings:
        out.print(f"ready in {result.timings['ready']:.1f} s", markup=False)
    spec = container_spec(plan)
    body = {
        "model": plan.settings.model.served_name,
        "messages": [{"role": "user", "content": "Hello!"}],
        "max_tokens": 64,
    }
    auth = f' -H "Authorization: Bearer ${API_KEY}"' if plan.settings.runtime.api_key else ""
    out.print(f"endpoint: {endpoint(spec)}/v1", markup=False)
    out.print(
        f"try: curl -s {endpoint(spec)}/v1/chat/completions -H 'Content-Type: application/json'{auth} "
        f"-d {shlex.quote(jsonlib.dumps(body))}",
        markup=False,
        soft_wrap=True,
    )


def print_status(rows: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        emit_json({"containers": rows})
        return
    if not rows:
        console().print("no m31ctl containers")
        return
    t = table(None, ["name", "state", "health", "plan", "recipe", "endpoint", "restarts"])
    for r in rows:
        t.add_row(
            r["name"],
            r["state"],
            str(r["health"] or "-"),
            r["plan_hash"] or "-",
            f"{r['recipe']}/{r['variant']}/{r['profile']}",
            r["endpoint"] or "-",
            str(r["restart_count"]),
        )
    console().print(t)
