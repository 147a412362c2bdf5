"""The launch of one container on the Docker Engine: what runtime/flow.py's converge needs of it.

A ContainerRun is one container as launch creates it (an aggregated server, a P/D role or a
group's router); ContainerLaunch supplies the flow's primitives for it: find what stands under its
name, pull its image, create and start it, the handle readiness polls. The same plan on a healthy
container changes nothing; an interrupted launch leaves a labelled container that the next launch
adopts; only containers labelled as ours are ever removed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any, NamedTuple

from m31ctl import interrupt
from m31ctl.container import ContainerSpec, container_spec
from m31ctl.deployment import Deployment
from m31ctl.docker_run import Attachment
from m31ctl.errors import ConflictError, HostPreconditionError, M31Error, ServerDied
from m31ctl.labels import Label
from m31ctl.netaddr import local_url
from m31ctl.runtime import engine_api
from m31ctl.runtime.converge import ExistingServer
from m31ctl.runtime.docker_create import create_container
from m31ctl.runtime.docker_servers import ours
from m31ctl.runtime.exits import explain_exit
from m31ctl.runtime.flow import Found
from m31ctl.runtime.phases import Phase
from m31ctl.runtime.planrecord import record_of
from m31ctl.runtime.protocol import LaunchOptions, PullEvent, PullProgress, Reporter
from m31ctl.runtime.readiness import ProcessState, models


class ContainerRun(NamedTuple):
    """One container as launch creates it: an aggregated server, a P/D role or a group's router."""

    deployment: Deployment  # what converge decides on: the engine, or the group for its router
    spec: ContainerSpec
    # The spec's and what its place adds (a role's group, a router's parts); the plan it was
    # launched with is added as it is created (launched_labels).
    labels: Mapping[str, str]
    attachment: Attachment | None = None  # on the pair's network (None: Docker's default bridge)
    entrypoint: tuple[str, ...] = ()  # () keeps the image's own
    # Ports beyond the API's: (container port, host port; None: one Docker picks free).
    published: tuple[tuple[int, int | None], ...] = ()
    # The container's secret variables from launch's environment, (in the container, in ours);
    # None: the spec's secret_env by the same names (an engine's).
    secrets_from: tuple[tuple[str, str], ...] | None = None
    network_of: str | None = None  # in that container's network namespace (a P/D router behind its front)

    def environ(self, environ: Mapping[str, str]) -> dict[str, str]:
        """What of launch's environment the container may read (create_container takes the
        spec's secret_env and launch's own variables from it)."""
        if self.secrets_from is None:
            return dict(environ)
        return {inside: environ[outside] for inside, outside in self.secrets_from if environ.get(outside)}

    def launched_labels(self, cwd: str) -> dict[str, str]:
        """Its labels and the plan it was launched with (runtime/planrecord.py: status, verify
        and smoke read it back); `cwd`, where launch ran, reads a relative model path again.
        Every container launch creates is labelled here, the aggregated one and a group's."""
        return {**self.labels, Label.PLAN: record_of(self.deployment, cwd).to_json()}


def single(deployment: Deployment) -> ContainerRun:
    """An aggregated server's container. GPUs the deployment was given by index on a host whose
    GPUs have no UUIDs (a simulated one) are requested by index (the pair's roles are, too)."""
    spec = container_spec(deployment)
    if spec.device_request and not spec.gpu_device_ids and deployment.gpus.indices:
        spec = spec._replace(gpu_device_ids=tuple(str(i) for i in deployment.gpus.indices))
    return ContainerRun(deployment, spec, spec.label_dict)


def endpoint(spec: ContainerSpec) -> str:
    return local_url(spec.bind, spec.host_port)


class ContainerHandle:
    """A container as readiness sees it. A container removed under us is a dead server."""

    kind = "container"

    def __init__(self, container: Any) -> None:
        self.container = container
        self.name = str(container.name)
        self._restarts = int(container.attrs.get("RestartCount", 0) or 0)

    def state(self) -> ProcessState:
        try:
            self.container.reload()
        except Exception as exc:
            if engine_api.is_not_found(exc):
                return ProcessState(running=False, dead=True, vanished=True)
            raise
        state = self.container.attrs.get("State") or {}
        status = state.get("Status")
        restarted = (
            int(self.container.attrs.get("RestartCount", 0) or 0) > self._restarts or status == "restarting"
        )
        dead = status in ("exited", "dead", "removing") or bool(state.get("OOMKilled")) or restarted
        return ProcessState(
            running=status == "running",
            dead=dead,
            exit_code=state.get("ExitCode"),
            oom_killed=bool(state.get("OOMKilled")),
            restarted=restarted,
        )

    def log_tail(self, lines: int) -> str:
        try:
            return str(self.container.logs(tail=lines).decode("utf-8", "replace"))
        except Exception:
            return ""


def _existing(
    container: Any | None, spec: ContainerSpec, api_key: str | None, served: str
) -> ExistingServer | None:
    if container is None:
        return None
    labels = container.labels or {}
    running = container.status == "running"
    return ExistingServer(
        owned=ours(container),
        plan_hash=labels.get(Label.PLAN_HASH),
        state=str(container.status),
        serving=running and served in (models(endpoint(spec), api_key) or []),
    )


