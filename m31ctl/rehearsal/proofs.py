"""What a rehearsal proves once the serving pod is ready: that it serves (completions at once
through it, then served/smoke.py's checks), that no node dies at its first requests, and, for a
P/D plan, the pair's proof (pairing.py) driven on the pods: the roles' addresses, prefill killed
and started again in place, the aggregated reference server started beside the pair."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

from m31ctl import interrupt
from m31ctl.deployment import Deployment
from m31ctl.errors import M31Error
from m31ctl.rehearsal import pairing
from m31ctl.rehearsal.kubelet import Kubelet, PodState, watch
from m31ctl.rehearsal.pods import PodRun
from m31ctl.rehearsal.prepared import Prepared
from m31ctl.rehearsal.result import Run, Served
from m31ctl.rehearsal.session import Options, Progress
from m31ctl.render.k8s import API_SERVICE_SUFFIX
from m31ctl.served import http_answers, smoke

# How long a node may take to die after the first answers (a rank dying at its first request).
SETTLE_S = 3.0
KILL_POLL_S = 0.5
PROMPT = "The rehearsal says"


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
        return run._replace(why=f"{served.answered} of {served.sent} completions answered; smoke ok: "
                                f"{served.smoke.get('ok')}", served=served)  # fmt: skip
    return run._replace(served=served)


def api_port(pod: PodRun, prepared: Prepared) -> int:
    """The port a pod serves its API on: vLLM's is named http, vllm-router's (a P/D plan's
    front) api; else the plan's container port."""
    ports = dict(pod.ports)
    return ports.get("http") or ports.get("api") or prepared.deployment.network.container_port


def completions(endpoint: str, model: str, count: int, timeout: float) -> int:
    """`count` completions at once through the leader (data-parallel ranks each get some: the
    coordinator balances by load); how many were answered 200 with choices. served/ has no check
    of many requests at once; each answer is read by its defensive reading (http_answers)."""

    def one(_: int) -> bool:
        answer = pairing.completion(endpoint, model, PROMPT, timeout, max_tokens=8)
        return answer.status == 200 and bool(http_answers.as_list(answer.obj().get("choices")))

    with ThreadPoolExecutor(max_workers=count) as pool:
        return sum(pool.map(one, range(count)))


def serve_checks(prepared: Prepared, leader: PodState, timeout: float) -> Served:
    """Completions and smoke through the leader, at its pod address and the Service's target
    port (where the Service sends in-cluster clients)."""
    endpoint = f"http://{leader.ip}:{api_port(leader.pod, prepared)}"
    served_name = prepared.twin.plan.settings.model.served_name
    count = max(2, 2 * prepared.twin.plan.settings.parallelism.data)
    answered = completions(endpoint, served_name, count, timeout)
    try:
        found = smoke.run(endpoint, served_name, max_tokens=16, timeout=timeout).to_json()
    except M31Error as exc:  # the server stopped answering: a finding of the rehearsal, not its end
        found = {"endpoint": endpoint, "ok": False, "error": str(exc)}
    return Served(endpoint, count, answered, found)


def _engine_url(prepared: Prepared, role: Deployment, states: list[PodState]) -> tuple[str, PodState]:
    """A P/D role's base URL on the rehearsal network (its pod's address and vLLM's port, as
    the role's API Service targets it) and its pod."""
    service = next(s for s in prepared.manifest.services if s.name == role.name + API_SERVICE_SUFFIX)
    state = next(s for s in states if s.pod.pod == service.pod and not s.pod.init)
    return f"http://{state.ip}:{service.ports[0][1]}", state


def kill_until_ended(kubelet: Kubelet, state: PodState, bound_s: float) -> str | None:
    """SIGKILL the pod's container and wait until it has ended (the kill is a state, not the
    moment `docker kill` returns), within `bound_s`; None once ended, else why not."""
    refused = kubelet.kill(state)
    if refused is not None:
        return refused
    deadline = kubelet.clock() + bound_s
    while True:
        kubelet.refresh(state)
        if state.status != "running":
            return None
        if kubelet.clock() > deadline:
            return f"{state.name} still runs {bound_s:.0f} s after SIGKILL"
        interrupt.sleep(KILL_POLL_S)  # Ctrl-C and SIGTERM end the wait here


def start_in_place(kubelet: Kubelet, state: PodState) -> str | None:
    """The ended container started again in its pod, as the kubelet restarts one."""
    refused = kubelet.start_again(state)
    if refused is None:
        state.status, state.exit_code = "running", None
    return refused


def prove_pair(kubelet: Kubelet, prepared: Prepared, run: Run, options: Options, progress: Progress) -> Run:
    """The pair's proof (pairing.prove) on the pods; the aggregated reference joins its run."""
    group = prepared.deployment.disaggregated
    assert group is not None and prepared.reference is not None and run.served is not None
    decode, decode_state = _engine_url(prepared, group.decode, run.states)
    prefill_url, prefill = _engine_url(prepared, group.prefill, run.states)
    reference = prepared.reference
    started: list[PodState] = []

    def start_reference(budget_s: float) -> tuple[str, str | None]:
        # The pair's checks are done; its engines busy-poll a core each, and a third vLLM
        # start beside them on a host of few cores does not finish (seen here on two cores).
        progress("stopping prefill and decode; starting the aggregated reference server (the same twin, "
                 "disaggregation off)")  # fmt: skip
        for role in (prefill, decode_state):
            kubelet.kill(role)
        state = kubelet.start(reference)
        started.append(state)
        why = watch(kubelet, [state], state, kubelet.clock() + budget_s, progress)
        return f"http://{state.ip}:{api_port(reference, prepared)}", why

    pair = pairing.Pair(
        router=run.served.endpoint,
        decode=decode,
        prefill=prefill_url,
        kill_prefill=lambda: kill_until_ended(kubelet, prefill, group.prefill.timeline.stop_s),
        start_prefill=lambda: start_in_place(kubelet, prefill),
        start_reference=start_reference,
        model=prepared.twin.plan.settings.model.served_name,
        clocks=pairing.pair_clocks(group),
    )
    progress("proving the pair: parity with an aggregated server, KV transfer, prefill killed and back")
    outcome = pairing.prove(pair, budget_s=max(float(options.timeout_s), 120.0), progress=progress)
    for role in (prefill, decode_state):
        kubelet.refresh(role)
    why = None if outcome.ok else f"the pair: {outcome.failure}"
    return run._replace(states=[*run.states, *started], why=why, pairing=outcome)
