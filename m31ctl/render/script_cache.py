"""The script target's Hugging Face cache: where the plan leaves runtime.hf_cache under `~` (its
built-in ~/.cache/huggingface), the script names the home of whoever runs it, expanded by its
shell when it runs on the server, not the home of whoever rendered it (docs/decisions.md,
"Renders without the hub (issues 51, 53)"). The systemd target, a root unit, uses a system
path instead (Deployment.service_hf_cache); Compose and Kubernetes are not changed here.
"""

from __future__ import annotations

import os
import shlex

from m31ctl.container import Mount
from m31ctl.deployment import HF_CACHE_IN_CONTAINER, Deployment
from m31ctl.docker_run import mount_spec
from m31ctl.render.escape import ShellExpansion, shell_word


def script_cache(deployment: Deployment) -> ShellExpansion | None:
    """The script's Hugging Face cache where the plan leaves runtime.hf_cache under `~` (its
    built-in ~/.cache/huggingface): `"$HOME"/REST`, the home of whoever runs the script, expanded
    by its shell when it runs, not the renderer's home (docs/decisions.md, "Renders without the
    hub"). None: the plan names an absolute path, which the script names as it is."""
    path = deployment.plan.settings.runtime.hf_cache
    if path != "~" and not path.startswith("~/"):
        return None
    rest = os.path.normpath(path[1:]) if path != "~" else ""
    # Two shell words side by side make one: the expansion, then the rest taken literally.
    return ShellExpansion('"$HOME"' + (shell_word(rest) if rest not in ("", "/") else ""))


# The cache's bind mount as the script's shell writes it: --mount is one CSV record, so the
# source field is quoted with its quotes doubled when the script runs, as for the token file
# (templates/_download.sh.j2). The target is a fixed path with nothing to quote.
_RUN_TIME_SOURCE = r"\"source=${HF_CACHE//\"/\"\"}\""
assert shlex.quote(HF_CACHE_IN_CONTAINER) == HF_CACHE_IN_CONTAINER


def at_run_time(deployment: Deployment, words: list[str]) -> list[str]:
    """`words` of the script with the renderer's expansion of runtime.hf_cache (a directory to
    create, a --mount of it) replaced by the script's "$HF_CACHE" (script_cache), if it has one."""
    if script_cache(deployment) is None:
        return words
    host = deployment.hf_cache
    swapped: dict[str, str] = {host: ShellExpansion('"$HF_CACHE"')}
    for read_only in (False, True):
        literal = mount_spec(Mount(host, HF_CACHE_IN_CONTAINER, read_only))
        fields = ",".join(["type=bind", _RUN_TIME_SOURCE, f"target={HF_CACHE_IN_CONTAINER}"])
        swapped[literal] = ShellExpansion(f'"{fields}{",readonly" if read_only else ""}"')
    return [swapped.get(word, word) for word in words]
