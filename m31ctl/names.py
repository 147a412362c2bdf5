"""The one rule for the names m31ctl gives things: a server's name is also a Docker container
name, a systemd unit file name, a Kubernetes object name and a state-file name, so it follows
the strictest of them (a DNS-1123 label, which Kubernetes requires) and can never carry a path
separator, a newline or anything a target would interpret."""

from __future__ import annotations

import re

from m31ctl.errors import InputError

# RFC 1123 label, as Kubernetes validates object names that become DNS labels.
_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
RULE = "1-63 lowercase letters, digits and '-', starting and ending with a letter or digit"


def name_problem(value: str) -> str | None:
    """Why `value` cannot be a server name, or None when it can."""
    if _LABEL.fullmatch(value):
        return None
    return f"not a valid server name: use {RULE}"


def check_name(value: str, where: str) -> str:
    problem = name_problem(value)
    if problem:
        raise InputError(
            f"{where} {value!r} is {problem}",
            hint="it names the container, the systemd unit, the Kubernetes objects and state files",
        )
    return value
