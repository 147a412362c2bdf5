"""The Docker Engine edge: the program's one Docker client (launch, status, stop, doctor, the lock,
the throwaway check containers and the rehearsal), the only module that imports the docker SDK,
and its one error boundary. Everything else holds an opaque client and calls the helpers here;
nothing in m31ctl runs the `docker` CLI (tests/test_architecture.py)."""

from __future__ import annotations

import contextlib
import io
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any, NamedTuple

from m31ctl import interrupt
from m31ctl.errors import DockerUnreachable, HostPreconditionError, M31Error, NotReadyError
from m31ctl.labels import Label


def connect(timeout: float = 10.0) -> Any:
    """A docker.DockerClient that answered a ping, or DockerUnreachable saying why."""
    # lazy: the docker SDK costs start-up (render imports this module)
    import docker
    from docker.errors import DockerException

    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
    except DockerException as exc:
        raise DockerUnreachable(
            f"cannot reach the Docker Engine at {host}: {_reason(exc)}", hint=_hint(exc)
        ) from None
    return client


def _reason(exc: Exception) -> str:
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
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import APIError, DockerException, NotFound
    from requests.exceptions import ConnectionError as RequestsConnectionError
    from requests.exceptions import ReadTimeout

    try:
        yield
    except M31Error:
        raise
    except NotFound as exc:
        raise NotReadyError(
            f"the container vanished while m31ctl was {doing} ({explanation(exc)[:160]})",
            hint="something removed it; `m31ctl status` shows what is left, and `m31ctl launch` starts it again",
        ) from None
    except APIError as exc:
        raise HostPreconditionError(
            f"the Docker Engine refused while m31ctl was {doing}: {explanation(exc)[:200]}",
            hint="see `docker info` and the engine's log",
        ) from None
    except (RequestsConnectionError, ReadTimeout, DockerException) as exc:
        raise DockerUnreachable(
            f"lost the Docker Engine while {doing}: {_reason(exc)}", hint=_hint(exc)
        ) from None


def find_container(client: Any, name: str) -> Any | None:
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import NotFound

    try:
        return client.containers.get(name)
    except NotFound:
        return None


def is_not_found(exc: BaseException) -> bool:
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import NotFound

    return isinstance(exc, NotFound)


def is_conflict(exc: BaseException) -> bool:
    """The engine refused because the name is taken (HTTP 409): its create-by-name is atomic."""
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import APIError

    return isinstance(exc, APIError) and exc.status_code == 409


def remove_if_present(container: Any) -> None:
    """Force-remove this container (by id); one removed meanwhile is removed all the same."""
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import NotFound

    with contextlib.suppress(NotFound):
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
            _remove_named(client, name)


def _remove_named(client: Any, name: str) -> None:
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import APIError, NotFound

    try:
        client.api.remove_container(name, force=True)
    except NotFound:
        pass  # never created, or gone already
    except APIError:
        pass  # the engine refuses now (removal already in progress): nothing more to do here


def stop_for_good(container: Any) -> None:
    """Stop a container and take its restart policy away, keeping it and its logs."""
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import APIError

    try:
        container.update(restart_policy={"Name": "no"})
        container.stop(timeout=10)
    except APIError:
        pass  # gone meanwhile, or stopped already: nothing is restarting it


def local_image(client: Any, name: str) -> Any | None:
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import ImageNotFound

    try:
        return client.images.get(name)
    except ImageNotFound:
        return None


def registry_error(client: Any, name: str) -> str | None:
    """None when the image's registry knows it; else what the engine said."""
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import APIError

    try:
        client.api.inspect_distribution(name)
    except APIError as exc:
        return str(exc)
    return None


def api_error_text(exc: BaseException) -> str | None:
    """The text of a Docker API error, or None for any other exception."""
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import APIError

    return explanation(exc) if isinstance(exc, APIError) else None


# What the rehearsal drives (m31ctl/rehearsal): networks, volumes, a derived image, containers
# run detached or to their end, exec probes with a timeout, logs by stream, cleanup by label.
# Each answers as the `docker` CLI it replaced did (exit codes, which stream a line came from),
# so the rehearsal's results read the same.


class Ran(NamedTuple):
    """A command's end: its exit code (124: it ran past its timeout, as coreutils' `timeout`
    says), its stdout and its stderr."""

    code: int
    out: str
    err: str

    @property
    def ok(self) -> bool:
        return self.code == 0


def _text(data: bytes | None) -> str:
    return (data or b"").decode("utf-8", "replace")


def run_exit_code(message: str) -> int:
    """The exit code `docker run` gives for the engine refusing to create or start a container
    (docker/cli cli/command/container/run.go, runStartContainerErr): 127 for a command that is
    not there, 126 for one that cannot be run, else 125."""
    if any(s in message for s in ("executable file not found", "no such file or directory")):
        return 127
    if "permission denied" in message or "is a directory" in message:
        return 126
    return 125


