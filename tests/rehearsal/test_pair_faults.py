"""The P/D rehearsal's fault and recovery steps (rehearsal/pairing.py) judged by state within the
plan's clocks, and the pod sandbox that keeps a killed prefill's address (issue 53: beside a busy
neighbour the fault step read "the router answered HTTP 0 ... prefill back: not serving").

The pure tests drive the steps on stand-ins for the router, the roles and decode's counters; the
Docker test proves the root cause away: a killed container's address used to vanish from the
network, so a connection to it went unanswered for up to about 70 s (the kernel's neighbour
timers), where a pod's sandbox refuses it at once, as a kubelet's pod does."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest

from m31ctl.deployment import derive
from m31ctl.hardware import simulated
from m31ctl.labels import Label
from m31ctl.plan import PlanRequest, resolve
from m31ctl.rehearsal import docker_verbs, pairing
from m31ctl.rehearsal.kubelet import Kubelet
from m31ctl.rehearsal.pods import PodRun
from m31ctl.rehearsal.prepared import pair_clocks
from m31ctl.served import kv_transfer
from m31ctl.served.http_answers import Answer

NO_ANSWER = Answer(0, b"", None, "no answer: ReadTimeout: 'timed out'")
REFUSED = Answer(500, b"prefill request failed", None)
OK = Answer(200, b"", None)
SERVED = Answer(200, b"", {"choices": [{"text": " a b"}], "usage": {"prompt_tokens": 1651}})


def _facts(transfers: int, external: int = 0, failed: int = 0) -> kv_transfer.KvTransferFacts:
    return kv_transfer.KvTransferFacts(True, transfers, transfers * 1000.0, failed, external, 0, 0)


class _Stand:
    """The router, prefill, decode and decode's counters, as scripted answers."""

    def __init__(self, router: list[Answer], prefill_health: list[Answer], transfers: list[int]):
        self.router, self.prefill_health, self.transfers = router, prefill_health, transfers
        self.events: list[str] = []

    def pair(self, clocks: pairing.PairClocks) -> pairing.Pair:
        def kill() -> None:
            self.events.append("kill")

        def start() -> None:
            self.events.append("start")

        return pairing.Pair(
            router="router", decode="decode", prefill="prefill",
            kill_prefill=kill, start_prefill=start,
            model="m", clocks=clocks,
        )  # fmt: skip

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def completion(base: str, model: str, prompt: str, timeout: float, max_tokens: int = 16) -> Answer:
            self.events.append(f"ask router ({timeout:.0f} s)")
            return self.router.pop(0)

        def health(base: str, timeout: float) -> Answer:
            return OK if base == "decode" else self.prefill_health.pop(0)

        def transfer_facts(decode: str, timeout: float) -> kv_transfer.KvTransferFacts:
            count = self.transfers.pop(0)
            return _facts(count, external=count * 100)

        monkeypatch.setattr(pairing, "completion", completion)
        monkeypatch.setattr(pairing, "health", health)
        monkeypatch.setattr(pairing, "transfer_facts", transfer_facts)
        monkeypatch.setattr(pairing, "POLL_S", 0.0)


CLOCKS = pairing.PairClocks(router_down_s=105, health_s=30, prefill_ready_s=1200, router_back_s=70)
START = pairing.PairingOutcome((), {}, "", 0, False, None, None)


def test_a_router_slow_to_answer_is_asked_again_within_its_clock_not_judged_http_0(monkeypatch):
    """The issue's run: the router's first answers did not come in time on a loaded host. The
    step asks again within the router's own clock and judges the answer that comes."""
    stand = _Stand(
        router=[NO_ANSWER, NO_ANSWER, REFUSED, Answer(503, b"", None), SERVED],
        prefill_health=[NO_ANSWER, NO_ANSWER, OK],
        transfers=[4, 4, 4, 5],  # before the kill, after it, before the restart, after serving
    )
    stand.install(monkeypatch)
    outcome = pairing.faults(stand.pair(CLOCKS), START)
    assert outcome.ok, outcome.failure
    assert outcome.prefill_down_status == 500 and outcome.decode_healthy_when_prefill_down
    assert outcome.prefill_restarted and outcome.recovered_after_s is not None
    assert "1 NIXL transfers" in outcome.recovery_transfer_verdict
    # Each ask may take what is left of its step's clock: no client timeout of its own.
    assert stand.events[:2] == ["kill", "ask router (105 s)"]
    assert pairing.fault_line(outcome).startswith("prefill killed: the router answered HTTP 500 after")


