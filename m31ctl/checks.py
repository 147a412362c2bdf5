"""One result type for every check m31ctl runs: doctor's host checks, smoke's and verify's
checks of a running server, and one JSON shape for all of them (`CheckResult.to_json`):

    {"id": "chat", "title": "chat", "status": "ok", "message": "HTTP 200, finish_reason length",
     "remedy": "", "duration_s": null}

`status` is one of CheckStatus's values (ok, warn, fail, skip); `duration_s` is null where the
check was not timed on its own (smoke's and verify's, which share one request). It sits outside
doctor/ and served/ so that both may use it (the stages only import downwards,
tests/test_architecture.py, which also checks that no other module spells a check's JSON)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class CheckStatus(StrEnum):
    """A check's verdict. Doctor's vocabulary, the richest of the three the commands had
    (verify spelt ok "pass", smoke had only a boolean); the declaration order is a summary's."""

    OK = "ok"
    WARN = "warn"  # works, but not as the plan would like (doctor only, so far)
    FAIL = "fail"
    SKIP = "skip"  # not asked for here, or could not run


@dataclass(frozen=True)
class CheckResult:
    id: str
    title: str
    status: CheckStatus
    message: str
    remedy: str = ""
    duration_s: float | None = None  # None: not timed on its own

    def __post_init__(self) -> None:
        # A status spelt as its string ("ok") is the member; a misspelt one fails here, where
        # it is made, not in a report's summary.
        object.__setattr__(self, "status", CheckStatus(self.status))

    @property
    def failed(self) -> bool:
        return self.status == CheckStatus.FAIL

    def to_json(self) -> dict[str, Any]:
        """The one JSON shape of a check, in every command's report (module docstring)."""
        return {
            "id": self.id,
            "title": self.title,
            "status": self.status.value,
            "message": self.message,
            "remedy": self.remedy,
            "duration_s": None if self.duration_s is None else round(self.duration_s, 3),
        }


def judged(id: str, ok: bool | None, message: str, remedy: str = "") -> CheckResult:
    """A server check's result from its verdict: None is skip (the plan does not ask for it, or
    it could not run). Server checks have no separate title: the id is the title."""
    status = CheckStatus.SKIP if ok is None else CheckStatus.OK if ok else CheckStatus.FAIL
    return CheckResult(id, id, status, message, remedy)
