"""What a rehearsal proves once the serving pod is ready, one row of PROOFS a proof, judged in
the table's order while the previous ones held: that it serves (completions at once through it,
then served/smoke.py's checks) and that no node dies at its first requests; for a P/D plan, the
pair's proof (pairing.py) driven on the pods: the roles' addresses, the router's own list of
workers read in its container, prefill killed and started again in place; with --rollout, an
image change rolled out under load (rollout_proof.py). Each proof has one signature, reads what
prepare derived (Prepared), never the plan, and says by its row when it applies; what is done to
a container is the kubelet's."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from m31ctl.engine.router import ROUTER_WORKERS_PROGRAM
from m31ctl.errors import M31Error
from m31ctl.rehearsal import pairing, rollout_proof
from m31ctl.rehearsal.kubelet import Kubelet, PodState
from m31ctl.rehearsal.prepared import Prepared
from m31ctl.rehearsal.result import Run, Served
from m31ctl.rehearsal.session import Options, Progress
from m31ctl.render.k8s_router import ROUTER_CONTAINER
from m31ctl.served import http_answers, smoke

# How long a node may take to die after the first answers (a rank dying at its first request).
SETTLE_S = 3.0
PROMPT = "The rehearsal says"


class Proof(NamedTuple):
    """One row of PROOFS: when it applies to what prepare derived, and the proof over the running
    pods, which returns the run with its outcome (a field of result.Run) and, when it failed, why."""

    applies: Callable[[Prepared], bool]
    proves: Callable[[Kubelet, Prepared, Run, Options, Progress], Run]


def judge(kubelet: Kubelet, prepared: Prepared, run: Run, options: Options, progress: Progress) -> Run:
    """Each proof of PROOFS that applies, in the table's order, while the previous ones held."""
    for proof in PROOFS:
        if run.why is None and proof.applies(prepared):
            run = proof.proves(kubelet, prepared, run, options, progress)
    return run


def prove_rollout(
    kubelet: Kubelet, prepared: Prepared, run: Run, options: Options, progress: Progress
) -> Run:
    """An image change rolled out by the rendered strategy under load, the old pod drained
    (rollout_proof.py); the pods it started join the run."""
    assert run.serving is not None and prepared.rollout is not None
    outcome, started = rollout_proof.roll_out(kubelet, prepared, run.serving, progress)
    why = None if outcome.ok else f"the rollout: {outcome.failure}"
    return run._replace(states=[*run.states, *started], why=why, rollout=outcome)


def serves(kubelet: Kubelet, prepared: Prepared, run: Run, options: Options, progress: Progress) -> Run:
    """Completions and smoke through the serving pod; then every pod still running."""
    leader = run.serving
    assert leader is not None  # the pods started and the serving one is ready
    progress(f"{leader.pod.pod} ready after {leader.ready_s} s: sending completions and smoke")
    served = serve_checks(prepared, leader, timeout=min(120.0, options.timeout_s))
    time.sleep(SETTLE_S)  # a rank that dies at its first request takes a moment to be seen
    for state in run.states:
        kubelet.refresh(state)
    ended = [s for s in run.states if s.status != "running" and not s.pod.init]
    if ended:
        first = ended[0]
        return run._replace(why=f"{first.pod.pod} ({first.pod.role}) exited with code {first.exit_code} "
                                "after the first requests", served=served)  # fmt: skip
    if not served.ok:
        unanswered = f" (the first not: {served.unanswered})" if served.unanswered else ""
        return run._replace(why=f"{served.answered} of {served.sent} completions answered{unanswered}; smoke ok: "
                                f"{served.smoke.get('ok')}", served=served)  # fmt: skip
    return run._replace(served=served)


def completions(endpoint: str, model: str, count: int, timeout: float) -> tuple[int, str]:
    """`count` completions at once through the leader (data-parallel ranks each get some: the
    coordinator balances by load): how many were answered 200 with choices, and the first that
    was not, as it came back ("" when all were). served/ has no check of many requests at once;
    each answer is read by its defensive reading (http_answers)."""

    def one(_: int) -> str:
        answer = pairing.completion(endpoint, model, PROMPT, timeout, max_tokens=8)
        if answer.status == 200 and http_answers.as_list(answer.obj().get("choices")):
            return ""
        return f"HTTP {answer.status}{answer.evidence()}"

    with ThreadPoolExecutor(max_workers=count) as pool:
        failures = [why for why in pool.map(one, range(count)) if why]
    return count - len(failures), (failures[0] if failures else "")


def serving_endpoint(prepared: Prepared, serving: PodState) -> str:
    """The serving pod at its address and the Service's target port (where the Service sends
    in-cluster clients)."""
    return f"http://{serving.ip}:{prepared.manifest.serving_port}"


