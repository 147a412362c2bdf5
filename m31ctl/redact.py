"""Secret values never appear in what m31ctl prints.

Secrets travel by reference (their names), but a value can still reach a message: a key with a
line break quoted back by an HTTP library, a token pasted into the wrong setting and echoed by
validation. Everything the CLI prints (errors, JSON, drift reports) passes through `redact`,
which replaces with `***` the values of the secret variables in the environment, the value that
follows a secret flag (`--api-key VALUE`, however vLLM would spell it) or a secret variable's
name (`HF_TOKEN=VALUE`), and anything shaped like an access token or key.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from m31ctl import vllm_argv as argv
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


# vLLM flags that carry a secret by value (settings refuse them; see `secret_flag`).
SECRET_FLAGS = ("--api-key", "--hf-token")


def secret_flag(arg: str) -> str | None:
    """The secret flag that the argument `arg` sets when vLLM parses it, or None, read with vLLM's
    argv grammar (m31ctl/vllm_argv.py): `_` and `-` alike, `--flag=value`, and any prefix of a
    secret flag, even one vLLM would find ambiguous: `--api_key`, `--hf_token=x` and `--api-k`
    all set a secret. Case is folded too, which refuses spellings vLLM would reject anyway: safe,
    and one rule fewer to get wrong."""
    spelled = argv.spell(arg, fold_case=True)
    if spelled is None:
        return None
    return argv.prefix_of(spelled.name, SECRET_FLAGS)


# Shapes of access tokens and keys, whatever field they were pasted into: Hugging Face ("hf_" and
# 34 letters; shorter runs too), OpenAI-style "sk-" keys (what vLLM's --api-key examples use),
# GitHub, Slack and AWS access keys, JSON Web Tokens, and PEM private keys.
_TOKEN_SHAPES = re.compile(
    r"hf_[A-Za-z0-9]{16,}"
    r"|\bsk-[A-Za-z0-9_-]{16,}"
    r"|\bgh[pousr]_[A-Za-z0-9]{20,}|\bgithub_pat_[A-Za-z0-9_]{20,}"
    r"|\bxox[abprs]-[A-Za-z0-9-]{10,}"
    r"|\bAKIA[0-9A-Z]{16}\b"
    r"|\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"
    r"|-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)",
    re.DOTALL,
)
# "Authorization: Bearer TOKEN" as an HTTP library may quote it: the scheme stays, the token goes.
_BEARER = re.compile(r"(?i)(\bbearer\s+)[A-Za-z0-9._~+/-]{8,}=*")
# A secret variable's value after its name: HF_TOKEN=VALUE, {"HF_TOKEN": "VALUE"}, 'HF_TOKEN': 'VALUE'.
_SECRET_ASSIGNMENT = re.compile(
    r"(?<![A-Za-z0-9_])(?P<head>(?:" + "|".join(SECRET_ENV) + r")(?:=|(?P<q>['\"])\s*:\s*(?P=q)?))"
    r"(?P<value>'[^']*'|\"[^\"]*\"|[^\s'\",;}\])]+)"
)
# Any flag, and then what may follow it as its value: `=V`, ` V`, and the `', '` or `", "` between
# two items of a quoted list (a repr or JSON of argv). A value is quoted whole or runs to a delimiter.
_FLAG = re.compile(r"--[A-Za-z][\w-]*")
_FLAG_VALUE = re.compile(
    r"(?:=|[ \t]+|(?P<q>['\"])\s*,\s*(?P=q)|\s*,\s*)(?P<value>'[^']*'|\"[^\"]*\"|[^\s'\",\])}]+)"
)
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
    return _redacted(text, secret_values(environ))


def _redacted(text: str, values: list[str]) -> str:
    for value in values:
        text = text.replace(value, MASK)
        text = text.replace(repr(value)[1:-1], MASK)  # as quoted inside a repr() or bytes literal
    text = _TOKEN_SHAPES.sub(MASK, text)
    text = _BEARER.sub(lambda m: m.group(1) + MASK, text)
    text = _SECRET_ASSIGNMENT.sub(lambda m: m.group("head") + MASK, text)
    return _mask_flag_values(text)


def _mask_flag_values(text: str) -> str:
    """Mask the value that follows each secret flag, in any of vLLM's spellings."""
    if "--" not in text:
        return text
    pieces: list[str] = []
    done = 0
    for flag in _FLAG.finditer(text):
        if flag.start() < done or secret_flag(flag.group()) is None:
            continue
        found = _FLAG_VALUE.match(text, flag.end())
        if found is None or found.group("value").startswith("--"):
            continue  # no value, or the next flag: nothing of the secret's is here
        pieces.append(text[done : found.start("value")] + MASK)
        done = found.end("value")
    return "".join(pieces) + text[done:] if pieces else text


def _secret_key(key: object) -> bool:
    """A mapping key whose value is a secret: a secret variable (also as the last part of a
    dotted setting, `runtime.env.HF_TOKEN`) or, undotted, a secret flag's name (`api_key`,
    `hf-token`). A dotted setting named like a flag is m31ctl's own (`runtime.api_key`, a
    switch whose provenance is mapped to its source), never a secret."""
    if not isinstance(key, str):
        return False
    name = key.rsplit(".", 1)[-1]
    if name.upper() in SECRET_ENV:
        return True
    return "." not in key and "--" + name.replace("_", "-").lower() in SECRET_FLAGS


def redact_setting(key: str, value: object, environ: Mapping[str, str] | None = None) -> object:
    """A setting's value as it may be shown: masked whole under a secret key
    (`runtime.env.HF_TOKEN`), else redacted like any data."""
    masked = redact_data({key: value}, environ)
    return masked[key] if isinstance(masked, dict) else masked


def redact_data(data: object, environ: Mapping[str, str] | None = None) -> object:
    """`redact` over every string of a JSON-able structure; besides, the string value of a secret
    key (`{"HF_TOKEN": ...}`) and the item after a secret flag in a list (argv) are masked whole.
    The secret values are read from the environment once for the whole structure (a plan's JSON
    has about 200 strings)."""
    return _redacted_data(data, secret_values(environ))


def _redacted_data(data: object, values: list[str]) -> object:
    if isinstance(data, str):
        return _redacted(data, values)
    if isinstance(data, dict):
        return {
            k: MASK if _secret_key(k) and isinstance(v, str) and v else _redacted_data(v, values)
            for k, v in data.items()
        }
    if isinstance(data, (list, tuple)):
        out: list[object] = []
        for index, item in enumerate(data):
            previous = data[index - 1] if index else None
            follows_flag = isinstance(previous, str) and "=" not in previous and secret_flag(previous)
            secret = follows_flag and isinstance(item, str) and not item.startswith("--")
            out.append(MASK if secret else _redacted_data(item, values))
        return out
    return data
