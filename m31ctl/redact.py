"""Secret values never appear in what m31ctl prints.

Secrets travel by reference (their names), but a value can still reach a message: a key with a
line break quoted back by an HTTP library, a token pasted into the wrong setting and echoed by
validation. Everything the CLI prints (errors, JSON) passes through `redact`, which replaces the
values of the secret variables in the environment, and anything shaped like a Hugging Face
token, with `***`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from m31ctl.errors import InputError

# The secrets a server reads from its environment, by name (the Deployment passes them by
# reference): the one spelling of each name.
HF_TOKEN_ENV = "HF_TOKEN"
API_KEY_ENV = "VLLM_API_KEY"
# The variables whose values are secrets (huggingface_hub also reads the older token name).
SECRET_ENV = (HF_TOKEN_ENV, "HUGGING_FACE_HUB_TOKEN", API_KEY_ENV)


def header_safe(name: str, value: str) -> str:
    """A secret that goes into an HTTP header: a line break would split the header (and some
    libraries quote the value back in their error), so it is refused before any request."""
    if "\r" in value or "\n" in value:
        raise InputError(
            f"{name} holds a line break, which no HTTP header can carry", hint="fix the variable's value"
        )
    return value


# Hugging Face user access tokens: "hf_" and 34 letters (shorter runs are matched too).
_TOKEN_SHAPES = re.compile(r"hf_[A-Za-z0-9]{16,}")
_MIN_SECRET = 4  # shorter values would blank ordinary words
MASK = "***"


def secret_values(environ: Mapping[str, str] | None = None) -> list[str]:
    env = os.environ if environ is None else environ
    values: set[str] = set()
    for name in SECRET_ENV:
        value = env.get(name) or ""
        # The whole value, and each line of it: an error may quote one line of a key with a CR/LF.
        for piece in (value, *re.split(r"[\r\n]+", value)):
            piece = piece.strip()
            if len(piece) >= _MIN_SECRET:
                values.add(piece)
    return sorted(values, key=len, reverse=True)  # longest first: no partial leftovers


def redact(text: str, environ: Mapping[str, str] | None = None) -> str:
    for value in secret_values(environ):
        text = text.replace(value, MASK)
        text = text.replace(repr(value)[1:-1], MASK)  # as quoted inside a repr() or bytes literal
    return _TOKEN_SHAPES.sub(MASK, text)


def redact_data(data: object, environ: Mapping[str, str] | None = None) -> object:
    """`redact` over every string of a JSON-able structure."""
    if isinstance(data, str):
        return redact(data, environ)
    if isinstance(data, dict):
        return {k: redact_data(v, environ) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [redact_data(v, environ) for v in data]
    return data
