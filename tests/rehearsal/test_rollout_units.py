"""The rollout rehearsal's own logic, fast and without vLLM: the pod deletion as killContainer
does it (termination.py) on a stand-in for the Engine API, the Service's endpoints and its
address (endpoints.py) on real sockets, the rendered strategy and preStop read back from the
manifest (pods.py), the stream's size from the twin's clocks, and the verdict (rollout_proof.py).
The same on real vLLM: test_rehearse_rollout.py."""

from __future__ import annotations

import json
import socket
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

import pytest

from m31ctl.errors import InputError
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.rehearsal import termination
from m31ctl.rehearsal.endpoints import Endpoints, ServiceAddress
from m31ctl.rehearsal.kubelet import Kubelet
from m31ctl.rehearsal.prepared import prepare
from m31ctl.rehearsal.result import RehearsalResult
from m31ctl.rehearsal.rollout_proof import RolloutOutcome, from_record, stream_tokens
from m31ctl.rehearsal.session import Options
from m31ctl.rehearsal.twin import TOKEN_ENV
from m31ctl.timeline import ENDPOINT_REMOVAL_S
from tests.conftest import ROOT, run_cli
from tests.support.rehearsal import DP_DENSE, RWX

CAPTURES = ROOT / "tests" / "fixtures" / "rehearsal"


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Api:
    """The Engine calls a deletion makes: exec (the preStop hook takes `hook_s` of the clock),
    kill with a signal, inspect (running until `ends_after_term_s` past SIGTERM, or SIGKILL)."""

    def __init__(self, clock: _Clock, hook_s: float, ends_after_term_s: float | None):
        self.clock, self.hook_s, self.ends_after = clock, hook_s, ends_after_term_s
        self.calls: list[tuple[str, Any]] = []
        self.term_at: float | None = None
        self.killed = False

    def exec_create(self, container: str, argv: list[str]) -> dict[str, str]:
        self.calls.append(("exec", tuple(argv)))
        return {"Id": "x"}

    def exec_start(self, _id: str, demux: bool) -> tuple[bytes, bytes]:
        self.clock.now += self.hook_s
        return b"", b""

    def exec_inspect(self, _id: str) -> dict[str, int]:
        return {"ExitCode": 0}

    def kill(self, name: str, signal: str = "SIGKILL") -> None:
        self.calls.append(("kill", signal))
        if signal == "SIGTERM":
            self.term_at = self.clock.now
        else:
            self.killed = True

    def inspect_container(self, name: str) -> dict[str, Any]:
        self.clock.now += 0.5  # each look takes the poll's time
        ended = self.killed or (
            self.term_at is not None
            and self.ends_after is not None
            and self.clock.now >= self.term_at + self.ends_after
        )
        code = 137 if self.killed else 0
        return {
            "State": {"Status": "exited" if ended else "running", "ExitCode": code},
            "NetworkSettings": {},
        }


class _Client:
    def __init__(self, api: _Api):
        self.api = api


@pytest.fixture(autouse=True)
def _no_sleep(monkeypatch):
    monkeypatch.setattr(termination.interrupt, "sleep", lambda _s: None)


def _pod(grace_s: int = 45, pre_stop: tuple[str, ...] = ("sleep", "10")):
    plan = resolve(PlanRequest(hardware=simulated("cpu")))
    pod = prepare(plan, Options(rollout=True)).manifest.serving
    assert pod is not None
    return pod._replace(grace_s=grace_s, pre_stop=pre_stop)


def _delete(hook_s: float, ends_after: float | None, **pod: Any):
    clock = _Clock()
    api = _Api(clock, hook_s, ends_after)
    kubelet = Kubelet(_Client(api), "s", "n", clock=clock)
    state = kubelet_state(kubelet, _pod(**pod))
    endpoints = Endpoints(clock)
    endpoints.add(state.pod.pod, "10.0.0.1", 8000)
    done = termination.delete_pod(kubelet, state, endpoints)
    return done, api, endpoints


def kubelet_state(kubelet: Kubelet, pod):
    from m31ctl.rehearsal.kubelet import PodState, container_name

    return PodState(pod, container_name(kubelet.session, pod), kubelet.clock())


def test_a_deletion_drops_the_endpoint_runs_the_hook_as_written_then_sigterm():
    done, api, endpoints = _delete(hook_s=10.0, ends_after=3.0)
    assert endpoints.listed() == ()
    assert api.calls[0] == ("exec", ("sleep", "10")) and ("kill", "SIGTERM") in api.calls
    assert ("kill", "SIGKILL") not in api.calls
    assert done.pre_stop_s == 10.0 and done.sigterm_s == 10.0
    assert done.drained and not done.killed and done.exit_code == 0


def test_the_grace_period_counts_the_hook_and_sigkill_ends_it():
    # grace 45 s from the deletion, the hook took 10: SIGKILL 35 s after SIGTERM, not 45.
    done, api, _ = _delete(hook_s=10.0, ends_after=None)
    assert done.killed and not done.drained and done.exit_code == 137
    assert api.calls[-1] == ("kill", "SIGKILL")
    assert done.ended_s is not None and 45.0 <= done.ended_s < 47.0