def test_no_answer_within_the_routers_clock_fails_saying_so_and_prefill_was_never_restarted(monkeypatch):
    stand = _Stand(router=[NO_ANSWER] * 100, prefill_health=[], transfers=[4])
    stand.install(monkeypatch)
    monkeypatch.setattr(pairing, "POLL_S", 0.01)
    outcome = pairing.faults(stand.pair(CLOCKS._replace(router_down_s=0.05)), START)
    assert outcome.failure is not None and "gave no answer within 0 s" in outcome.failure
    assert "start" not in stand.events and not outcome.prefill_restarted
    # The old line read "prefill back: not serving" though prefill had not been started again.
    assert pairing.fault_line(outcome).endswith("prefill back: not started again (the step before failed)")


def test_a_recovery_that_recomputes_instead_of_transferring_fails(monkeypatch):
    stand = _Stand(router=[REFUSED, SERVED], prefill_health=[OK], transfers=[4, 4, 4, 4])
    stand.install(monkeypatch)
    outcome = pairing.faults(stand.pair(CLOCKS), START)
    assert outcome.failure is not None and "not over the wire" in outcome.failure


def test_the_waits_are_the_plans_clocks():
    plan = resolve(
        PlanRequest(
            hardware=simulated("cpu"),
            variant="pd",
            sets=("disaggregation.router.health_check_interval_s=7", "runtime.startup_timeout=333"),
        )
    )
    group = derive(plan).disaggregated
    assert group is not None
    clocks = pair_clocks(group)
    assert clocks.router_down_s == pairing.ROUTER_HEALTH_FAILURES * (7 + 30)
    assert clocks.router_back_s == pairing.ROUTER_HEALTH_SUCCESSES * (7 + 30)
    assert clocks.health_s == 30 and clocks.prefill_ready_s == group.prefill.timeline.ready_s == 333


def _web_pod(image: str) -> PodRun:
    return PodRun(
        pod="web-0", container="web", role="server", worker_index=0, image=image,
        command=("python3", "-m", "http.server", "8000"), args=None, env=(), secrets=(), volumes=(),
        ports=(("http", 8000),), probes=(), hostname="web-0", aliases=("web",), cap_add=(),
        unconfined=False, ipc_host=False,
    )  # fmt: skip


def _get(ip: str, bound_s: float) -> bool:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://{ip}:8000/", timeout=5) as answer:
                return answer.status == 200
        except OSError:
            time.sleep(0.5)
    return False


@pytest.mark.docker
@pytest.mark.slow
def test_a_killed_pod_keeps_its_address_and_refuses_at_once(rehearsal_image):
    """A sandboxed pod's container killed: its address refuses a connection at once (in
    Kubernetes the pod's sandbox holds it while the kubelet restarts the container), and started
    again in place it serves at that address."""
    from m31ctl.runtime import engine_api

    client: Any = engine_api.connect(timeout=120)
    session = f"t{uuid.uuid4().hex[:7]}"
    network = f"m31ctl-rh-{session}"
    assert engine_api.create_network(client, network, {Label.REHEARSAL: session}) is None
    try:
        kubelet = Kubelet(client, session, network, sandboxed=frozenset({"web-0"}))
        state = kubelet.start(_web_pod(rehearsal_image))
        assert state.status == "running", state.start_error
        kubelet.refresh(state)
        address = state.ip
        assert address and _get(address, 60)
        assert kubelet.kill_until_ended(state, 60) is None and state.status == "exited"
        started = time.monotonic()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((address, 8000), timeout=60).close()
        assert time.monotonic() - started < 5  # refused, not left unanswered
        assert kubelet.start_in_place(state) is None and state.status == "running"
        kubelet.refresh(state)
        assert state.ip == address and _get(address, 60)
    finally:
        assert docker_verbs.remove_labelled(client, Label.REHEARSAL, session) == []


