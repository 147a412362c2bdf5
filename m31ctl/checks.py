"""One result type for every check m31ctl runs: doctor's host checks, smoke's and verify's
checks of a running server. It sits outside doctor/ and runtime/ so that both may use it (the
stages only import downwards, tests/test_architecture.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Status = Literal["ok", "warn", "fail", "skip"]


@dataclass(frozen=True)
class CheckResult:
    id: str
    title: str
    status: Status
    message: str
    remedy: str = ""
    duration_s: float = 0.0

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    def to_json(self) -> dict[str, Any]:
        """doctor's shape (smoke and verify keep their own older shapes, in their reports)."""
        return {
            "id": self.id,
            "title": self.title,
            "status": self.status,
            "message": self.message,
            "remedy": self.remedy,
            "duration_s": round(self.duration_s, 3),
        }


def judged(id: str, ok: bool | None, message: str, remedy: str = "") -> CheckResult:
    """A server check's result from its verdict: None is skip (the plan does not ask for it, or
    it could not run). Server checks have no separate title: the id is the title."""
    status: Status = "skip" if ok is None else "ok" if ok else "fail"
    return CheckResult(id, id, status, message, remedy)