def serve_checks(prepared: Prepared, leader: PodState, timeout: float) -> Served:
    """Completions and smoke through the leader (serving_endpoint)."""
    endpoint = serving_endpoint(prepared, leader)
    answered, unanswered = completions(endpoint, prepared.served_name, prepared.completions, timeout)
    try:
        found = smoke.run(endpoint, prepared.served_name, max_tokens=16, timeout=timeout).to_json()
    except M31Error as exc:  # the server stopped answering: a finding of the rehearsal, not its end
        found = {"endpoint": endpoint, "ok": False, "error": str(exc)}
    return Served(endpoint, prepared.completions, answered, found, unanswered)


# What decode logs when vLLM 0.32's NIXL handshake with prefill timed out: the handshake waits 5 s
# for prefill's side channel (nixl/base_worker.py `_nixl_handshake`, RCVTIMEO 5000, no setting),
# and on a loaded two-core host prefill's answer once came later; the router then answered the
# pair's first request 500 (the native P/D test saw it in CI first, tests/runtime/test_launch_pd.py).
HANDSHAKE_FAILED = "NIXL transfer failure: handshake"


def first_handshake(
    kubelet: Kubelet, prepared: Prepared, run: Run, options: Options, progress: Progress
) -> Run:
    """The pair's first request through the router, on its own: it makes decode's NIXL
    handshake with prefill. Failed for that logged cause alone, it is said and asked again once;
    whatever answers after is judged by the proofs that follow, never here."""
    assert run.serving is not None and prepared.pair is not None
    endpoint = serving_endpoint(prepared, run.serving)
    timeout = min(120.0, options.timeout_s)
    first = pairing.completion(endpoint, prepared.served_name, PROMPT, timeout, max_tokens=1)
    if first.status == 200:
        return run
    decode = next(s for s in run.states if s.pod.pod == prepared.pair.decode and not s.pod.init)
    if HANDSHAKE_FAILED in kubelet.log(decode):
        progress(f"the pair's first request met vLLM's 5 s NIXL handshake limit (HTTP {first.status}; "
                 "decode's log): asked again once")  # fmt: skip
        pairing.completion(endpoint, prepared.served_name, PROMPT, timeout, max_tokens=1)
    return run


def prove_pair(kubelet: Kubelet, prepared: Prepared, run: Run, options: Options, progress: Progress) -> Run:
    """The pair's proof (pairing.prove) on the pods."""
    pair = prepared.pair
    assert run.served is not None and run.serving is not None and pair is not None
    router_pod = run.serving  # a P/D plan's serving pod is its router's (read_manifest)
    pods = {s.pod.pod: s for s in run.states if not s.pod.init}
    prefill, decode = pods[pair.prefill], pods[pair.decode]

    def router_workers() -> tuple[str, str | None]:
        # As an operator would: in the router's container, on the loopback the front keeps it on.
        ran = kubelet.exec_beside(
            router_pod, ROUTER_CONTAINER, ["python3", "-c", ROUTER_WORKERS_PROGRAM], timeout=60.0
        )
        return (
            (ran.out.strip(), None) if ran.code == 0 else ("", f"exit {ran.code}: {ran.err.strip()[-300:]}")
        )

    handles = pairing.Pair(
        router=run.served.endpoint,
        decode=f"http://{decode.ip}:{pair.decode_port}",
        prefill=f"http://{prefill.ip}:{pair.prefill_port}",
        kill_prefill=lambda: kubelet.kill_until_ended(prefill, pair.prefill_stop_s),
        start_prefill=lambda: kubelet.start_in_place(prefill),
        model=prepared.served_name,
        clocks=pair.clocks,
        router_workers=router_workers,
    )
    progress("proving the pair: KV transfer, parity with the prefill role alone, the router's front, "
             "prefill killed and back")  # fmt: skip
    outcome = pairing.prove(handles, progress=progress)
    for role in (prefill, decode):
        kubelet.refresh(role)
    why = None if outcome.ok else f"the pair: {outcome.failure}"
    return run._replace(why=why, pairing=outcome)


# The proofs, in the order they are judged: a proof after another needs what that one held (the
# pair's and the rollout's run on a pod that serves). A new proof is one row here.
PROOFS: tuple[Proof, ...] = (
    Proof(lambda prepared: prepared.pair is not None, first_handshake),
    Proof(lambda _prepared: True, serves),
    Proof(lambda prepared: prepared.pair is not None, prove_pair),
    Proof(lambda prepared: prepared.rollout is not None, prove_rollout),
)
