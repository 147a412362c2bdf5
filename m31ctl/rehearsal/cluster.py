"""The rehearsal's one-host cluster: the Secrets its pods read (a value for each required key),
a private Docker network (with a subnet of its own when pods need fixed addresses), each pod's address, a forwarder for each Service that maps ports
(kube-proxy's part), the claims' volumes, the pods handed to the emulated kubelet (kubelet.py: it
starts them in the LWS controller's order and watches until the serving pod is ready), and each
node as it ended, from its own log (logs.py)."""

from __future__ import annotations

import ipaddress
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from m31ctl.labels import Label
from m31ctl.redact import API_KEY_ENV
from m31ctl.rehearsal import docker_verbs
from m31ctl.rehearsal.kubelet import Kubelet, PodState, claim_volume, start_and_watch
from m31ctl.rehearsal.logs import failure_cause, read_log
from m31ctl.rehearsal.pods import Manifest, PodRun, ServiceRun, Volume
from m31ctl.rehearsal.prepared import Prepared
from m31ctl.rehearsal.provision import PACKAGE_DIR, PYTHON
from m31ctl.rehearsal.result import NodeOutcome, Run
from m31ctl.rehearsal.session import Options, Progress
from m31ctl.runtime import engine_api

# Fixed addresses on the rehearsal network start at this host of its subnet (Docker takes .1).
FIRST_POD_HOST = 10
FORWARDER_MOUNT = "/m31ctl-rehearsal"


def required_secrets(manifest: Manifest) -> list[str]:
    """The secrets a pod cannot start without (secretKeyRef without optional: the kubelet holds
    the pod in CreateContainerConfigError until the Secret has them)."""
    return sorted({name for pod in manifest.containers for name, optional in pod.secrets if not optional})


@contextmanager
def secret_values(manifest: Manifest) -> Iterator[dict[str, str]]:
    """Values for the required secrets: the user's exported one, else a fresh one for this
    rehearsal. VLLM_API_KEY is also set in this process while it runs, so smoke sends it.
    Optional secrets (HF_TOKEN: the tiny model is local) are not passed."""
    required = required_secrets(manifest)
    refs = {name: ref for pod in manifest.containers for name, ref in pod.secret_refs if name in required}
    by_ref: dict[str, str] = {}
    for name in required:  # one value per Secret key, whichever variable reads it
        exported = os.environ.get(name)
        if exported:
            by_ref.setdefault(refs.get(name, name), exported)
    values = {name: by_ref.setdefault(refs.get(name, name), secrets.token_urlsafe(24)) for name in required}
    saved = os.environ.get(API_KEY_ENV)
    if API_KEY_ENV in values:
        os.environ[API_KEY_ENV] = values[API_KEY_ENV]
    try:
        yield values
    finally:
        if saved is None:
            os.environ.pop(API_KEY_ENV, None)


def run_pods(
    client: Any,
    prepared: Prepared,
    session: str,
    secrets: dict[str, str],
    options: Options,
    progress: Progress,
) -> tuple[Kubelet, Run]:
    """The rehearsal's network (with each pod's address where the pods need fixed ones), the
    Services' forwarders, the claims' volumes, then the kubelet on that network with the secrets'
    values: it starts the pods and watches them until the serving pod is ready (the run's `why`
    None), or why not (the network could not be made: nothing started)."""
    network, labels = f"m31ctl-rh-{session}", {Label.REHEARSAL: session}
    subnet = docker_verbs.free_subnet(client, network, labels) if prepared.addressed else None
    unmade = Kubelet(client, session, network)  # runs nothing: where the network was not made
    if prepared.addressed and subnet is None:
        return unmade, Run(
            [], "no free subnet for the rehearsal network (docker network create failed)", None
        )
    refused = engine_api.create_network(client, network, labels, subnet)
    if refused is not None:
        return unmade, Run([], f"docker network create failed: {refused.strip()[-300:]}", None)
    addresses = pod_addresses(subnet, prepared) if subnet else {}
    forwarders = [forwarder_pod(s, prepared.image, addresses) for s in prepared.manifest.forwarded]
    for claim in prepared.manifest.claims:
        # Not checked here: a volume the engine refused shows as the pod's own start error.
        docker_verbs.create_volume(client, claim_volume(session, claim), labels)
    kubelet = Kubelet(
        client, session, network, addresses=addresses, secrets=secrets, sandboxed=prepared.restarted_in_place
    )
    states, why, serving = start_and_watch(
        kubelet,
        prepared.manifest.pods,
        forwarders,
        prepared.manifest.api_pod,
        prepared.ready_s,
        options,
        progress,
    )
    return kubelet, Run(states, why, None, serving=serving)


def pod_addresses(subnet: str, prepared: Prepared) -> dict[str, str]:
    """Each pod's fixed address (and the forwarders'), in manifest order."""
    names = list(dict.fromkeys(p.pod for p in prepared.manifest.pods if not p.init))
    names += [s.forwarder_pod for s in prepared.manifest.forwarded]
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
