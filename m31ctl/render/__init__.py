"""Deployment artifacts from a plan: a registry of targets (targets.py), written atomically or
compared with what a directory holds (files.py). Templates live in the top-level templates/."""

from __future__ import annotations

from collections.abc import Callable

from m31ctl.deployment import Deployment
from m31ctl.errors import InputError
from m31ctl.render.targets import RENDERERS, SINGLE_HOST, Artifact, single_host_only

Renderer = Callable[[Deployment], list[Artifact]]


def get_target(name: str) -> Renderer:
    """The renderer for `name`. A single-host target refuses a layout wider than one host."""
    if name not in RENDERERS:
        raise InputError(f"unknown --target {name!r}", hint=f"choose one of: {', '.join(RENDERERS)}")
    renderer = RENDERERS[name]

    def render(deployment: Deployment) -> list[Artifact]:
        if name in SINGLE_HOST:
            single_host_only(deployment, name)
        return renderer(deployment)

    return render


__all__ = ["Artifact", "Renderer", "get_target"]
