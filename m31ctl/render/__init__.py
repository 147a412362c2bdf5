"""Deployment artifacts from a plan: a registry of targets (targets.py), written atomically or
compared with what a directory holds (files.py). Templates live in the top-level templates/."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from m31ctl.deployment import Deployment
from m31ctl.errors import InputError
from m31ctl.render.targets import RENDERERS, SINGLE_HOST, Artifact, render_monitoring, single_host_only

Renderer = Callable[[Deployment], list[Artifact]]


def _pd_renderers() -> dict[str, Renderer]:
    """The targets that render a prefill/decode plan (render/pd.py, pd_host.py); the others refuse
    it. Compose, the script and systemd check themselves that the pair fits one host; monitoring
    reads the group (observability.py)."""
    # lazy: the P/D renderers and the pair's modules (containers, docker run, the router) load for a
    # P/D plan alone
    from m31ctl.render.pd import render_compose_pd, render_k8s_pd
    from m31ctl.render.pd_host import render_script_pd, render_systemd_pd

    return {
        "script": render_script_pd,
        "compose": render_compose_pd,
        "k8s": render_k8s_pd,
        "systemd": render_systemd_pd,
        "monitoring": render_monitoring,
    }


def __getattr__(name: str) -> Any:
    if name == "PD_RENDERERS":  # the registry of P/D renderers, loaded when first asked for
        return _pd_renderers()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_target(name: str) -> Renderer:
    """The renderer for `name`. A single-host target refuses a layout wider than one host."""
    if name not in RENDERERS:
        raise InputError(f"unknown --target {name!r}", hint=f"choose one of: {', '.join(RENDERERS)}")
    renderer = RENDERERS[name]

    def render(deployment: Deployment) -> list[Artifact]:
        if deployment.disaggregated is not None:
            # A P/D plan: its own registry (render/pd.py); a target without an entry refuses.
            pd_renderers = _pd_renderers()
            pd_renderer = pd_renderers.get(name)
            if pd_renderer is None:
                from m31ctl.render.pd import refuse_pd  # lazy: as in _pd_renderers

                refuse_pd(name, tuple(pd_renderers))
            assert pd_renderer is not None
            return pd_renderer(deployment)
        if name in SINGLE_HOST:
            single_host_only(deployment, name)
        return renderer(deployment)

    return render


__all__ = ["Artifact", "Renderer", "get_target"]
