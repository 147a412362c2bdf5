"""What a render target makes: one file's name, text and mode. Its own module so that a target
module beside targets.py (observability.py) returns the same type without importing the registry
that imports it."""

from __future__ import annotations

from typing import NamedTuple


class Artifact(NamedTuple):
    name: str
    content: str
    mode: int = 0o644
