"""What Kubernetes would run from a deployment's render, as plain data: the target rendered by the
normal render code and its YAML read back as one PodRun per pod of the LeaderWorkerSet (or the
Deployment's one pod), with the environment the LWS controller and the kubelet give each
container, and command, args and probes as the kubelet resolves them; a command that would put a
secret into argv is refused here, before anything starts. Pure: the documents in, the pods out;
running them is the cluster's business (cluster.py).

Sources: the LWS pod webhook (sigs.k8s.io/lws pkg/utils/pod: LWS_LEADER_ADDRESS is
`<lws>-<group>.<lws>.<namespace>`, the headless Service named after the LWS; LWS_GROUP_SIZE; the
worker index), prepended to each container's env; the kubelet's makeEnvironmentVariables
(service links first when enableServiceLinks is not false, then env in order, each value
expanded against what precedes it; command and args expanded against the result).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import yaml

from m31ctl.errors import InputError
from m31ctl.render import get_target
from m31ctl.render.k8s import API_SERVICE_SUFFIX
from m31ctl.render.kubelet_expansion import expand, mapping_for

if TYPE_CHECKING:
    from m31ctl.deployment import Deployment

NAMESPACE = "default"
GROUP = 0  # the one replica group of `replicas: 1`
# ClusterIPs the rehearsal pretends its Services have (service links need an address).
_CLUSTER_IP_BASE = "10.96.0."


class Probe(NamedTuple):
    kind: str  # startup | liveness | readiness
    action: str  # http | exec | tcp
    path: str
    port: int
    command: tuple[str, ...]
    period_s: int
    timeout_s: int
    failure_threshold: int
    initial_delay_s: int

    def describe(self) -> str:
        if self.action == "http":
            return f"{self.kind} GET :{self.port}{self.path}"
        if self.action == "tcp":
            return f"{self.kind} TCP :{self.port}"
        return f"{self.kind} exec {self.command[0]}"


class Volume(NamedTuple):
    kind: str  # claim (a Docker volume) | host (a bind mount) | memory (tmpfs)
    source: str  # the claim's or the host directory's name; empty for memory
    target: str
    read_only: bool
    size: str | None = None


class PodRun(NamedTuple):
    pod: str  # the pod's name: <lws>-0 (leader), <lws>-0-<i> (workers), or the Deployment's
    container: str
    role: str  # leader | worker | server (a single-node Deployment)
    worker_index: int  # LWS_WORKER_INDEX (0: the leader, or a Deployment's pod)
    image: str
    command: tuple[str, ...] | None  # None: the image's entrypoint (Kubernetes semantics)
    args: tuple[str, ...] | None  # None: the image's CMD
    env: tuple[tuple[str, str], ...]  # literal values, expanded; no secrets
    secrets: tuple[tuple[str, bool], ...]  # (name, optional) read from the Secret
    volumes: tuple[Volume, ...]
    ports: tuple[tuple[str, int], ...]
    probes: tuple[Probe, ...]
    hostname: str
    aliases: tuple[str, ...]  # the DNS names other pods reach it by
    cap_add: tuple[str, ...]
    unconfined: bool
    ipc_host: bool
    init: bool = False  # an init container: runs to completion before the pod's containers
    # (name, fieldPath) of each downward-API variable: the kubelet fills them once the pod has
    # its address (status.podIP), which the cluster assigns (cluster.pod_addresses).
    fields: tuple[tuple[str, str], ...] = ()
    labels: tuple[tuple[str, str], ...] = ()  # the pod template's labels (what Services select)
    # (variable, "secret/key") of each secret variable: two variables that read one key (the
    # roles' VLLM_API_KEY and the router's OPENAI_API_KEY) get one value.
    secret_refs: tuple[tuple[str, str], ...] = ()
    # lifecycle.preStop's exec command, run as written (the kubelet does not expand a hook's
    # words: pkg/kubelet/lifecycle/handlers.go hands handler.Exec.Command to the runtime as is);
    # () when the container has none.
    pre_stop: tuple[str, ...] = ()
    # The pod's terminationGracePeriodSeconds (Kubernetes' default 30 when unset): counted from
    # the deletion, the preStop hook included (kuberuntime killContainer).
    grace_s: int = 30
    # The pod's other containers (spec.containers[1:]), run in its network namespace beside this
    # one, the first (a P/D router pod's router behind its front); () for a one-container pod.
    sidecars: tuple[PodRun, ...] = ()


class Strategy(NamedTuple):
    """The serving Deployment's spec.strategy and progressDeadlineSeconds, as rendered (what the
    Deployment controller rolls a changed template out by); kind "" where no Deployment serves."""

    kind: str = ""  # Recreate | RollingUpdate
    max_surge: int = 0
    max_unavailable: int = 0
    progress_deadline_s: int = 600  # Kubernetes' default


class ServiceRun(NamedTuple):
    """A ClusterIP Service as the rehearsal gives it: its DNS names, and for each port the
    target port on the pod it selects. Ports equal to their targets need only the names (an
    alias of the pod); mapped ports need a forwarder, kube-proxy's job (cluster.forwarder_pod)."""

    name: str
    pod: str  # the selected serving pod (the first the selector matches)
    ports: tuple[tuple[int, int], ...]  # (service port, the pod's port)

    @property
    def maps_ports(self) -> bool:
        return any(port != target for port, target in self.ports)

    @property
    def forwarder_pod(self) -> str:
        """The name of the forwarder that stands for this Service (cluster.forwarder_pod)."""
        return f"svc-{self.name}"

    @property
    def dns_names(self) -> tuple[str, ...]:
        return (self.name, f"{self.name}.{NAMESPACE}", f"{self.name}.{NAMESPACE}.svc.cluster.local")