def test_the_summary_says_prefill_was_not_started_again_when_an_earlier_step_failed():
    """`rehearse`'s P/D lines: "not serving" only for a prefill that was started again and did not
    serve; one never restarted (an earlier step failed) is said to be that."""
    from m31ctl.cli.rehearsing import pairing_lines
    from m31ctl.rehearsal.pairing import PairingOutcome

    failed_early = PairingOutcome((), {}, "none", 0, False, None, "the router did not answer")
    assert "  prefill back: not started again (an earlier step failed)" in pairing_lines(failed_early)
    restarted = failed_early._replace(prefill_restarted=True)
    assert "  prefill back: not serving" in pairing_lines(restarted)


# --- the router's front (issue 49): the guard step against the real front ----------------------


class _Router(http.server.BaseHTTPRequestHandler):
    """A stand-in for vllm-router 0.1.17 in P/D mode as measured (docs/decisions.md, "The router's
    front"): it checks no key, `/remove_worker` drops a worker, `/add_worker` registers one (what a
    later router in P/D mode would do), and `/list_workers` lists them."""

    protocol_version = "HTTP/1.1"
    workers: ClassVar[list[str]] = []

    def _answer(self, status: int, data: object) -> None:
        payload = json.dumps(data).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        path, _, query = self.path.partition("?")
        url = urllib.parse.parse_qs(query).get("url", [""])[0]
        if path == "/add_worker":
            self.workers.append(url)
        elif path == "/remove_worker" and url in self.workers:
            self.workers.remove(url)
        self._answer(200, {"choices": [{"text": " a"}], "usage": {"prompt_tokens": 9}})

    def do_GET(self) -> None:
        self._answer(200, {"urls": self.workers} if self.path == "/list_workers" else {})

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def router_and_front(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    """(the router's URL, the front's URL before it); the proof's key in the environment."""
    from m31ctl.engine.router_front import Config, FrontServer

    monkeypatch.setenv("VLLM_API_KEY", "s3cret-key")
    _Router.workers[:] = ["http://prefill:8000", "http://decode:8000"]
    router = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Router)
    front = FrontServer(("127.0.0.1", 0), Config("127.0.0.1", router.server_address[1], "s3cret-key", 30))
    for server in (router, front):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{router.server_address[1]}", f"http://127.0.0.1:{front.server_address[1]}"
    for server in (front, router):
        server.shutdown()
        server.server_close()


def _guarded(base: str) -> pairing.Pair:
    return pairing.Pair(
        router=base, decode="http://decode:8000", prefill="http://prefill:8000",
        kill_prefill=lambda: None, start_prefill=lambda: None,
        model="m", clocks=CLOCKS,
        router_workers=lambda: (json.dumps(_Router.workers), None),
    )  # fmt: skip


def test_the_front_refuses_the_api_without_the_key_and_worker_management_always(router_and_front):
    _, front = router_and_front
    outcome = pairing.guard(_guarded(front), START, timeout=10)
    assert outcome.ok, outcome.failure
    assert dict(outcome.front) == {
        "completion with no key": 401,
        "completion with a wrong key": 401,
        "/add_worker with no key": 404,
        "/remove_worker with no key": 404,
        "/add_worker with the key": 404,
        "/remove_worker with the key": 404,
    }
    assert _Router.workers == ["http://prefill:8000", "http://decode:8000"]
    assert pairing.front_line(outcome).startswith("the router's front: completion with no key 401,")


def test_a_router_without_its_front_fails_the_guard_and_says_what_it_let_through(router_and_front):
    """vllm-router alone (as before issue 49): a keyless completion answered, decode taken out and
    an unregistered address registered."""
    router, _ = router_and_front
    outcome = pairing.guard(_guarded(router), START, timeout=10)
    assert outcome.failure is not None
    assert "completion with no key: HTTP 200, not 401" in outcome.failure
    assert "/add_worker with no key: HTTP 200, not 404" in outcome.failure
    assert pairing.UNREGISTERED in _Router.workers and "http://decode:8000" not in _Router.workers


