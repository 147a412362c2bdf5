"""An image change rolled out on the rehearsal's pods by the rendered strategy, as the
Deployment controller does it, under a steady load through the Service; the old pod deleted as
the kubelet deletes it (termination.py), with a stream in flight on it.

- RollingUpdate (kubernetes.rollout=surge: maxSurge 1, maxUnavailable 0): the new pod starts
  beside the old one; once its rendered probes say Ready it joins the Service's endpoints; then
  the old pod is deleted.
- Recreate: the old pod is deleted and waited for until its container has ended; then the new
  pod starts, and joins the endpoints once Ready.

The changed image is the twin's own under a second tag (`docker tag`, no registry), so the
change is the image's name alone, what a Deployment's new ReplicaSet differs by. Judged by state:
every request of the load answered (surge) or every failure inside the stretch with no endpoint,
that stretch within the stated downtime (recreate: the timeline's start, render/k8s_copies.py
ROLLOUTS); the stream on the deleted pod whole, still in flight at its SIGTERM; the container
ended on its own within the grace period; no connection to the deleted pod after its deletion.
Then the proof's own negative: the new pod deleted without its preStop hook cuts a stream the
same length. Every wait is one of the twin's clocks (Prepared.rollout), never a fixed sleep."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from m31ctl import interrupt
from m31ctl.rehearsal import docker_verbs
from m31ctl.rehearsal.endpoints import Endpoints, ServiceAddress
from m31ctl.rehearsal.kubelet import TICK_S, Kubelet, PodState, watch
from m31ctl.rehearsal.load import InFlight, LoadRequest, SteadyLoad, Streamed
from m31ctl.rehearsal.pods import PodRun, Strategy
from m31ctl.rehearsal.prepared import Prepared, RolloutRun
from m31ctl.rehearsal.session import Progress
from m31ctl.rehearsal.termination import Termination, delete_pod

# Requests the new pod must answer through the Service before the rollout counts as done.
ANSWERS_AFTER = 2
# Prompt tokens and more the stream leaves free of the context (its prompt is a few tokens).
CONTEXT_MARGIN = 64


class Drain(NamedTuple):
    """A pod's deletion with a stream in flight on it."""

    termination: Termination
    stream: Streamed | None
    in_flight_at_sigterm: bool  # the stream still ran when SIGTERM was sent

    def to_json(self) -> dict[str, Any]:
        return {"termination": self.termination.to_json(),
                "stream": self.stream.to_json() if self.stream else None,
                "in_flight_at_sigterm": self.in_flight_at_sigterm}  # fmt: skip


class RolloutOutcome(NamedTuple):
    strategy: str  # the rendered spec.strategy.type: RollingUpdate | Recreate
    image_from: str
    image_to: str
    old_pod: str
    new_pod: str
    new_ready_s: float | None  # from the new pod's start to Ready (its probes)
    requests: int  # sent through the Service during the rollout
    failed: int
    failed_with_endpoints: int  # failures of requests sent while an endpoint was listed
    failures: tuple[str, ...]  # the first few, in words
    drain: Drain | None  # the old pod's deletion
    to_old_after_deletion: int  # connections the Service sent the old pod after its deletion
    gap_s: float | None  # the longest stretch with no endpoint listed (None: none)
    stated_downtime_s: int  # 0 for a surge; recreate's: the timeline's start
    cut: Drain | None  # the negative: the new pod deleted without its preStop hook
    failure: str | None

    @property
    def ok(self) -> bool:
        return self.failure is None

    def to_json(self) -> dict[str, Any]:
        data = self._asdict()
        data["drain"] = self.drain.to_json() if self.drain else None
        data["cut"] = self.cut.to_json() if self.cut else None
        data["ok"] = self.ok
        return data


def stream_tokens(spec: RolloutRun) -> int:
    """A stream that outlasts the preStop wait and ends halfway through vLLM's drain: SIGTERM
    lands in it, with half of --shutdown-timeout left to finish it (at the paced token)."""
    wanted = math.ceil((spec.pre_stop_s + spec.drain_s / 2) / spec.token_s)
    return min(wanted, spec.max_model_len - CONTEXT_MARGIN)