class Manifest(NamedTuple):
    pods: tuple[PodRun, ...]
    claims: tuple[str, ...]
    api_port: int  # the Service's port (published on the host as the plan's runtime.port)
    kinds: tuple[str, ...]  # every kind the manifest holds (what the rehearsal did not emulate shows)
    services: tuple[ServiceRun, ...] = ()
    api_pod: str = ""  # the pod clients reach: the one behind the API Service
    serving_port: int = 0  # the port api_pod serves its API on (its Service's target)
    strategy: Strategy = Strategy()  # the Deployment whose pod api_pod is

    @property
    def forwarded(self) -> tuple[ServiceRun, ...]:
        """The Services that map a port: each gets a forwarder at its names."""
        return tuple(s for s in self.services if s.maps_ports)

    @property
    def containers(self) -> tuple[PodRun, ...]:
        """Every container of every pod: each PodRun and the others of its pod (its sidecars)."""
        return tuple(c for p in self.pods for c in (p, *p.sidecars))

    @property
    def serving(self) -> PodRun | None:
        """The serving container of the pod clients reach (api_pod); None: the render has none."""
        return next((p for p in self.pods if p.pod == self.api_pod and not p.init), None)


def _by_kind(documents: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in documents if d and d.get("kind") == kind]


def service_links(services: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The variables the kubelet injects for each Service of the namespace (Docker-links style,
    pkg/kubelet/envvars): NAME_SERVICE_HOST, NAME_SERVICE_PORT, NAME_PORT=tcp://..., ... A
    Service named `vllm` would set VLLM_PORT, which vLLM reads as its own setting."""
    out: list[tuple[str, str]] = []
    for number, service in enumerate(services, start=1):
        spec = service.get("spec", {})
        if spec.get("clusterIP") == "None" or not spec.get("ports"):
            continue
        name = service["metadata"]["name"].upper().replace("-", "_")
        host = f"{_CLUSTER_IP_BASE}{number}"
        first = spec["ports"][0]
        out += [(f"{name}_SERVICE_HOST", host), (f"{name}_SERVICE_PORT", str(first["port"]))]
        for port in spec["ports"]:
            if port.get("name"):
                out.append(
                    (f"{name}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}", str(port["port"]))
                )
        out.append((f"{name}_PORT", f"{first.get('protocol', 'TCP').lower()}://{host}:{first['port']}"))
        for port in spec["ports"]:
            proto = port.get("protocol", "TCP")
            prefix = f"{name}_PORT_{port['port']}_{proto}"
            out += [
                (prefix, f"{proto.lower()}://{host}:{port['port']}"),
                (f"{prefix}_PROTO", proto.lower()),
                (f"{prefix}_PORT", str(port["port"])),
                (f"{prefix}_ADDR", host),
            ]
    return out


def secret_mark(name: str) -> str:
    """What a `$(SECRET)` reference expands to here: the kubelet would put the secret's value
    there (into argv, visible in ps and logs); refuse_secret_expansion refuses a command that
    holds this."""
    return f"<secret {name}>"


def _secret_marks(secrets: list[tuple[str, bool]]) -> dict[str, str]:
    return {name: secret_mark(name) for name, _ in secrets}


class ContainerEnv(NamedTuple):
    values: dict[str, str]  # literal values, expanded
    secrets: list[tuple[str, bool]]  # (name, optional) read from the Secret
    fields: list[tuple[str, str]]  # (name, fieldPath): the downward API, filled at start
    secret_refs: list[tuple[str, str]]  # (name, "secret/key")


def container_env(
    container: dict[str, Any], injected: list[tuple[str, str]], links: list[tuple[str, str]]
) -> ContainerEnv:
    """The container's environment as the kubelet builds it: service links, then the env list
    (the LWS variables first, as its webhook puts them), each value expanded against what was
    defined before it; secrets by name only (their values never pass through here); downward-API
    fields by path (a pod's address exists only once it runs)."""
    env: dict[str, str] = dict(links)
    secrets: list[tuple[str, bool]] = []
    fields: list[tuple[str, str]] = []
    refs: list[tuple[str, str]] = []
    entries: list[dict[str, Any]] = [{"name": k, "value": v} for k, v in injected]
    entries += [e for e in container.get("env", []) if e["name"] not in dict(injected)]
    for entry in entries:
        if "valueFrom" in entry:
            ref = entry["valueFrom"].get("secretKeyRef")
            if ref is not None:
                secrets.append((entry["name"], bool(ref.get("optional", False))))
                refs.append((entry["name"], f"{ref.get('name', '')}/{ref.get('key', '')}"))
            field = entry["valueFrom"].get("fieldRef")
            if field is not None:
                fields.append((entry["name"], str(field["fieldPath"])))
            continue
        env[entry["name"]] = expand(str(entry.get("value", "")), mapping_for(env, _secret_marks(secrets)))
    return ContainerEnv(env, secrets, fields, refs)


def _probe(kind: str, spec: dict[str, Any] | None, ports: dict[str, int], env: dict[str, str]) -> list[Probe]:
    if not spec:
        return []
    common = (
        int(spec.get("periodSeconds", 10)),
        int(spec.get("timeoutSeconds", 1)),
        int(spec.get("failureThreshold", 3)),
        int(spec.get("initialDelaySeconds", 0)),
    )
    if "httpGet" in spec:
        get = spec["httpGet"]
        port = get["port"]
        number = ports[port] if isinstance(port, str) else int(port)
        return [Probe(kind, "http", get.get("path", "/"), number, (), *common)]
    if "tcpSocket" in spec:
        port = spec["tcpSocket"]["port"]
        return [Probe(kind, "tcp", "", ports[port] if isinstance(port, str) else int(port), (), *common)]
    # exec probes are not expanded by the kubelet: the command runs as written.
    return [Probe(kind, "exec", "", 0, tuple(spec["exec"]["command"]), *common)]


def _volumes(pod_spec: dict[str, Any], container: dict[str, Any]) -> tuple[Volume, ...]:
    declared = {v["name"]: v for v in pod_spec.get("volumes", [])}
    out = []
    for mount in container.get("volumeMounts", []):
        volume = declared[mount["name"]]
        read_only = bool(mount.get("readOnly", False))
        if "persistentVolumeClaim" in volume:
            out.append(
                Volume("claim", volume["persistentVolumeClaim"]["claimName"], mount["mountPath"], read_only)
            )
        elif "hostPath" in volume:
            out.append(Volume("host", volume["hostPath"]["path"], mount["mountPath"], read_only))
        elif "emptyDir" in volume:
            empty = volume["emptyDir"]
            medium = "memory" if empty.get("medium") == "Memory" else "scratch"
            out.append(Volume(medium, "", mount["mountPath"], read_only, empty.get("sizeLimit")))
    return tuple(out)


def _pod(
    pod_name: str,
    role: str,
    index: int,
    template: dict[str, Any],
    injected: list[tuple[str, str]],
    links: list[tuple[str, str]],
) -> list[PodRun]:
    """The init containers (in order), then the pod's first container with the others beside it
    (PodRun.sidecars), as the kubelet starts every container of a pod in one sandbox."""
    spec = template["spec"]

    def run(container: dict[str, Any], init: bool) -> PodRun:
        return _container_run(pod_name, role, index, template, container, init, injected, links)

    first, *others = spec["containers"]
    inits = [run(c, True) for c in spec.get("initContainers", [])]
    return [*inits, run(first, False)._replace(sidecars=tuple(run(c, False) for c in others))]


def _container_run(
    pod_name: str, role: str, index: int, template: dict[str, Any], container: dict[str, Any], init: bool,
    injected: list[tuple[str, str]], links: list[tuple[str, str]],
) -> PodRun:  # fmt: skip
    spec = template["spec"]
    env, secrets, fields, refs = container_env(container, injected, links)
    ports = {p["name"]: int(p["containerPort"]) for p in container.get("ports", []) if "name" in p}
    kinds = () if init else ("startup", "liveness", "readiness")  # an init container has no probes
    probes = [p for kind in kinds for p in _probe(kind, container.get(f"{kind}Probe"), ports, env)]
    security = container.get("securityContext", {})
    pre_stop = ((container.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}
    return PodRun(
        pod=pod_name,
        container=container["name"],
        role=role,
        worker_index=index,
        image=container["image"],
        command=_resolved(container.get("command"), env, secrets),
        args=_resolved(container.get("args"), env, secrets),
        env=tuple(env.items()),
        secrets=tuple(secrets),
        volumes=_volumes(spec, container),
        ports=tuple(ports.items()),
        probes=tuple(probes),
        hostname=pod_name,
        aliases=(),
        cap_add=tuple(security.get("capabilities", {}).get("add", [])),
        unconfined=security.get("seccompProfile", {}).get("type") == "Unconfined",
        ipc_host=bool(spec.get("hostIPC", False)),
        init=init,
        fields=tuple(fields),
        secret_refs=tuple(refs),
        labels=tuple(template.get("metadata", {}).get("labels", {}).items()),
        pre_stop=tuple(str(word) for word in pre_stop.get("command", ())),
        grace_s=int(spec.get("terminationGracePeriodSeconds", 30)),
    )


def _resolved(
    words: list[Any] | None, env: dict[str, str], secrets: list[tuple[str, bool]]
) -> tuple[str, ...] | None:
    """command or args as the kubelet hands them to the runtime: each word expanded against the
    container's environment (secrets included: see secret_mark)."""
    if words is None:
        return None
    mapping = mapping_for(env, _secret_marks(secrets))
    return tuple(expand(str(w), mapping) for w in words)


def _links(spec: dict[str, Any], services: list[dict[str, Any]]) -> list[tuple[str, str]]:
    return service_links(services) if spec.get("enableServiceLinks", True) else []


def lws_pods(lws: dict[str, Any], services: list[dict[str, Any]]) -> list[PodRun]:
    """Group 0 of a LeaderWorkerSet: the leader `<lws>-0` and workers `<lws>-0-<i>`."""
    name = lws["metadata"]["name"]
    template = lws["spec"]["leaderWorkerTemplate"]
    size = int(template.get("size", 1))
    leader_address = f"{name}-{GROUP}.{name}.{NAMESPACE}"
    runs: list[PodRun] = []
    for index in range(size):
        leader = index == 0
        pod_template = template.get("leaderTemplate") if leader else None
        pod_template = pod_template or template["workerTemplate"]
        pod_name = f"{name}-{GROUP}" if leader else f"{name}-{GROUP}-{index}"
        injected = [
            ("LWS_LEADER_ADDRESS", leader_address),
            ("LWS_GROUP_SIZE", str(size)),
            ("LWS_WORKER_INDEX", str(index)),
        ]
        pods = _pod(pod_name, "leader" if leader else "worker", index, pod_template, injected,
                    _links(pod_template["spec"], services))  # fmt: skip
        # The pod's DNS names: hostname.subdomain (the LWS's headless Service) in the namespace.
        aliases = (
            pod_name,
            f"{pod_name}.{name}.{NAMESPACE}",
            f"{pod_name}.{name}.{NAMESPACE}.svc.cluster.local",
        )
        runs += [p._replace(aliases=aliases if not p.init else ()) for p in pods]
    return runs


def deployment_pods(deployment: dict[str, Any], services: list[dict[str, Any]]) -> list[PodRun]:
    name = deployment["metadata"]["name"]
    template = deployment["spec"]["template"]
    pod_name = f"{name}-0"
    pods = _pod(pod_name, "server", 0, template, [], _links(template["spec"], services))
    return [p._replace(aliases=(pod_name,) if not p.init else ()) for p in pods]


def _selects(service: dict[str, Any], pod: PodRun) -> bool:
    selector = service.get("spec", {}).get("selector") or {}
    return bool(selector) and selector.items() <= dict(pod.labels).items()


def service_runs(services: list[dict[str, Any]], pods: list[PodRun]) -> tuple[ServiceRun, ...]:
    """Each ClusterIP Service with the serving pod it selects and its ports' targets (a named
    targetPort is looked up among the pod's ports, as kube-proxy does)."""
    out = []
    for service in services:
        spec = service.get("spec", {})
        chosen = next((p for p in pods if not p.init and _selects(service, p)), None)
        if spec.get("clusterIP") == "None" or chosen is None:
            continue
        named = dict(chosen.ports)
        ports = tuple(
            (int(p["port"]), named[t] if isinstance(t := p.get("targetPort", p["port"]), str) else int(t))
            for p in spec.get("ports", [])
        )
        out.append(ServiceRun(service["metadata"]["name"], chosen.pod, ports))
    return tuple(out)


def strategy_of(deployments: list[dict[str, Any]], pod: str) -> Strategy:
    """The strategy of the Deployment whose pod is `pod` (deployment_pods names it <name>-0)."""
    owner = next((d for d in deployments if f"{d['metadata']['name']}-{GROUP}" == pod), None)
    if owner is None:
        return Strategy()
    spec = owner["spec"]
    strategy = spec.get("strategy") or {"type": "RollingUpdate"}
    rolling = strategy.get("rollingUpdate") or {}
    return Strategy(
        kind=str(strategy.get("type", "RollingUpdate")),
        # Kubernetes' defaults are 25%, which one replica rounds to surge 1, unavailable 0.
        max_surge=int(rolling.get("maxSurge", 1)),
        max_unavailable=int(rolling.get("maxUnavailable", 0)),
        progress_deadline_s=int(spec.get("progressDeadlineSeconds", 600)),
    )


def read_manifest(
    documents: list[dict[str, Any]], api_service: str = "", container_port: int = 0
) -> Manifest:
    """The pods a rendered manifest makes, in start order, and what else it declares.
    `api_service`: the Service clients reach (the deployment's `<name>-api`); without it, or
    when no Service selects a pod, the first leader or server is the one clients reach. The
    port that pod serves on: vLLM's is named http, vllm-router's (a P/D plan's front) api; else
    the plan's `container_port`."""
    service_documents = _by_kind(documents, "Service")
    pods: list[PodRun] = []
    for lws in _by_kind(documents, "LeaderWorkerSet"):
        pods += lws_pods(lws, service_documents)
    for deployment in _by_kind(documents, "Deployment"):
        pods += deployment_pods(deployment, service_documents)
    services = service_runs(service_documents, pods)
    serving = [p for p in pods if p.role in ("leader", "server") and not p.init]
    api = next((s for s in services if s.name == api_service), None)
    api_pod = api.pod if api else (serving[0].pod if serving else "")
    api_port = api.ports[0][0] if api and api.ports else next(
        (int(port["port"]) for s in service_documents for port in s["spec"].get("ports", [])
         if serving and port.get("targetPort") in dict(serving[0].ports)),
        0,
    )  # fmt: skip
    # A Service whose ports are its pod's resolves to that pod inside the network, as a
    # ClusterIP would; one that maps ports gets a forwarder instead (Manifest.forwarded).
    names: dict[str, tuple[str, ...]] = {}
    for service in services:
        if not service.maps_ports:
            names[service.pod] = (*names.get(service.pod, ()), service.name)
    if not services:  # Services that select nothing (a hand-written manifest): the old rule
        names = {p.pod: tuple(s["metadata"]["name"] for s in service_documents) for p in serving}
    pods = [p._replace(aliases=p.aliases + names.get(p.pod, ())) if not p.init else p for p in pods]
    claims = tuple(d["metadata"]["name"] for d in _by_kind(documents, "PersistentVolumeClaim"))
    kinds = tuple(str(d.get("kind")) for d in documents if d)
    ports = dict(next((p.ports for p in pods if p.pod == api_pod and not p.init), ()))
    serving_port = ports.get("http") or ports.get("api") or container_port
    strategy = strategy_of(_by_kind(documents, "Deployment"), api_pod)
    return Manifest(tuple(pods), claims, api_port, kinds, services, api_pod, serving_port, strategy)


def render_documents(deployment: Deployment, target: str) -> list[dict[str, Any]]:
    """The target rendered by the normal render code, read back as the documents it holds."""
    documents: list[dict[str, Any]] = []
    for artifact in get_target(target)(deployment):
        if artifact.name.endswith((".yaml", ".yml")):
            documents += [d for d in yaml.safe_load_all(artifact.content) if d]
    return documents


def rendered_manifest(deployment: Deployment, target: str) -> Manifest:
    """The pods, Services and claims Kubernetes would run from the deployment's render."""
    return read_manifest(
        render_documents(deployment, target),
        deployment.name + API_SERVICE_SUFFIX,
        deployment.network.container_port,
    )


def refuse_secret_expansion(manifest: Manifest) -> None:
    """A command or args word the kubelet would expand into a secret's value (argv is visible
    in ps and in the node's logs): refused before anything starts."""
    for pod in manifest.containers:
        words = [*(pod.command or ()), *(pod.args or ())]
        leaked = [name for name, _ in pod.secrets if any(secret_mark(name) in w for w in words)]
        if leaked:
            raise InputError(
                f"pod {pod.pod}: its command expands the secret {leaked[0]} into argv "
                "(visible in ps and the node's logs)",
                hint="read the secret from the environment inside the process, never via $(NAME)",
            )
