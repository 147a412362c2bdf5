"""Where the shipped recipes and templates are: inside the wheel, or in the repository."""

from __future__ import annotations

from functools import cache
from pathlib import Path

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