def drain_with_stream(
    kubelet: Kubelet, state: PodState, endpoints: Endpoints, prepared: Prepared, pod: PodRun | None = None
) -> Drain | str:
    """Start a stream on the pod (its address: a client the Service sent there earlier), delete
    the pod once the stream's first token came; the deletion and how the stream ended, or why
    the stream never began."""
    spec = prepared.rollout
    assert spec is not None
    url = f"http://{state.ip}:{prepared.manifest.serving_port}"
    inflight = InFlight(url, prepared.served_name, stream_tokens(spec), float(spec.grace_s), kubelet.clock)
    if not inflight.started():
        streamed = inflight.result()
        return f"the stream on {state.pod.pod} never began: {streamed.error if streamed else 'no answer'}"
    termination = delete_pod(kubelet, state, endpoints, pod)
    streamed = inflight.result()
    sigterm_at = termination.deleted_at + termination.sigterm_s
    return Drain(termination, streamed, streamed is not None and streamed.ended_at > sigterm_at)


def start_ready(
    kubelet: Kubelet, pod: PodRun, spec: RolloutRun, progress: Progress
) -> tuple[PodState, str | None]:
    """The new pod started and watched by its rendered probes until Ready, within the rendered
    progressDeadlineSeconds; its state, and why not Ready."""
    progress(
        f"starting {pod.pod} ({pod.image}); Ready by its probes within {spec.strategy.progress_deadline_s} s"
    )
    state = kubelet.start(pod)
    why = watch(kubelet, [state], state, kubelet.clock() + spec.strategy.progress_deadline_s, progress)
    return state, why


def wait_answers(load: SteadyLoad, since: float, kubelet: Kubelet, bound_s: float) -> bool:
    """Until the load has ANSWERS_AFTER answers sent after `since`, within `bound_s`."""
    deadline = kubelet.clock() + bound_s
    while load.answered_since(since) < ANSWERS_AFTER:
        if kubelet.clock() > deadline:
            return False
        interrupt.sleep(TICK_S)  # Ctrl-C and SIGTERM end the wait here
    return True


class Moved(NamedTuple):
    """What the controller did: the new pod's state, the old pod's drain, why it stopped."""

    new: PodState | None
    drain: Drain | None
    why: str | None


def controller(
    kubelet: Kubelet,
    old: PodState,
    new_pod: PodRun,
    endpoints: Endpoints,
    prepared: Prepared,
    progress: Progress,
) -> Moved:
    """The Deployment controller for the rendered strategy, the endpoints controller beside it."""
    spec = prepared.rollout
    assert spec is not None
    port = prepared.manifest.serving_port
    if spec.strategy.kind == "Recreate":
        progress(
            f"recreate: deleting {old.pod.pod} (preStop, SIGTERM, grace {old.pod.grace_s} s) with a stream on it"
        )
        drained = drain_with_stream(kubelet, old, endpoints, prepared)
        if isinstance(drained, str):
            return Moved(None, None, drained)
        new, why = start_ready(kubelet, new_pod, spec, progress)
        if why is None:
            endpoints.add(new.pod.pod, new.ip, port)
        return Moved(new, drained, why)
    new, why = start_ready(kubelet, new_pod, spec, progress)
    if why is not None:  # maxUnavailable 0: the old pod keeps serving
        return Moved(new, None, why)
    endpoints.add(new.pod.pod, new.ip, port)
    progress(f"surge: {new.pod.pod} Ready and listed; deleting {old.pod.pod} with a stream on it")
    drained = drain_with_stream(kubelet, old, endpoints, prepared)
    return Moved(new, None, drained) if isinstance(drained, str) else Moved(new, drained, None)


def new_pod_of(old: PodRun, image: str) -> PodRun:
    """The changed template's pod: another name (a new ReplicaSet's), the changed image, no
    Service names (the Service is the rollout's Endpoints)."""
    name = f"{old.pod.rsplit('-', 1)[0]}-1"
    return old._replace(pod=name, hostname=name[:63], aliases=(name,), image=image)


def rolled_image(prepared: Prepared, session: str) -> str:
    name, _, tag = prepared.image.rpartition(":")
    return f"{name}:{tag}-rollout-{session}"