def build_image(client: Any, tag: str, dockerfile: str, timeout: float) -> str | None:
    """Build `tag` from a Dockerfile with no context (`docker build -`) with the Engine's classic
    builder (the API's default: BuildKit would need buildx), intermediate containers removed even
    on failure; None when built, else why not."""
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import APIError, BuildError
    from requests.exceptions import ConnectionError as RequestsConnectionError
    from requests.exceptions import ReadTimeout

    try:
        client.images.build(
            fileobj=io.BytesIO(dockerfile.encode()), tag=tag, rm=True, forcerm=True, timeout=timeout
        )
    except BuildError as exc:
        return str(exc.msg)
    except APIError as exc:
        return explanation(exc)
    except (ReadTimeout, RequestsConnectionError):
        return f"docker build timed out after {timeout:g} s"
    return None


def create_network(
    client: Any, name: str, labels: Mapping[str, str], subnet: str | None = None
) -> str | None:
    """A bridge network (with `subnet`, one whose addresses may be given: Docker assigns a
    container a fixed address only on a network with a subnet of the user's); None when made,
    else the engine's reason."""
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import APIError
    from docker.types import IPAMConfig, IPAMPool

    ipam = IPAMConfig(pool_configs=[IPAMPool(subnet=subnet)]) if subnet else None
    try:
        client.networks.create(name, labels=dict(labels), ipam=ipam)
    except APIError as exc:
        return explanation(exc)
    return None


def free_subnet(client: Any, name: str, labels: Mapping[str, str]) -> str | None:
    """A subnet no other network holds, as Docker's own pool allocator picks one: a network is
    made under `name` and removed again, and its subnet returned (None: the engine refused)."""
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import APIError

    try:
        made = client.networks.create(name, labels=dict(labels))
        try:
            made.reload()
            configs = made.attrs.get("IPAM", {}).get("Config") or []
            return next((str(c["Subnet"]) for c in configs if ":" not in str(c.get("Subnet", ":"))), None)
        finally:
            made.remove()
    except APIError:
        return None


def create_volume(client: Any, name: str, labels: Mapping[str, str]) -> str | None:
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import APIError

    try:
        client.volumes.create(name, labels=dict(labels))
    except APIError as exc:
        return explanation(exc)
    return None


def run_detached(
    client: Any,
    *,
    host: Mapping[str, Any],
    network: str | None = None,
    aliases: Sequence[str] = (),
    address: str | None = None,
    **create: Any,
) -> Ran:
    """`docker run -d`: create (`create`: the Engine API's create_container arguments; `host`:
    create_host_config's) and start. Ran(0, id, "") when started, else run's exit code and the
    engine's reason (a container created but not started stays, with its labels)."""
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import APIError

    host_config = client.api.create_host_config(**host, **({"network_mode": network} if network else {}))
    if network:
        endpoint = client.api.create_endpoint_config(aliases=list(aliases) or None, ipv4_address=address)
        create["networking_config"] = client.api.create_networking_config({network: endpoint})
    try:
        created = client.api.create_container(host_config=host_config, **create)
        client.api.start(created["Id"])
    except APIError as exc:
        said = explanation(exc)
        return Ran(run_exit_code(said), "", said)
    return Ran(0, str(created["Id"]), "")


def kill(client: Any, container: str) -> str | None:
    """`docker kill`: SIGKILL, as a node lost or an OOM kill ends a process; None when done,
    else the engine's reason."""
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import APIError

    try:
        client.api.kill(container)
    except APIError as exc:
        return explanation(exc)
    return None


def start_again(client: Any, container: str) -> str | None:
    """`docker start` of a container that ended: the same container (its name, address and
    environment), as the kubelet restarts a pod's container in place; None when started."""
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import APIError

    try:
        client.api.start(container)
    except APIError as exc:
        return explanation(exc)
    return None


def wait_exit(client: Any, container: str, timeout: float) -> int | None:
    """The container's exit code once it ends (`docker wait`); None when it did not end within
    `timeout` or is gone. Waited on in a thread, so Ctrl-C stops the wait at once."""
    try:
        answer = interrupt.call(lambda: client.api.wait(container, timeout=timeout))
    except Exception:  # a read timeout, or the container gone: no exit code to report
        return None
    return int(answer.get("StatusCode", -1))


def run_to_end(client: Any, timeout: float, *, host: Mapping[str, Any], **create: Any) -> Ran:
    """`docker run --rm` attached: create, start, wait up to `timeout`, then its output by stream;
    the container is removed afterwards whatever happened (a second Ctrl-C asks first)."""
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import APIError

    created: dict[str, Any] = {}
    try:
        created = client.api.create_container(host_config=client.api.create_host_config(**host), **create)
        client.api.start(created["Id"])
        code = wait_exit(client, created["Id"], timeout)
        out, err = logs_by_stream(client, created["Id"], timestamps=False)
        if code is None:
            return Ran(124, out, f"docker run timed out after {timeout:g} s")
        return Ran(code, out, err)
    except APIError as exc:
        said = explanation(exc)
        return Ran(run_exit_code(said), "", said)
    finally:
        if created:
            with interrupt.shielded():
                _remove_named(client, created["Id"])


