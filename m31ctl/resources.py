"""Where m31ctl's files are: the shipped recipes and templates (inside the wheel, or in the
repository), and the user's state and cache directories."""

from __future__ import annotations

import os
from functools import cache
from pathlib import Path

# The lock file `m31ctl lock` writes and `--locked` reads when no name is given.
LOCK_FILE = "m31ctl.lock"

_PKG = Path(__file__).resolve().parent


@cache
def data_dir(name: str) -> Path:
    """`recipes` or `templates`: the wheel's copy first, else the source checkout's."""
    packaged = _PKG / "_data" / name
    if packaged.is_dir():
        return packaged
    return _PKG.parent / name


def recipes_dir() -> Path:
    return data_dir("recipes")


def templates_dir() -> Path:
    return data_dir("templates")


def state_root() -> Path:
    """What m31ctl keeps between runs (native servers, triage bundles): $M31CTL_STATE_DIR, else
    $XDG_STATE_HOME/m31ctl, else ~/.local/state/m31ctl."""
    explicit = os.environ.get("M31CTL_STATE_DIR")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")) / "m31ctl"


def cache_root() -> Path:
    """What m31ctl can always rebuild (parsed recipes, engine schemas): $XDG_CACHE_HOME/m31ctl,
    else ~/.cache/m31ctl."""
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "m31ctl"