def verdict(outcome: RolloutOutcome, spec: RolloutRun) -> str | None:
    """What the rollout did not show, in words; None: all of it."""
    drain = outcome.drain
    if drain is None:
        return "the old pod was not deleted"
    termination, streamed = drain.termination, drain.stream
    checks = [
        (spec.strategy.kind == "Recreate" or outcome.failed == 0,
         f"{outcome.failed} of {outcome.requests} requests failed during the surge"),
        (outcome.failed_with_endpoints == 0,
         f"{outcome.failed_with_endpoints} requests failed while the Service listed a pod"),
        (streamed is not None and streamed.whole,
         f"the stream on the deleted pod was cut: {streamed and streamed._asdict()}"),
        (drain.in_flight_at_sigterm, "the stream had ended before SIGTERM (it did not prove vLLM's drain)"),
        (termination.drained,
         f"{termination.pod} did not end on its own within {termination.grace_s} s (killed: {termination.killed})"),
        (outcome.to_old_after_deletion == 0,
         f"the Service sent {outcome.to_old_after_deletion} connections to {termination.pod} after its deletion"),
        (outcome.gap_s is None or outcome.gap_s <= outcome.stated_downtime_s,
         f"no endpoint for {outcome.gap_s} s, more than the stated {outcome.stated_downtime_s} s"),
        (outcome.cut is not None and outcome.cut.stream is not None and not outcome.cut.stream.whole,
         "without its preStop hook the stream still ended whole: the proof could not fail"),
    ]  # fmt: skip
    return next((why for ok, why in checks if not ok), None)


def tally(requests: list[LoadRequest], endpoints: Endpoints) -> tuple[int, int, tuple[str, ...]]:
    """The failed requests, those sent while an endpoint was listed, and the first few's why."""
    gaps = endpoints.gaps()
    failed = [r for r in requests if not r.ok]
    listed = [r for r in failed if not any(start <= r.sent <= end for start, end in gaps)]
    return len(failed), len(listed), tuple(f"{r.detail} ({r.sent:.1f})" for r in failed[:5])


def roll_out(
    kubelet: Kubelet, prepared: Prepared, serving: PodState, progress: Progress
) -> tuple[RolloutOutcome, list[PodState]]:
    """The image change rolled out by the rendered strategy under load, then the negative; the
    outcome, and the pods it started."""
    spec = prepared.rollout
    assert spec is not None
    image = rolled_image(prepared, kubelet.session)
    new_pod = new_pod_of(serving.pod, image)
    blank = RolloutOutcome(spec.strategy.kind, prepared.image, image, serving.pod.pod, new_pod.pod, None, 0, 0,
                           0, (), None, 0, None, 0, None, None)  # fmt: skip
    refused = docker_verbs.tag_image(kubelet.client, prepared.image, image)
    if refused is not None:
        return blank._replace(failure=f"docker tag {image} failed: {refused.strip()[-300:]}"), []
    endpoints = Endpoints(kubelet.clock)
    endpoints.add(serving.pod.pod, serving.ip, prepared.manifest.serving_port)
    service = ServiceAddress(endpoints)
    load = SteadyLoad(service.url, prepared.served_name, float(spec.grace_s), kubelet.clock).start()
    progress(f"rolling out {image} ({spec.strategy.kind}) under a steady load through {service.url}")
    try:
        moved = controller(kubelet, serving, new_pod, endpoints, prepared, progress)
        if moved.why is None and not wait_answers(
            load, endpoints.changes[-1][0], kubelet, float(spec.grace_s)
        ):
            moved = moved._replace(why=f"the Service's new pod answered fewer than {ANSWERS_AFTER} requests")
        requests = load.stop()
        cut = None
        if moved.why is None and moved.new is not None:
            progress(f"the negative: {moved.new.pod.pod} deleted without its preStop hook, a stream on it")
            bare = moved.new.pod._replace(pre_stop=())
            drained = drain_with_stream(kubelet, moved.new, endpoints, prepared, bare)
            cut = None if isinstance(drained, str) else drained
    finally:
        load.stop()
        service.close()
        docker_verbs.untag_image(kubelet.client, image)
    failed, with_endpoints, failures = tally(requests, endpoints)
    gaps = [end - start for start, end in endpoints.gaps()]
    deleted = moved.drain.termination.deleted_at if moved.drain else None
    outcome = blank._replace(
        new_ready_s=moved.new.ready_s if moved.new else None,
        requests=len(requests),
        failed=failed,
        failed_with_endpoints=with_endpoints,
        failures=failures,
        drain=moved.drain,
        to_old_after_deletion=0 if deleted is None else endpoints.sent_to(serving.pod.pod, deleted),
        gap_s=round(max(gaps), 1) if gaps else None,
        stated_downtime_s=spec.start_s if spec.strategy.kind == "Recreate" else 0,
        cut=cut,
    )
    why = moved.why or verdict(outcome, spec)
    return outcome._replace(failure=why), [moved.new] if moved.new else []


