"""How the kubelet reads the strings of a container: `$(NAME)` expansion, and its escape.

Before a container starts, the kubelet expands `$(NAME)` in every `command` and `args` item, and
in each `env` value (from the variables defined before it), against the container's environment:
secrets from `secretKeyRef` included, and with service links on, `<SERVICE>_PORT` and friends of
every Service in the namespace. `$$` becomes `$`; a reference to an undefined variable stays as
written. So a plan value that holds `$(HF_TOKEN)`, or `$$(HF_TOKEN)`, would turn into the token
unless every `$` of it is doubled: `literal` does that, and `expand` is the kubelet's own rule,
ported from kubernetes/kubernetes third_party/forked/golang/expansion/expand.go (the tests apply
it to every rendered string).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

_OPERATOR = "$"
_OPENER = "("
_CLOSER = ")"


def literal(value: str) -> str:
    """`value` as the kubelet must be given it to pass it on unchanged: every `$` doubled."""
    return value.replace(_OPERATOR, _OPERATOR * 2)


def mapping_for(*contexts: Mapping[str, str]) -> Callable[[str], str]:
    """expansion.MappingFuncFor: the first context that defines a name gives its value; an
    undefined name is written back as `$(NAME)`."""

    def mapping(name: str) -> str:
        for context in contexts:
            if name in context:
                return context[name]
        return f"{_OPERATOR}{_OPENER}{name}{_CLOSER}"

    return mapping


def expand(text: str, mapping: Callable[[str], str]) -> str:
    """expansion.Expand. Go walks UTF-8 bytes and decodes one rune after a `$`; `$`, `(` and `)`
    are ASCII, which never occurs inside a multi-byte sequence, so walking code points of a str
    gives the same result."""
    out: list[str] = []
    checkpoint = 0
    cursor = 0
    while cursor < len(text):
        if text[cursor] == _OPERATOR and cursor + 1 < len(text):
            out.append(text[checkpoint:cursor])
            read, is_var, advance = _try_read_variable_name(text[cursor + 1 :])
            out.append(mapping(read) if is_var else read)
            cursor += advance
            checkpoint = cursor + 1
        cursor += 1
    return "".join(out) + text[checkpoint:]


def _try_read_variable_name(text: str) -> tuple[str, bool, int]:
    """tryReadVariableName: (what was read, whether it names a variable, how much it used);
    `text` follows a `$`."""
    first = text[0]
    if first == _OPERATOR:
        return first, False, 1  # `$$`: an escaped operator
    if first == _OPENER:
        closer = text.find(_CLOSER, 1)
        if closer != -1:
            return text[1:closer], True, closer + 1
        return _OPERATOR + _OPENER, False, 1  # an unclosed reference stays as written
    return _OPERATOR + first, False, 1  # a `$` that starts no reference
