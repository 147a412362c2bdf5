"""What a rehearsal found, as typed data (`rehearse --json` prints `to_json()`, one object), and
how it is assembled from what happened: the run, the nodes as they ended, the cleanup."""

from __future__ import annotations

from typing import Any, NamedTuple

from m31ctl.rehearsal.kubelet import PodState
from m31ctl.rehearsal.logs import root_cause
from m31ctl.rehearsal.pairing import PairingOutcome
from m31ctl.rehearsal.prepared import Prepared
from m31ctl.rehearsal.rollout_proof import RolloutOutcome
from m31ctl.rehearsal.twin import Change

NOT_EMULATED = {
    "NetworkPolicy": "NetworkPolicy (not enforced: one private Docker network)",
    "PersistentVolumeClaim": "",
    "Service": "",
    "LeaderWorkerSet": "",
    "Deployment": "",
}
# Never emulated: every pod runs on this one host.
SCHEDULING = "scheduling (nodeSelector, tolerations, GPU/RDMA resources, cpu and memory requests)"


class Served(NamedTuple):
    """The serving proof: completions sent through the serving pod, how many were answered, and
    smoke's report (served/smoke.py) as data."""

    endpoint: str
    sent: int
    answered: int
    smoke: dict[str, Any]
    unanswered: str = ""  # the first completion not answered, as it came back ("" : none)

    @property
    def ok(self) -> bool:
        return self.answered == self.sent and bool(self.smoke.get("ok"))


class Run(NamedTuple):
    """What happened between the first container and the cleanup."""

    states: list[PodState]
    why: str | None  # why it did not serve; None when it served
    served: Served | None
    pairing: PairingOutcome | None = None  # a P/D plan's proof (pairing.py)
    # The pod clients reach (the API Service's; a P/D plan's router), once the pods started.
    serving: PodState | None = None
    rollout: RolloutOutcome | None = None  # --rollout's proof (rollout_proof.py)


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
    # An image change rolled out by the rendered strategy, the old pod drained (Options.rollout).
    rollout: RolloutOutcome | None = None

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
        data["rollout"] = self.rollout.to_json() if self.rollout else None
        return data


def probe_outcomes(states: list[PodState]) -> tuple[ProbeOutcome, ...]:
    return tuple(
        ProbeOutcome(
            s.pod.pod,
            p.probe.describe(),
            p.attempts,
            bool(p.passes) and not p.failures_in_row,
            p.first_pass_s,
            p.last_error,
        )
        for s in states
        for p in s.probes
    )


def failing_node(nodes: tuple[NodeOutcome, ...]) -> NodeOutcome | None:
    """The node to blame: one that ended badly, else one whose error line names a cause of its
    own (a worker's NotImplementedError rather than the leader's "Worker failed, see above"),
    else the first with an error line."""
    ended = [n for n in nodes if n.exit_code not in (None, 0)]
    rooted = [n for n in nodes if root_cause(n.error_line)]
    ranked = [n for n in ended if root_cause(n.error_line)] + ended + rooted
    return next(iter(ranked), next((n for n in nodes if n.error_line), None))


def assemble(
    prepared: Prepared,
    run: Run,
    nodes: tuple[NodeOutcome, ...],
    timings: dict[str, float],
    leftovers: tuple[str, ...],
    kept: bool,
    session: str,
) -> RehearsalResult:
    blamed = failing_node(nodes) if run.why is not None else None
    not_emulated = (
        *sorted({NOT_EMULATED.get(k, f"{k} (not emulated)") for k in prepared.manifest.kinds} - {""}),
        SCHEDULING,
    )
    return RehearsalResult(
        served=run.why is None,
        plan_hash=prepared.twin.original.hash,
        twin_hash=prepared.twin.plan.hash,
        layout=prepared.layout,
        changes=prepared.twin.changes,
        nodes=nodes,
        probes=probe_outcomes(run.states),
        endpoint=run.served.endpoint if run.served else "",
        completions=run.served.answered if run.served else 0,
        smoke=run.served.smoke if run.served else None,
        failure=run.why,
        failing_node=blamed.pod if blamed else None,
        error_line=blamed.error_line if blamed else None,
        cause=blamed.cause if blamed else None,
        not_emulated=not_emulated,
        timings_s=timings,
        cleaned=not kept and not leftovers,
        leftovers=leftovers,
        kept=kept,
        session=session,
        pairing=run.pairing,
        rollout=run.rollout,
    )