def test_a_hook_longer_than_the_grace_leaves_the_kubelets_two_second_minimum():
    done, _api, _ = _delete(hook_s=30.0, ends_after=None, grace_s=20)
    assert done.sigterm_s == 30.0 and done.killed
    assert done.ended_s is not None and done.ended_s - done.sigterm_s < termination.MINIMUM_GRACE_S + 1.5


def test_no_hook_means_sigterm_at_once():
    done, api, _ = _delete(hook_s=10.0, ends_after=2.0, pre_stop=())
    assert done.pre_stop_s is None and done.sigterm_s == 0.0 and done.drained
    assert not any(call[0] == "exec" for call in api.calls)


def test_the_rendered_strategy_prestop_and_grace_are_read_back():
    for rollout, kind in (("surge", "RollingUpdate"), ("recreate", "Recreate")):
        plan = resolve(PlanRequest(hardware=simulated("cpu"), sets=(f"kubernetes.rollout={rollout}",)))
        prepared = prepare(plan, Options(rollout=True))
        pod, spec = prepared.manifest.serving, prepared.rollout
        assert pod is not None and spec is not None
        assert pod.pre_stop == ("sleep", str(ENDPOINT_REMOVAL_S)) and pod.grace_s == spec.grace_s
        assert spec.strategy.kind == kind
        if kind == "RollingUpdate":
            assert (spec.strategy.max_surge, spec.strategy.max_unavailable) == (1, 0)
        assert spec.strategy.progress_deadline_s > spec.start_s
        # The stream outlasts the preStop wait and ends inside vLLM's drain.
        seconds = stream_tokens(spec) * spec.token_s
        assert spec.pre_stop_s < seconds < spec.pre_stop_s + spec.drain_s
        env = prepared.twin.plan.settings.runtime.env
        assert env[TOKEN_ENV] == f"{spec.token_s:g}"


def test_a_rollout_of_a_layout_that_is_not_one_deployment_is_refused():
    plan = resolve(PlanRequest(hardware=simulated("b300x4"), sets=(*DP_DENSE, *RWX)))  # fmt: skip
    with pytest.raises(InputError, match="--rollout"):
        prepare(plan, Options(rollout=True))


def test_rehearse_rollout_of_a_p_d_plan_is_one_line_and_exit_2():
    """`m31ctl rehearse --rollout` reaches Options.rollout: a P/D pair rolls by rules it does not
    emulate, refused before any container starts."""
    refused = run_cli("rehearse", "--hardware", "cpu", "--variant", "pd", "--rollout")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert (
        "--rollout rehearses a Deployment's rollout" in refused.stderr and "Traceback" not in refused.stderr
    )


def _result_with(outcome: RolloutOutcome) -> RehearsalResult:
    return RehearsalResult(
        served=True, plan_hash="p", twin_hash="t", layout="TP1", changes=(), nodes=(), probes=(),
        endpoint="http://127.0.0.1:1", completions=2, smoke=None, failure=None, failing_node=None,
        error_line=None, cause=None, not_emulated=(), timings_s={"total_s": 1.0}, cleaned=True, leftovers=(),
        kept=False, rollout=outcome,
    )  # fmt: skip


def test_the_text_report_prints_the_rollouts_proof():
    from m31ctl.cli.rehearsing import summary

    outcome = from_record(json.loads((CAPTURES / "rollout-surge" / "outcome.json").read_text()))[0]
    text = summary(_result_with(outcome))
    assert "rollout (RollingUpdate): proven" in text and "0 of 303 requests failed" in text


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = self.server.server_address[1].to_bytes(4, "big")  # type: ignore[union-attr]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def test_the_service_sends_new_connections_to_listed_pods_and_refuses_without_one():
    servers = [HTTPServer(("127.0.0.1", 0), _Hello) for _ in range(2)]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoints = Endpoints()
    service = ServiceAddress(endpoints)
    try:
        endpoints.add("a", "127.0.0.1", servers[0].server_address[1])
        endpoints.add("b", "127.0.0.1", servers[1].server_address[1])
        answered = {urllib.request.urlopen(service.url, timeout=5).read() for _ in range(4)}
        assert len(answered) == 2  # both pods got connections
        endpoints.remove("a")
        after = endpoints.clock()
        for _ in range(3):
            urllib.request.urlopen(service.url, timeout=5).read()
        assert endpoints.sent_to("a", after) == 0 and endpoints.sent_to("b", after) == 3
        endpoints.remove("b")
        with pytest.raises((OSError, ConnectionError)):
            urllib.request.urlopen(service.url, timeout=5).read()
        endpoints.add("a", "127.0.0.1", servers[0].server_address[1])
        assert len(endpoints.gaps()) == 1
    finally:
        service.close()
        for server in servers:
            server.shutdown()


def test_an_established_connection_outlives_its_pods_removal():
    listener = socket.create_server(("127.0.0.1", 0))
    endpoints = Endpoints()
    endpoints.add("a", "127.0.0.1", listener.getsockname()[1])
    service = ServiceAddress(endpoints)
    try:
        port = int(service.url.rsplit(":", 1)[1])
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        upstream, _ = listener.accept()
        endpoints.remove("a")  # deleted: new connections go nowhere, this one goes on
        upstream.sendall(b"still here")
        assert client.recv(64) == b"still here"
        client.close()
        upstream.close()
    finally:
        service.close()
        listener.close()