def summary_lines(outcome: RolloutOutcome) -> list[str]:
    """The rollout's proof, a line a check (for `m31ctl rehearse`'s text report)."""
    lines = [f"rollout ({outcome.strategy}): {'proven' if outcome.ok else 'NOT proven'}, "
             f"{outcome.image_from} -> {outcome.image_to}"]  # fmt: skip
    lines.append(f"  load through the Service: {outcome.failed} of {outcome.requests} requests failed"
                 + (f" ({outcome.failed_with_endpoints} while a pod was listed)" if outcome.failed else ""))  # fmt: skip
    if outcome.gap_s is not None or outcome.stated_downtime_s:
        lines.append(
            f"  no endpoint for {outcome.gap_s or 0:g} s (stated downtime: {outcome.stated_downtime_s} s)"
        )
    for what, drain in (("drain", outcome.drain), ("without preStop", outcome.cut)):
        if drain is None:
            continue
        t, s = drain.termination, drain.stream
        ended = f"ended {t.ended_s} s after deletion, exit {t.exit_code}" + (
            ", SIGKILLed" if t.killed else ""
        )
        streamed = "no stream" if s is None else (f"stream {s.tokens} of {s.asked} tokens, finish_reason "
                                                  f"{s.finish_reason}" + (f", {s.error}" if s.error else ""))  # fmt: skip
        lines.append(
            f"  {what}: {t.pod} preStop {t.pre_stop_s} s, SIGTERM at {t.sigterm_s} s, {ended}; {streamed}"
        )
    if outcome.drain is not None:
        lines.append(
            f"  after the deletion the Service sent {outcome.to_old_after_deletion} connections to {outcome.old_pod}"
        )
    if outcome.failure:
        lines.append(f"  failure: {outcome.failure}")
    return lines


def record(outcome: RolloutOutcome, spec: RolloutRun) -> dict[str, Any]:
    """A real run's outcome and the clocks it was judged by, every field as measured (to_json
    leaves the clocks' moments out): what from_record reads back to judge it again (a capture)."""

    def drain(d: Drain | None) -> dict[str, Any] | None:
        if d is None:
            return None
        stream = d.stream._asdict() if d.stream else None
        return {
            "termination": d.termination._asdict(),
            "stream": stream,
            "in_flight_at_sigterm": d.in_flight_at_sigterm,
        }

    data = {**outcome._asdict(), "drain": drain(outcome.drain), "cut": drain(outcome.cut)}
    return {"spec": {**spec._asdict(), "strategy": spec.strategy._asdict()}, "outcome": data}


def from_record(data: dict[str, Any]) -> tuple[RolloutOutcome, RolloutRun]:
    """record's value read back: the outcome and the clocks, as the run had them."""

    def drain(d: dict[str, Any] | None) -> Drain | None:
        if d is None:
            return None
        t = d["termination"]
        termination = Termination(**{**t, "pre_stop": tuple(t["pre_stop"])})
        stream = Streamed(**d["stream"]) if d["stream"] else None
        return Drain(termination, stream, bool(d["in_flight_at_sigterm"]))

    spec = data["spec"]
    run = RolloutRun(**{**spec, "strategy": Strategy(**spec["strategy"])})
    o = data["outcome"]
    outcome = RolloutOutcome(
        **{**o, "failures": tuple(o["failures"]), "drain": drain(o["drain"]), "cut": drain(o["cut"])}
    )
    return outcome, run
