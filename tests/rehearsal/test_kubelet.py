"""The emulated kubelet's own verbs on a pod's container (m31ctl/rehearsal/kubelet.py), on a
stand-in for the Engine API's low-level client: an init container waited for by looking at its
state, within its deadline; a kill judged by the container's state, not by `docker kill`
returning; a start in place. The same verbs against the real Engine: test_rehearsal_client.py,
test_pair_faults.py."""

from __future__ import annotations

from typing import Any

import pytest

from m31ctl.rehearsal import kubelet as kubelet_module
from m31ctl.rehearsal.kubelet import Kubelet
from m31ctl.rehearsal.pods import PodRun


class _Api:
    """The calls the kubelet makes, answering each look with the next scripted (status, code)."""

    def __init__(self, looks: list[tuple[str, int]]):
        self.looks, self.calls = looks, []  # type: ignore[var-annotated]

    def create_host_config(self, **kw: Any) -> dict[str, Any]:
        return kw

    def create_endpoint_config(self, **kw: Any) -> dict[str, Any]:
        return kw

    def create_networking_config(self, endpoints: dict[str, Any]) -> dict[str, Any]:
        return endpoints

    def create_container(self, **kw: Any) -> dict[str, Any]:
        self.calls.append(("create", kw["name"]))
        return {"Id": kw["name"]}

    def start(self, name: str) -> None:
        self.calls.append(("start", name))

    def kill(self, name: str) -> None:
        self.calls.append(("kill", name))

    def inspect_container(self, name: str) -> dict[str, Any]:
        status, code = self.looks.pop(0) if len(self.looks) > 1 else self.looks[0]
        networks = {"net": {"IPAddress": "10.1.2.3"}}
        return {"State": {"Status": status, "ExitCode": code}, "NetworkSettings": {"Networks": networks}}


class _Client:
    def __init__(self, looks: list[tuple[str, int]]):
        self.api = _Api(looks)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0  # each look a second later
        return self.now


def _pod(init: bool) -> PodRun:
    return PodRun(
        pod="web-0", container="download" if init else "web", role="server", worker_index=0, image="img",
        command=("true",), args=None, env=(), secrets=(), volumes=(), ports=(), probes=(), hostname="web-0",
        aliases=(), cap_add=(), unconfined=False, ipc_host=False, init=init,
    )  # fmt: skip


@pytest.fixture(autouse=True)
def _no_waiting(monkeypatch):
    monkeypatch.setattr(kubelet_module.interrupt, "sleep", lambda _s: None)


def test_an_init_container_is_looked_at_until_it_ends_while_the_others_are_probed():
    client = _Client([("running", 0), ("running", 0), ("exited", 0)])
    between: list[int] = []
    state = Kubelet(client, "s1", "net", clock=_Clock()).run_to_completion(
        _pod(init=True), 600, meanwhile=lambda: between.append(1)
    )
    assert (state.status, state.exit_code, len(between)) == ("exited", 0, 2)
    assert ("kill", state.name) not in client.api.calls


def test_an_init_container_past_its_deadline_is_killed_and_reads_minus_one():
    client = _Client([("running", 0)])
    state = Kubelet(client, "s1", "net", clock=_Clock()).run_to_completion(_pod(init=True), 5)
    assert (state.status, state.exit_code) == ("exited", -1)
    assert ("kill", state.name) in client.api.calls


def test_a_kill_is_judged_by_the_containers_state_and_a_start_in_place_runs_it_again():
    client = _Client([("running", 0), ("running", 0), ("exited", 137)])
    kubelet = Kubelet(client, "s1", "net", clock=_Clock())
    state = kubelet.start(_pod(init=False))
    assert state.status == "running"
    assert kubelet.kill_until_ended(state, 60) is None
    assert (state.status, state.exit_code) == ("exited", 137)
    assert kubelet.start_in_place(state) is None and state.status == "running"
    assert client.api.calls[-1] == ("start", state.name)


def test_a_container_that_outlives_its_kill_bound_says_so():
    client = _Client([("running", 0)])
    kubelet = Kubelet(client, "s1", "net", clock=_Clock())
    state = kubelet.start(_pod(init=False))
    assert kubelet.kill_until_ended(state, 3) == f"{state.name} still runs 3 s after SIGKILL"
