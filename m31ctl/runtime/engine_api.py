"""The Docker Engine edge: the program's one Docker client (launch, status, stop, doctor, the lock,
the throwaway check containers; the rehearsal's own verbs, m31ctl/rehearsal/docker_verbs.py, are
built on it), the only module that imports the docker SDK, and its one error boundary. Everything
else holds an opaque client, calls the helpers here and takes the Engine's refusals through
`refusals()`; nothing in m31ctl runs the `docker` CLI (tests/test_architecture.py)."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

from m31ctl import interrupt
from m31ctl.errors import DockerUnreachable, HostPreconditionError, M31Error, NotReadyError
from m31ctl.labels import Label

# A client that stops containers: docker-py waits for `POST /containers/ID/stop` for its client
# timeout plus the stop's grace, so this is what the Engine has to kill and reap a container
# once its grace is over. 10 s was not enough beside a busy neighbour (CI, stop 58: a vLLM
# container's stop after its 35 s grace read "Read timed out. (read timeout=45.0)").
STOPPING_TIMEOUT_S = 60.0


def _sdk() -> Any:
    """The docker SDK, its errors and types loaded, imported on first use."""
    # lazy: the SDK and the requests under it take a fifth of `m31ctl render`'s start-up (0.21 s
    # to 0.26 s, measured), and render, smoke and `launch --dry-run` import this module (lockfile
    # -> runtime -> runtime.protocol -> runtime.load_run) without ever reaching the Engine
    import docker
    import docker.errors
    import docker.types

    return docker


def connect(timeout: float = 10.0) -> Any:
    """A docker.DockerClient that answered a ping, or DockerUnreachable saying why."""
    sdk = _sdk()
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        client = sdk.from_env(timeout=timeout)
        client.ping()
    except sdk.errors.DockerException as exc:
        raise DockerUnreachable(
            f"cannot reach the Docker Engine at {host}: {reason(exc)}", hint=_hint(exc)
        ) from None
    return client


def reason(exc: Exception) -> str:
    """Why the Engine could not be reached (or answered no more), in a few words."""
    text = str(exc)
    if "Permission denied" in text:
        return "permission denied on the socket"
    if "No such file" in text or "FileNotFoundError" in text:
        return "no socket (is dockerd running?)"
    if "Connection refused" in text:
        return "connection refused (is dockerd running?)"
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _hint(exc: Exception) -> str:
    if "Permission denied" in str(exc):
        return "add your user to the docker group, or run as root"
    return "start the daemon (systemctl start docker) or set DOCKER_HOST"


def explanation(exc: Exception) -> str:
    """The Engine's own words for an API error (its JSON 'message'), else the exception text."""
    text = getattr(exc, "explanation", None) or str(exc)
    return str(text.decode("utf-8", "replace") if isinstance(text, bytes) else text)


@contextlib.contextmanager
def engine_boundary(doing: str) -> Iterator[None]:
    """The one place Docker SDK errors become m31ctl errors with documented exit codes:
    a container that vanished under us (removed, or its engine restarted) is a server that
    died (5); a lost connection is an unreachable engine (3); any other refusal by the engine
    is a host precondition (6), with the engine's own message."""
    errors = _sdk().errors
    # lazy: requests comes with the SDK, loaded on first use for the reason _sdk() gives
    from requests.exceptions import ConnectionError as RequestsConnectionError
    from requests.exceptions import ReadTimeout

    try:
        yield
    except M31Error:
        raise
    except errors.NotFound as exc:
        raise NotReadyError(
            f"the container vanished while m31ctl was {doing} ({explanation(exc)[:160]})",
            hint="something removed it; `m31ctl status` shows what is left, and `m31ctl launch` starts it again",
        ) from None
    except errors.APIError as exc:
        raise HostPreconditionError(
            f"the Docker Engine refused while m31ctl was {doing}: {explanation(exc)[:200]}",
            hint="see `docker info` and the engine's log",
        ) from None
    except (RequestsConnectionError, ReadTimeout, errors.DockerException) as exc:
        raise DockerUnreachable(
            f"lost the Docker Engine while {doing}: {reason(exc)}", hint=_hint(exc)
        ) from None


@dataclass
class Refusal:
    """The Engine's refusal of a request made inside `refusals()`: its words (None: no refusal)
    and whether it refused because the thing is not there (never made, or gone meanwhile)."""

    reason: str | None = None
    missing: bool = False


