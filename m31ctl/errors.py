"""One error hierarchy. Every error carries its exit code and a one-line message
that says what is wrong, where, and what to do; the CLI prints it and exits."""

from __future__ import annotations

import difflib
from enum import IntEnum


class ExitCode(IntEnum):
    """Exit codes, documented in the README. Stable: CI pipelines branch on them."""

    OK = 0
    CHECK_FAILED = 1  # a check ran and found a problem (doctor failure, render --check drift)
    BAD_INPUT = 2  # bad flags, recipe, override, or a rule broken
    DOCKER_UNREACHABLE = 3
    CONFLICT = 4  # a container or port we do not own is in the way
    NOT_READY = 5  # the server died or did not become ready in time
    HOST_PRECONDITION = 6  # this host cannot run the plan (GPUs, drivers, disk)
    INTERNAL = 70  # a bug in m31ctl (EX_SOFTWARE)
    INTERRUPTED = 130


class M31Error(Exception):
    """Base class. `hint` tells the user what to do next."""

    exit_code: ExitCode = ExitCode.BAD_INPUT

    def __init__(
        self,
        message: str,
        *,
        hint: str | None = None,
        where: str | None = None,
        details: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        self.where = where
        # Lines that explain the error (a dying server's last log lines); the CLI prints them
        # before the one-line message, and --json carries them.
        self.details = details

    def one_line(self) -> str:
        parts = []
        if self.where:
            parts.append(f"{self.where}: ")
        parts.append(self.message)
        if self.hint:
            parts.append(f" ({self.hint})")
        return "".join(parts)

    def __str__(self) -> str:
        return self.one_line()

    def to_json(self) -> dict[str, object]:
        return {
            "error": type(self).__name__,
            "message": self.message,
            "where": self.where,
            "hint": self.hint,
            "details": list(self.details),
            "exit_code": int(self.exit_code),
        }


class InputError(M31Error):
    """Bad flag, file, override or recipe content."""


class RuleViolation(InputError):
    """A layer overrode a value that a recipe declares mandatory."""


class UnsupportedHardware(M31Error):
    exit_code = ExitCode.HOST_PRECONDITION


class HostPreconditionError(M31Error):
    exit_code = ExitCode.HOST_PRECONDITION


class ProbeError(HostPreconditionError):
    """Every probe method failed for a reason other than 'no GPU'."""


class DockerUnreachable(M31Error):
    exit_code = ExitCode.DOCKER_UNREACHABLE


class ConflictError(M31Error):
    exit_code = ExitCode.CONFLICT


class NotReadyError(M31Error):
    exit_code = ExitCode.NOT_READY


class ServerDied(NotReadyError):
    """The server exited (or was restarted) while loading."""


class OutputError(InputError):
    """Standard output cannot be written (a full disk, an I/O error): what the command said is
    lost, so it fails as an unwritable -o FILE does (exit 2). A closed one is not this: that is
    a reader that left, the quiet exit of a closed pipe."""


class CheckFailed(M31Error):
    """A check ran and found drift or failures; not a usage error."""

    exit_code = ExitCode.CHECK_FAILED


def close_matches(word: str, candidates: list[str], n: int = 1, cutoff: float = 0.6) -> list[str]:
    """The 'did you mean' candidates for a misspelt name."""
    return difflib.get_close_matches(word, candidates, n=n, cutoff=cutoff)
