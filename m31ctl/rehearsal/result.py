"""What a rehearsal found, as typed data (`rehearse --json` prints `to_json()`, one object)."""

from __future__ import annotations

from typing import Any, NamedTuple

from m31ctl.rehearsal.pairing import PairingOutcome
from m31ctl.rehearsal.twin import Change


class ProbeOutcome(NamedTuple):
    pod: str
    probe: str  # e.g. "readiness exec python3", "startup GET :8000/health"
    attempts: int
    passed: bool
    first_pass_s: float | None
    last_error: str


class NodeOutcome(NamedTuple):
    pod: str
    role: str  # leader | worker | server
    worker_index: int
    container: str
    address: str  # the container's IP on the rehearsal network
    command: tuple[str, ...]  # as the kubelet resolved it (expanded)
    ranks: tuple[str, ...]  # vLLM's own lines about its ranks and addresses
    ready_s: float | None  # from start: the readiness probe (leader), the engine's log (worker)
    exit_code: int | None  # None: still running when the rehearsal ended
    error_line: str | None
    cause: str | None


class RehearsalResult(NamedTuple):
    served: bool
    plan_hash: str
    twin_hash: str
    layout: str  # the twin's layout in words
    changes: tuple[Change, ...]
    nodes: tuple[NodeOutcome, ...]
    probes: tuple[ProbeOutcome, ...]
    endpoint: str
    completions: int  # answered completions sent through the leader
    smoke: dict[str, Any] | None
    failure: str | None  # what failed, in words
    failing_node: str | None
    error_line: str | None  # vLLM's (or the pod's shell's) own line from the failing node
    cause: str | None
    not_emulated: tuple[str, ...]  # what the manifest declares that the rehearsal does not run
    timings_s: dict[str, float]
    cleaned: bool
    leftovers: tuple[str, ...]
    kept: bool
    session: str = ""  # the label value on everything it made: io.m31ctl.rehearsal=<session>
    # A P/D plan's proof: parity with an aggregated server, KV transfer, prefill killed and back.
    pairing: PairingOutcome | None = None

    def changes_by_reason(self) -> tuple[tuple[str, tuple[Change, ...]], ...]:
        """The changes grouped by their reason, in the order the reasons first come: a reason
        the twin gives for a whole section (every parallelism.* setting the layout's scaling
        changed) is said once, above the settings it covers."""
        groups: dict[str, list[Change]] = {}
        for change in self.changes:
            groups.setdefault(change.why, []).append(change)
        return tuple((why, tuple(changes)) for why, changes in groups.items())

    def to_json(self) -> dict[str, Any]:
        data = self._asdict()
        data["changes"] = [c.to_json() for c in self.changes]
        data["nodes"] = [n._asdict() for n in self.nodes]
        data["probes"] = [p._asdict() for p in self.probes]
        data["probes_passed"] = sum(1 for p in self.probes if p.passed)
        data["pairing"] = self.pairing.to_json() if self.pairing else None
        return data
