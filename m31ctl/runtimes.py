"""The two runtimes behind one seam: `docker` (a container on the Docker Engine) and `native`
(vLLM from a local Python). Commands pick one by name and never branch on it themselves."""

from __future__ import annotations

from typing import Any

from m31ctl.errors import HostPreconditionError, InputError
from m31ctl.launcher import LaunchResult
from m31ctl.plan import Plan
from m31ctl.readiness import Reporter

RUNTIMES = ("docker", "native")


def check(runtime: str) -> None:
    if runtime not in RUNTIMES:
        raise InputError(f"unknown --runtime {runtime!r}", hint=f"choose {' or '.join(RUNTIMES)}")


def launch(runtime: str, plan: Plan, **options: Any) -> LaunchResult:
    if runtime == "native":
        from m31ctl import native

        return native.launch(plan, **options)
    from m31ctl import launcher

    return launcher.launch(plan, **options)


def servers(runtime: str) -> list[dict[str, Any]]:
    if runtime == "native":
        from m31ctl import native

        return native.status()
    from m31ctl import launcher
    from m31ctl.dockerapi import connect

    return launcher.status(connect())


def logs(runtime: str, name: str | None, follow: bool, tail: int) -> None:
    if runtime == "native":
        from m31ctl import native

        native.logs(name, follow, tail)
        return
    from m31ctl import launcher
    from m31ctl.dockerapi import connect

    launcher.logs(connect(), name, follow, tail)


def stop(runtime: str, name: str | None, timeout: int | None, keep: bool, report: Reporter) -> list[str]:
    if runtime == "native":
        from m31ctl import native

        return native.stop(name, timeout, report)
    from m31ctl import launcher
    from m31ctl.dockerapi import connect

    return launcher.stop(connect(), name, timeout, keep, report)


def running_endpoint(runtime: str, name: str | None) -> str:
    """The one running server's endpoint (or the named one's)."""
    running = [
        r
        for r in servers(runtime)
        if r["state"] == "running" and r["endpoint"] and (name is None or r["name"] == name)
    ]
    if len(running) != 1:
        found = ", ".join(r["name"] for r in running) or "none"
        raise HostPreconditionError(
            f"need exactly one running m31ctl server, found {found}", hint="pass --name or --url"
        )
    return str(running[0]["endpoint"])
