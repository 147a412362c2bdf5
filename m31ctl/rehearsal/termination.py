"""A pod deleted as the kubelet deletes it (pkg/kubelet/kuberuntime killContainer), the
emulated kubelet's (kubelet.py) part for a pod that goes away: the pod leaves its Service's
endpoints at once (the endpoints controller sees the deletion timestamp); the preStop hook runs
inside the container, its exec command as written (the kubelet does not expand a hook's words);
the grace period (terminationGracePeriodSeconds, counted from the deletion) loses what the hook
took, but never below the kubelet's minimum of 2 s; then the runtime's StopContainer with what is
left: SIGTERM (the image's stop signal; the rehearsal image names none), and SIGKILL when that
runs out. Judged by the container's state, looked at every KILL_POLL_S."""

from __future__ import annotations

from typing import NamedTuple

from m31ctl import interrupt
from m31ctl.rehearsal.endpoints import Endpoints
from m31ctl.rehearsal.kubelet import KILL_POLL_S, Kubelet, PodState
from m31ctl.rehearsal.pods import PodRun
from m31ctl.rehearsal.prober import exec_in
from m31ctl.runtime.engine_api import refusals

# kuberuntime_container.go minimumGracePeriodInSeconds: "always give containers a minimal
# shutdown window to avoid unnecessary SIGKILLs".
MINIMUM_GRACE_S = 2.0
# How long a SIGKILLed container may take to be seen ended (the kubelet's relist and more).
KILLED_BOUND_S = 30.0


class Termination(NamedTuple):
    """One pod's deletion, each moment in seconds from it."""

    pod: str
    grace_s: int  # terminationGracePeriodSeconds as the pod was deleted with it
    pre_stop: tuple[str, ...]  # the hook's command (): none
    pre_stop_s: float | None  # how long the hook ran (None: none ran)
    pre_stop_exit: int | None
    sigterm_s: float  # when SIGTERM was sent
    ended_s: float | None  # when the container was seen ended (None: not within the bounds)
    exit_code: int | None
    killed: bool  # SIGKILL at the grace period's end
    deleted_at: float  # the kubelet's clock at the deletion (to compare with the Service's log)

    @property
    def drained(self) -> bool:
        """The container ended on its own after SIGTERM, within the grace period."""
        return not self.killed and self.ended_s is not None and self.ended_s <= self.grace_s

    def to_json(self) -> dict[str, object]:
        data = self._asdict()
        data.pop("deleted_at")
        data["drained"] = self.drained
        return data


def signal(kubelet: Kubelet, state: PodState, name: str) -> str | None:
    """`docker kill --signal NAME`: None when sent, else the engine's reason."""
    with refusals() as refused:
        kubelet.client.api.kill(state.name, signal=name)
    return refused.reason


def _until_ended(kubelet: Kubelet, state: PodState, deadline: float) -> float | None:
    """Look at the container until it has ended (the clock then) or `deadline` passed (None)."""
    while True:
        kubelet.refresh(state)
        if state.status != "running":
            return kubelet.clock()
        if kubelet.clock() > deadline:
            return None
        interrupt.sleep(KILL_POLL_S)  # Ctrl-C and SIGTERM end the wait here


def delete_pod(
    kubelet: Kubelet, state: PodState, endpoints: Endpoints, pod: PodRun | None = None
) -> Termination:
    """Delete the pod of `state` (its PodRun, or `pod`: the same with another hook or grace), as
    killContainer does: out of `endpoints` at once, the preStop hook, SIGTERM with the grace that
    is left, SIGKILL once it has run out."""
    pod = pod or state.pod
    deleted = kubelet.clock()
    endpoints.remove(state.pod.pod)
    grace = float(pod.grace_s)
    hook_s: float | None = None
    hook_exit: int | None = None
    if pod.pre_stop and grace > 0:
        # executePreStopHook: the hook is waited for at most the grace period, then abandoned.
        ran = exec_in(kubelet.client, state.name, pod.pre_stop, timeout=grace)
        hook_s, hook_exit = round(kubelet.clock() - deleted, 1), ran.code
        grace -= kubelet.clock() - deleted
    grace = max(grace, MINIMUM_GRACE_S)
    sigterm = kubelet.clock()
    refused = signal(kubelet, state, "SIGTERM")
    ended = None if refused is not None else _until_ended(kubelet, state, sigterm + grace)
    killed = False
    if ended is None:
        killed = kubelet.kill(state) is None or refused is not None
        ended = _until_ended(kubelet, state, kubelet.clock() + KILLED_BOUND_S)
    return Termination(
        pod=state.pod.pod,
        grace_s=pod.grace_s,
        pre_stop=pod.pre_stop,
        pre_stop_s=hook_s,
        pre_stop_exit=hook_exit,
        sigterm_s=round(sigterm - deleted, 1),
        ended_s=None if ended is None else round(ended - deleted, 1),
        exit_code=state.exit_code if state.status != "running" else None,
        killed=killed,
        deleted_at=deleted,
    )