@contextlib.contextmanager
def refusals() -> Iterator[Refusal]:
    """Within it, the Engine refusing a request (an API error, a failed build) ends the block
    and is kept in the Refusal it yields; anything else (a lost connection, a bug) goes on up,
    to engine_boundary. Code outside this module answers a refusal without the SDK's classes."""
    errors = _sdk().errors
    refusal = Refusal()
    try:
        yield refusal
    except errors.BuildError as exc:
        refusal.reason = str(exc.msg)
    except errors.APIError as exc:
        refusal.reason, refusal.missing = explanation(exc), isinstance(exc, errors.NotFound)


def find_container(client: Any, name: str) -> Any | None:
    try:
        return client.containers.get(name)
    except _sdk().errors.NotFound:
        return None


def is_not_found(exc: BaseException) -> bool:
    return isinstance(exc, _sdk().errors.NotFound)


def is_conflict(exc: BaseException) -> bool:
    """The engine refused because the name is taken (HTTP 409): its create-by-name is atomic."""
    return isinstance(exc, _sdk().errors.APIError) and exc.status_code == 409


def remove_if_present(container: Any) -> None:
    """Force-remove this container (by id); one removed meanwhile is removed all the same."""
    with contextlib.suppress(_sdk().errors.NotFound):
        container.remove(force=True)


@contextlib.contextmanager
def throwaway(client: Any, purpose: str, **create: Any) -> Iterator[Any]:
    """A container created for a check (`create`: the Engine API's create_container arguments),
    removed whatever happens after the Engine is asked to create it: an error in start or wait,
    a timeout, Ctrl-C. It gets a unique name first, so that even an interrupt that lands while the
    create request is in flight (the Engine made it, its id never reached us) removes it."""
    name = f"m31ctl-{purpose}-{uuid.uuid4().hex[:12]}"
    labels = {**create.pop("labels", {}), Label.THROWAWAY: purpose}
    try:
        created = client.api.create_container(name=name, labels=labels, **create)
        yield client.containers.get(created["Id"])
    finally:
        with interrupt.shielded():  # a second Ctrl-C asks first: the removal runs to its end
            remove_named(client, name)


def remove_named(client: Any, name: str) -> None:
    """Force-remove a container by name or id: one never created, gone already or being
    removed is no error (nothing more to do here)."""
    with refusals():
        client.api.remove_container(name, force=True)


def stop_for_good(container: Any) -> None:
    """Stop a container and take its restart policy away, keeping it and its logs."""
    try:
        container.update(restart_policy={"Name": "no"})
        container.stop(timeout=10)
    except _sdk().errors.APIError:
        pass  # gone meanwhile, or stopped already: nothing is restarting it


def local_image(client: Any, name: str) -> Any | None:
    try:
        return client.images.get(name)
    except _sdk().errors.ImageNotFound:
        return None


def registry_error(client: Any, name: str) -> str | None:
    """None when the image's registry knows it; else what the engine said."""
    try:
        client.api.inspect_distribution(name)
    except _sdk().errors.APIError as exc:
        return str(exc)
    return None


def api_error_text(exc: BaseException) -> str | None:
    """The text of a Docker API error, or None for any other exception."""
    return explanation(exc) if isinstance(exc, _sdk().errors.APIError) else None


def create_network(
    client: Any, name: str, labels: Mapping[str, str], subnet: str | None = None
) -> str | None:
    """A bridge network (with `subnet`, one whose addresses may be given: Docker assigns a
    container a fixed address only on a network with a subnet of the user's); None when made,
    else the engine's reason."""
    types = _sdk().types
    ipam = types.IPAMConfig(pool_configs=[types.IPAMPool(subnet=subnet)]) if subnet else None
    with refusals() as refused:
        client.networks.create(name, labels=dict(labels), ipam=ipam)
    return refused.reason


class Labelled(NamedTuple):
    kind: str  # container | network | volume
    short: str  # its short id (a volume: its name)
    remove: Callable[[], Any]  # forced; a container goes with its anonymous volumes


def labelled_objects(client: Any, label: str, value: str) -> list[Labelled]:
    """Every container, network and volume carrying label=value, in the order they can be
    removed (containers hold networks and volumes)."""
    wanted = {"label": f"{label}={value}"}
    found: list[Labelled] = []
    for c in client.containers.list(all=True, filters=wanted):
        found.append(Labelled("container", c.id[:12], partial(c.remove, force=True, v=True)))
    for n in client.networks.list(filters=wanted):
        found.append(Labelled("network", n.id[:12], n.remove))
    for v in client.volumes.list(filters=wanted):
        found.append(Labelled("volume", v.name, partial(v.remove, force=True)))
    return found


def labelled(client: Any, label: str, value: str) -> list[str]:
    """The ids (volumes: names) of what carries label=value, as `docker ps -aq`, `network ls -q`
    and `volume ls -q` list them."""
    return [thing.short for thing in labelled_objects(client, label, value)]
