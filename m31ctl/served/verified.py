"""verify's report: its checks (the one CheckResult of every command), the facts the engine told,
and what the benchmark measured.

Its own module because every part of verify writes into it (verify.py runs them; the answers,
facts and load checks each add theirs) and the CLI prints it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from m31ctl.checks import CheckResult, judged


@dataclass
class VerifyReport:
    endpoint: str
    plan_hash: str
    checks: list[CheckResult] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    bench: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return not any(c.failed for c in self.checks)

    def check(self, name: str, ok: bool | None, detail: str) -> None:
        """ok None: skipped (the plan does not configure it, or it could not run)."""
        self.checks.append(judged(name, ok, detail))

    def failed(self) -> list[str]:
        return [c.id for c in self.checks if c.failed]

    def to_json(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "plan_hash": self.plan_hash,
            "ok": self.ok,
            "failed": self.failed(),
            "checks": [c.to_json() for c in self.checks],
            "facts": self.facts,
            "bench": self.bench,
        }