class ContainerLaunch:
    """The docker runtime's launch primitives for one container, `part` (runtime/flow.py runs
    the flow): an aggregated server, or a part of a P/D group (runtime/docker_group.py)."""

    def __init__(self, part: ContainerRun, options: LaunchOptions, client: Any, cwd: str) -> None:
        self.part = part
        self.cwd = cwd  # where launch ran, for the plan record (ContainerRun.launched_labels)
        self.spec = part.spec
        self.options = options
        self.client = client
        self.served = part.deployment.plan.settings.model.served_name
        self.created = False  # whether this launch created its container
        # Its API port is the namespace owner's where it joins another's (flow checks it is free).
        self.publishes = part.network_of is None

    def claim(self) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()  # the engine's create-by-name is atomic: the loser joins

    def find(self, api_key: str | None) -> Found[Any] | None:
        container = engine_api.find_container(self.client, self.spec.name)
        existing = _existing(container, self.spec, api_key, self.served)
        return None if existing is None else Found(existing, container)

    def resume(self, container: Any) -> None:
        if container.status == "created":
            container.start()  # a second start of a started container is a no-op (304)

    def remove(self, container: Any) -> None:
        engine_api.remove_if_present(container)

    def prepare(self) -> None:
        if engine_api.local_image(self.client, self.spec.image) is None:
            self.options.on_phase(Phase.PULLING, 0.0)
        _ensure_image(self.client, self.spec.image, self.options.report, self.options.pull_progress)

    def create(self) -> Any:
        container = _create_and_start(self.client, self.part, self.options.environ, self.cwd)
        self.created = True
        return container

    def handle(self, container: Any) -> ContainerHandle:
        return ContainerHandle(container)

    def endpoint(self, container: Any) -> str:
        return endpoint(self.spec)

    def died(self, container: Any, error: ServerDied) -> ServerDied:
        # Leave a server that died while loading stopped, with its logs: under a restart policy
        # it would load (and die) again and again, each time re-reading the checkpoint.
        engine_api.stop_for_good(container)
        retry = (
            f"it is stopped, with its logs (m31ctl logs --name {self.spec.name}); m31ctl launch replaces it"
        )
        return ServerDied(
            error.message, hint=f"{error.hint}; {retry}" if error.hint else retry, details=error.details
        )

    def describe(self, container: Any) -> str:
        return self.spec.name

    def started(self, container: Any) -> str:
        return f"started {self.spec.name} ({container.short_id}) from {self.spec.image}"


def _create_and_start(client: Any, part: ContainerRun, environ: Mapping[str, str], cwd: str) -> Any:
    """Create then start. A name taken meanwhile is a ConflictError (the caller may join the
    winner); a container of ours that fails to start is removed by its id, never by name, so a
    concurrent launch's container is never touched."""
    spec = part.spec
    try:
        container = create_container(
            client,
            spec,
            part.environ(environ),
            part.launched_labels(cwd),
            attachment=part.attachment,
            entrypoint=part.entrypoint,
            published=part.published,
            network_of=part.network_of,
        )
    except Exception as exc:
        if engine_api.is_conflict(exc):
            raise ConflictError(
                f"a container named {spec.name} was created meanwhile", hint="pass --name to use another name"
            ) from None
        raise _start_error(exc, spec) from None
    try:
        container.start()
    except Exception as exc:
        engine_api.remove_if_present(container)  # ours, by id: it never started, no state to keep
        raise _start_error(exc, spec) from None
    return container


def _start_error(exc: Exception, spec: ContainerSpec) -> Exception:
    text = engine_api.api_error_text(exc)
    if text is None:
        return exc
    d = explain_exit(text, None, False)
    return HostPreconditionError(
        f"Docker could not start {spec.name}: {d.summary} ({text[:200]})", hint=d.remedy
    )


def _ensure_image(client: Any, image: str, report: Reporter, progress: PullProgress) -> None:
    if engine_api.local_image(client, image) is not None:
        return
    report(f"pulling {image}")
    repository, _, tag = image.rpartition(":") if ":" in image.split("/")[-1] else (image, "", "latest")
    try:
        for event in client.api.pull(repository, tag=tag or "latest", stream=True, decode=True):
            interrupt.check()  # Ctrl-C stops the pull between its progress events
            if "error" in event:
                raise _pull_error(image, str(event["error"]))
            detail = event.get("progressDetail") or {}
            if event.get("id") and detail.get("total"):
                progress(PullEvent(str(event["id"]), int(detail.get("current", 0)), int(detail["total"])))
    except M31Error:
        raise
    except Exception as exc:
        text = engine_api.api_error_text(exc)
        if text is None:
            raise
        raise _pull_error(image, text) from None
    finally:
        progress(None)


def _pull_error(image: str, text: str) -> M31Error:
    lowered = text.lower()
    if "not found" in lowered or "manifest unknown" in lowered or "does not exist" in lowered:
        return HostPreconditionError(
            f"image {image} not found in its registry",
            hint="check engine.image; day-zero images are vllm/vllm-openai:minimax-m31-flash "
            "and vllm/vllm-openai-rocm:minimax-m31-flash",
        )
    if "denied" in lowered or "unauthorized" in lowered:
        return HostPreconditionError(f"pulling {image} was denied", hint="docker login to the registry first")
    if "toomanyrequests" in lowered or "rate limit" in lowered:
        return HostPreconditionError(
            f"the registry rate-limited the pull of {image}", hint="docker login, or wait and retry"
        )
    return HostPreconditionError(
        f"cannot pull {image}: no route to its registry ({text[:160]})",
        hint="check the network or proxy, or `docker load` the image",
    )
