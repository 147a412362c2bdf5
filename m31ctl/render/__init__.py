"""Deployment artifacts from a plan: a registry of targets (targets.py), written atomically or
compared with what a directory holds (files.py). Templates live in the top-level templates/."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from m31ctl.deployment import Deployment
from m31ctl.errors import InputError
from m31ctl.render.targets import RENDERERS, SINGLE_HOST, Artifact, render_monitoring, single_host_only

Renderer = Callable[[Deployment], list[Artifact]]


def _loaded(module: str, name: str) -> Renderer:
    """`module`'s renderer `name`, imported when first called: render/pd.py and pd_host.py (and with
    them the pair's containers, docker run and router) load for a P/D plan alone."""

    def render(deployment: Deployment) -> list[Artifact]:
        renderer: Renderer = getattr(importlib.import_module(module), name)
        return renderer(deployment)

    return render


# The targets that render a prefill/decode plan (render/pd.py, pd_host.py); the others refuse
# it. Compose, the script and systemd check themselves that the pair fits one host; monitoring
# reads the group (observability.py).
PD_RENDERERS: dict[str, Renderer] = {
    "script": _loaded("m31ctl.render.pd_host", "render_script_pd"),
    "compose": _loaded("m31ctl.render.pd", "render_compose_pd"),
    "k8s": _loaded("m31ctl.render.pd", "render_k8s_pd"),
    "systemd": _loaded("m31ctl.render.pd_host", "render_systemd_pd"),
    "monitoring": render_monitoring,
}


def get_target(name: str) -> Renderer:
    """The renderer for `name`. A single-host target refuses a layout wider than one host."""
    if name not in RENDERERS:
        raise InputError(f"unknown --target {name!r}", hint=f"choose one of: {', '.join(RENDERERS)}")
    renderer = RENDERERS[name]

    def render(deployment: Deployment) -> list[Artifact]:
        if deployment.disaggregated is not None:
            # A P/D plan: its own registry (render/pd.py); a target without an entry refuses.
            pd_renderer = PD_RENDERERS.get(name)
            if pd_renderer is None:
                from m31ctl.render.pd import refuse_pd  # lazy: as in PD_RENDERERS

                refuse_pd(name, tuple(PD_RENDERERS))
            assert pd_renderer is not None
            return pd_renderer(deployment)
        if name in SINGLE_HOST:
            single_host_only(deployment, name)
        return renderer(deployment)

    return render


__all__ = ["Artifact", "Renderer", "get_target"]
