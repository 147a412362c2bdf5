"""Byte sizes as settings spell them (`64g`, `512m`, `1Gi`): one parser for every consumer.

Docker reads `64g` as 64 GiB, and Kubernetes needs the same amount as `64Gi`; both are
derived from the bytes this module parses, so a value is checked once, at plan time.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

# Docker's units are binary (units.RAMInBytes): k, m, g, t = 2^10, 2^20, 2^30, 2^40.
_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_SIZE = re.compile(r"^(?P<number>[0-9]{1,12})(?P<unit>[kmgt]?)(?:i?b)?$")
_K8S_SUFFIX = {"k": "Ki", "m": "Mi", "g": "Gi", "t": "Ti"}
EXAMPLES = "a whole number with an optional unit k, m, g or t (binary), such as 64g or 512m"


def parse_size(text: str) -> int:
    """Bytes in `text`; ValueError naming the accepted forms otherwise."""
    match = _SIZE.match(text.strip().lower())
    if match is None:
        raise ValueError(f"{text!r} is not a size: use {EXAMPLES}")
    return int(match["number"]) * _UNITS[match["unit"]]


def k8s_quantity(text: str) -> str:
    """The same amount as a Kubernetes quantity (`64g` -> `64Gi`)."""
    match = _SIZE.match(text.strip().lower())
    if match is None:
        raise ValueError(f"{text!r} is not a size: use {EXAMPLES}")
    return match["number"] + _K8S_SUFFIX.get(match["unit"], "")


def quantity_bytes(quantity: str) -> int:
    """The bytes of a quantity k8s_quantity wrote (`64Gi` -> 64 GiB): its inverse, for what reads
    a rendered manifest back (the rehearsal sizes a pod's memory-backed emptyDir with it)."""
    for unit, suffix in _K8S_SUFFIX.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * _UNITS[unit]
    return int(quantity)


def _checked(text: str) -> str:
    parse_size(text)
    return text


# A settings field holding a size: validated when the plan is resolved, kept as written.
Size = Annotated[str, AfterValidator(_checked)]
