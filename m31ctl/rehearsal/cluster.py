"""The rehearsal's one-host cluster: a private Docker network (with a subnet of its own when pods
need fixed addresses), the claims' volumes, each pod's address, a forwarder for each Service that
maps ports (kube-proxy's part), the pods handed to the emulated kubelet (kubelet.py: it starts
them in the LWS controller's order and watches until the serving pod is ready), and each node as
it ended, from its own log (logs.py)."""

from __future__ import annotations

import ipaddress
from typing import Any

from m31ctl.labels import Label
from m31ctl.rehearsal import docker_verbs
from m31ctl.rehearsal.kubelet import Kubelet, PodState, claim_volume, serving_state, start_pods, watch
from m31ctl.rehearsal.logs import failure_cause, read_log
from m31ctl.rehearsal.pods import PodRun, ServiceRun, Volume
from m31ctl.rehearsal.prepared import Prepared
from m31ctl.rehearsal.provision import PACKAGE_DIR, PYTHON
from m31ctl.rehearsal.result import NodeOutcome, Run
from m31ctl.rehearsal.session import Options, Progress
from m31ctl.runtime import engine_api

# Fixed addresses on the rehearsal network start at this host of its subnet (Docker takes .1).
FIRST_POD_HOST = 10
FORWARDER_MOUNT = "/m31ctl-rehearsal"


def kubelet_on_network(
    client: Any, prepared: Prepared, session: str, secrets: dict[str, str]
) -> tuple[Kubelet, str | None]:
    """The kubelet on the rehearsal's own network, the claims' volumes made, each pod's address
    and the secrets' values known; and why the network could not be made (None: it was)."""
    network, labels = f"m31ctl-rh-{session}", {Label.REHEARSAL: session}
    subnet = docker_verbs.free_subnet(client, network, labels) if prepared.addressed else None
    addresses = pod_addresses(subnet, prepared) if subnet else {}
    unmade = Kubelet(client, session, network)  # runs nothing: where the network was not made
    if prepared.addressed and subnet is None:
        return unmade, "no free subnet for the rehearsal network (docker network create failed)"
    refused = engine_api.create_network(client, network, labels, subnet)
    if refused is not None:
        return unmade, f"docker network create failed: {refused.strip()[-300:]}"
    for claim in (*prepared.manifest.claims, *prepared.reference_claims):
        # Not checked here: a volume the engine refused shows as the pod's own start error.
        docker_verbs.create_volume(client, claim_volume(session, claim), labels)
    kubelet = Kubelet(
        client, session, network, addresses=addresses, secrets=secrets, sandboxed=prepared.restarted_in_place
    )
    return kubelet, None


def pod_addresses(subnet: str, prepared: Prepared) -> dict[str, str]:
    """Each pod's fixed address (and the forwarders' and the reference's), in manifest order."""
    names = list(dict.fromkeys(p.pod for p in prepared.manifest.pods if not p.init))
    names += [s.forwarder_pod for s in prepared.manifest.forwarded]
    names += [prepared.reference.pod] if prepared.reference else []
    network = ipaddress.ip_network(subnet)
    return {name: str(network[FIRST_POD_HOST + index]) for index, name in enumerate(names)}


def forwarder_pod(service: ServiceRun, image: str, addresses: dict[str, str]) -> PodRun:
    """A Service that maps ports, as kube-proxy gives it: a container holding the Service's DNS
    names that forwards each port to the selected pod's address and target port (forwarder.py)."""
    rules = tuple(f"{port}={addresses[service.pod]}:{target}" for port, target in service.ports)
    return PodRun(
        pod=service.forwarder_pod,
        container="forwarder",
        role="service",
        worker_index=0,
        image=image,
        command=(PYTHON, f"{FORWARDER_MOUNT}/forwarder.py"),
        args=rules,
        env=(),
        secrets=(),
        volumes=(Volume("host", str(PACKAGE_DIR), FORWARDER_MOUNT, True),),
        ports=(),
        probes=(),
        hostname=service.forwarder_pod[:63],
        aliases=service.dns_names,
        cap_add=(),
        unconfined=False,
        ipc_host=False,
    )


def start_and_watch(kubelet: Kubelet, prepared: Prepared, options: Options, progress: Progress) -> Run:
    """The Services' forwarders and the pods started, then watched until the serving pod is
    ready (its `why` None), or why not."""
    manifest = prepared.manifest
    image = prepared.twin.plan.settings.engine.image
    forwarders = [forwarder_pod(s, image, kubelet.addresses) for s in manifest.forwarded]
    states = start_pods(
        kubelet, manifest.pods, options.timeout_s, options.leader_delay_s, progress, forwarders
    )
    progress(f"started {len(states)} container(s) on network {kubelet.network}")
    failed_init = [s for s in states if s.pod.init and s.exit_code != 0]
    if failed_init:  # the kubelet never starts the pod's containers after a failed init
        first = failed_init[0]
        how = (
            f"did not end within {options.timeout_s} s (raise --timeout)"
            if first.exit_code == -1
            else f"exited with {first.exit_code}"
        )
        return Run(states, f"init container {first.pod.container} of {first.pod.pod} {how}", None)
    # The rendered startup probe's own budget (the timeline's readiness wait) bounds the wait.
    deadline = kubelet.clock() + max(options.timeout_s, prepared.deployment.timeline.ready_s)
    serving = serving_state(states, manifest.api_pod)
    why = watch(kubelet, states, serving, deadline, progress)
    return Run(states, why, None, serving=serving)


def node_outcomes(kubelet: Kubelet, states: list[PodState], run_failed: bool) -> tuple[NodeOutcome, ...]:
    """Each node as it ended: vLLM's rank lines, its time to ready, and, when the rehearsal
    failed, its own error line and the likely cause."""
    out = []
    for state in states:
        text = kubelet.log(state) if state.status != "not started" else ""
        log = read_log(text)
        ended_badly = state.exit_code not in (None, 0)
        line = log.error_line if (ended_badly or run_failed) else None
        if state.status == "not started":  # docker refused to create it: its message is the line
            line = state.start_error or line
        ready = state.ready_s
        if ready is None and log.engine_ready_at is not None:
            ready = round(log.engine_ready_at - state.started_wall, 1)
        out.append(
            NodeOutcome(
                pod=state.pod.pod,
                role=state.pod.role if not state.pod.init else f"init ({state.pod.container})",
                worker_index=state.pod.worker_index,
                container=state.name,
                address=state.ip,
                command=(*(state.pod.command or ()), *(state.pod.args or ())),
                ranks=log.ranks,
                ready_s=ready,
                exit_code=state.exit_code if state.status != "running" else None,
                error_line=line,
                cause=failure_cause(line, text, state.exit_code) if line else None,
            )
        )
    return tuple(out)