def test_a_list_of_workers_that_cannot_be_read_fails_the_guard_before_asking(router_and_front):
    _, front = router_and_front
    pair = _guarded(front)._replace(router_workers=lambda: ("", "exit 1: no python3"))
    outcome = pairing.guard(pair, START, timeout=10)
    assert outcome.failure == "the router's own list of workers could not be read: exit 1: no python3"
    assert outcome.front == ()


def test_parity_is_held_against_the_prefill_role_asked_directly(monkeypatch):
    """The reference is prefill alone (no third server): a difference fails, naming the prompt."""
    answers = {"router": " a b", "prefill": " a c"}

    def completion(base: str, model: str, prompt: str, timeout: float, max_tokens: int = 16) -> Answer:
        return Answer(200, b"", {"choices": [{"text": answers[base]}], "usage": {"prompt_tokens": 9}})

    monkeypatch.setattr(pairing, "completion", completion)
    pair = _Stand([], [], []).pair(CLOCKS)
    outcome = pairing.parity(pair, START, {"short": (" a b", 9)}, timeout=10)
    assert (
        outcome.failure == "greedy output through the router differs from the prefill role's own on ['short']"
    )
    answers["prefill"] = " a b"
    assert pairing.parity(pair, START, {"short": (" a b", 9)}, timeout=10).ok


def test_a_tcp_probe_connects_and_sends_nothing_as_the_kubelet_does():
    """tcpSocket passes on a connection made, whatever the port would answer to HTTP (the
    router's front answers `GET /` with 404: run as an HTTP GET, its liveness never passed)."""
    from m31ctl.rehearsal.pods import Probe
    from m31ctl.rehearsal.prober import tcp_probe

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    probe = Probe("liveness", "tcp", "", port, (), 30, 5, 3, 0)
    try:
        assert tcp_probe("127.0.0.1", probe, 5) == (True, "connected")
    finally:
        listener.close()
    ok, why = tcp_probe("127.0.0.1", probe, 5)
    assert not ok and "refused" in why.lower()


class _Logs:
    def __init__(self, text: str) -> None:
        self.text = text

    def log(self, state: Any, tail: int | None = None) -> str:
        return self.text


def _serving_run(tmp_path: Any) -> tuple[Any, Any]:
    """A P/D plan's Prepared and a Run whose router pod serves at a made-up address."""
    from m31ctl.rehearsal.kubelet import PodState
    from m31ctl.rehearsal.prepared import prepare
    from m31ctl.rehearsal.result import Run
    from m31ctl.rehearsal.session import Options

    plan = resolve(PlanRequest(hardware=simulated("cpu"), variant="pd"))
    prepared = prepare(plan, Options(cache_dir=tmp_path))
    pods = {p.pod: p for p in prepared.manifest.pods if not p.init}
    states = [PodState(pod, f"c-{name}", 0.0, ip="10.0.0.9") for name, pod in pods.items()]
    serving = next(s for s in states if s.pod.pod == prepared.manifest.api_pod)
    return prepared, Run(states, None, None, serving=serving)


@pytest.mark.parametrize(
    ("log", "asked"),
    [
        ("... NIXL transfer failure: handshake_failed ... zmq.error.Again", 2),
        ("EngineCore encountered an issue", 1),  # another cause: the serve checks judge it
    ],
)
def test_the_pairs_first_request_is_asked_again_only_for_the_handshake_limit(
    tmp_path, monkeypatch, log, asked
):
    from m31ctl.rehearsal import proofs
    from m31ctl.rehearsal.session import Options

    prepared, run = _serving_run(tmp_path)
    sent: list[str] = []

    def completion(base: str, model: str, prompt: str, timeout: float, max_tokens: int = 16) -> Answer:
        sent.append(base)
        return REFUSED if len(sent) == 1 else OK

    monkeypatch.setattr(pairing, "completion", completion)
    said: list[str] = []
    after = proofs.first_handshake(_Logs(log), prepared, run, Options(), said.append)  # type: ignore[arg-type]
    assert after is run and len(sent) == asked
    assert bool(said) == (asked == 2)