def exec_in(client: Any, container: str, argv: Sequence[str], timeout: float) -> Ran:
    """`docker exec` with a timeout: the command's exit code and output; Ran(124, ...) when it
    did not end within `timeout` (the command runs on in the container, as it did when the
    timed-out CLI was killed). The Engine API's exec has no timeout of its own: it runs in a
    daemon thread and is waited for with interrupt.join, which Ctrl-C ends at once."""
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import APIError

    box: list[Ran] = []

    def run() -> None:
        try:
            made = client.api.exec_create(container, list(argv))
            out, err = client.api.exec_start(made["Id"], demux=True)
            code = client.api.exec_inspect(made["Id"]).get("ExitCode")
            box.append(Ran(int(code if code is not None else -1), _text(out), _text(err)))
        except APIError as exc:  # not running, or gone: the CLI's exit 1 with the engine's words
            box.append(Ran(1, "", explanation(exc)))
        except Exception as exc:  # the engine's connection: a failed probe, not a crash
            box.append(Ran(1, "", _reason(exc)))

    thread = threading.Thread(target=run, name="m31ctl exec", daemon=True)
    thread.start()
    interrupt.join(thread, timeout)
    if not box:
        return Ran(124, "", f"docker exec timed out after {timeout:g} s")
    return box[0]


def container_state(client: Any, container: str) -> tuple[str, int, str]:
    """(status, exit code, IP on its network); status '' when the container is gone."""
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import APIError

    try:
        info = client.api.inspect_container(container)
    except APIError:
        return "", -1, ""
    networks = (info.get("NetworkSettings") or {}).get("Networks") or {}
    ip = next((n["IPAddress"] for n in networks.values() if n.get("IPAddress")), "")
    state = info.get("State") or {}
    return str(state.get("Status", "")), int(state.get("ExitCode", -1)), ip


# The Engine API's multiplexed log stream (non-TTY containers): an 8-byte header per frame, its
# first byte the stream (1 stdout, 2 stderr), its last four the frame's length, big-endian.
_FRAME_HEADER = 8
_STDERR = 2


def logs_by_stream(
    client: Any, container: str, tail: int | None = None, timestamps: bool = True
) -> tuple[str, str]:
    """(stdout, stderr) of a container, each line with its RFC 3339 time (`docker logs
    --timestamps`) unless `timestamps` is False, `tail` lines of the two together as `docker logs
    --tail` counts them; ('', '') when it is gone. The SDK's logs() joins the two streams; the
    frames say which is which."""
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import APIError

    params = {"stdout": 1, "stderr": 1, "timestamps": int(timestamps), "tail": tail if tail else "all"}
    api = client.api
    try:
        answer = api._get(api._url("/containers/{0}/logs", container), params=params)
        api._raise_for_status(answer)
    except APIError:
        return "", ""
    data, at = answer.content, 0
    streams: dict[int, list[bytes]] = {1: [], _STDERR: []}
    while len(data) - at >= _FRAME_HEADER:
        kind, length = data[at], int.from_bytes(data[at + 4 : at + _FRAME_HEADER], "big")
        start = at + _FRAME_HEADER
        streams.setdefault(kind, []).append(data[start : start + length])
        at = start + length
    return _text(b"".join(streams[1])), _text(b"".join(streams[_STDERR]))


def _labelled(client: Any, label: str, value: str) -> list[tuple[str, str, Callable[[], Any]]]:
    """(kind, short id, its removal) of every container, network and volume carrying
    label=value, in the order they can be removed (containers hold networks and volumes)."""
    wanted = {"label": f"{label}={value}"}
    found: list[tuple[str, str, Callable[[], Any]]] = []
    for c in client.containers.list(all=True, filters=wanted):
        found.append(("container", c.id[:12], partial(c.remove, force=True, v=True)))
    for n in client.networks.list(filters=wanted):
        found.append(("network", n.id[:12], n.remove))
    for v in client.volumes.list(filters=wanted):
        found.append(("volume", v.name, partial(v.remove, force=True)))
    return found


def labelled(client: Any, label: str, value: str) -> list[str]:
    """The ids (volumes: names) of what carries label=value, as `docker ps -aq`, `network ls -q`
    and `volume ls -q` list them."""
    return [short for _, short, _ in _labelled(client, label, value)]


def remove_labelled(client: Any, label: str, value: str) -> list[str]:
    """Remove every container (with its anonymous volumes), network and volume carrying
    label=value; what could not be removed, one message a kind (empty when all is gone)."""
    # lazy: the docker SDK costs start-up (render imports this module)
    from docker.errors import APIError, NotFound

    failed: dict[str, list[tuple[str, str]]] = {}
    for kind, short, remove in _labelled(client, label, value):
        try:
            remove()
        except NotFound:
            pass  # gone meanwhile: removed all the same
        except APIError as exc:
            failed.setdefault(kind, []).append((short, explanation(exc)))
    return [
        f"{kind}s {' '.join(s for s, _ in found)}: {'; '.join(why for _, why in found)[-300:]}"
        for kind, found in failed.items()
    ]
