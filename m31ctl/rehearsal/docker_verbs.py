"""What the rehearsal asks of Docker around its pods, over the program's one client
(m31ctl/runtime/engine_api.py): a derived image, a network's free subnet, volumes, a container
run to its end, logs by stream, cleanup by label (what is done to a pod's container is the
kubelet's, kubelet.py). Each answers as the `docker` CLI it replaced did (exit codes, which stream
a line came from), so the rehearsal's results read the same. The Engine's refusals come through
engine_api.refusals(); a lost Engine goes on up to engine_api's boundary."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any, NamedTuple

from m31ctl import interrupt
from m31ctl.runtime import engine_api
from m31ctl.runtime.engine_api import refusals


class Ran(NamedTuple):
    """A command's end: its exit code (124: it ran past its timeout, as coreutils' `timeout`
    says), its stdout and its stderr."""

    code: int
    out: str
    err: str

    @property
    def ok(self) -> bool:
        return self.code == 0


def decoded(data: bytes | None) -> str:
    """A stream's bytes as text, as the CLI printed them (undecodable bytes replaced)."""
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
    try:
        with refusals() as refused:
            client.images.build(
                fileobj=io.BytesIO(dockerfile.encode()), tag=tag, rm=True, forcerm=True, timeout=timeout
            )
    except OSError:  # requests' read timeout or lost connection (the Engine's refusals are above)
        return f"docker build timed out after {timeout:g} s"
    return refused.reason


def free_subnet(client: Any, name: str, labels: Mapping[str, str]) -> str | None:
    """A subnet no other network holds, as Docker's own pool allocator picks one: a network is
    made under `name` and removed again, and its subnet returned (None: the engine refused)."""
    subnet = None
    with refusals():
        made = client.networks.create(name, labels=dict(labels))
        try:
            made.reload()
            configs = made.attrs.get("IPAM", {}).get("Config") or []
            subnet = next((str(c["Subnet"]) for c in configs if ":" not in str(c.get("Subnet", ":"))), None)
        finally:
            made.remove()
    return subnet


def create_volume(client: Any, name: str, labels: Mapping[str, str]) -> str | None:
    with refusals() as refused:
        client.volumes.create(name, labels=dict(labels))
    return refused.reason


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
    created: dict[str, Any] = {}
    try:
        with refusals() as refused:
            created = client.api.create_container(host_config=client.api.create_host_config(**host), **create)
            client.api.start(created["Id"])
        if refused.reason is not None:
            return Ran(run_exit_code(refused.reason), "", refused.reason)
        code = wait_exit(client, created["Id"], timeout)
        out, err = logs_by_stream(client, created["Id"], timestamps=False)
        if code is None:
            return Ran(124, out, f"docker run timed out after {timeout:g} s")
        return Ran(code, out, err)
    finally:
        if created:
            with interrupt.shielded():
                engine_api.remove_named(client, created["Id"])


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
    params = {"stdout": 1, "stderr": 1, "timestamps": int(timestamps), "tail": tail if tail else "all"}
    api = client.api
    with refusals() as refused:
        answer = api._get(api._url("/containers/{0}/logs", container), params=params)
        api._raise_for_status(answer)
    if refused.reason is not None:
        return "", ""
    data, at = answer.content, 0
    streams: dict[int, list[bytes]] = {1: [], _STDERR: []}
    while len(data) - at >= _FRAME_HEADER:
        kind, length = data[at], int.from_bytes(data[at + 4 : at + _FRAME_HEADER], "big")
        start = at + _FRAME_HEADER
        streams.setdefault(kind, []).append(data[start : start + length])
        at = start + length
    return decoded(b"".join(streams[1])), decoded(b"".join(streams[_STDERR]))


def remove_labelled(client: Any, label: str, value: str) -> list[str]:
    """Remove every container (with its anonymous volumes), network and volume carrying
    label=value; what could not be removed, one message a kind (empty when all is gone)."""
    failed: dict[str, list[tuple[str, str]]] = {}
    for thing in engine_api.labelled_objects(client, label, value):
        with refusals() as refused:
            thing.remove()
        if refused.reason is not None and not refused.missing:  # gone meanwhile: removed all the same
            failed.setdefault(thing.kind, []).append((thing.short, refused.reason))
    return [
        f"{kind}s {' '.join(s for s, _ in found)}: {'; '.join(why for _, why in found)[-300:]}"
        for kind, found in failed.items()
    ]


def tag_image(client: Any, image: str, tag: str) -> str | None:
    """`docker tag IMAGE TAG` (a second name for the same image, no registry); None when done,
    else the engine's reason."""
    repository, _, name = tag.rpartition(":")
    with refusals() as refused:
        client.api.tag(image, repository, name)
    return refused.reason


def untag_image(client: Any, tag: str) -> str | None:
    """`docker rmi TAG` of a second name: the name goes, the image stays under its first."""
    with refusals() as refused:
        client.api.remove_image(tag, noprune=True)
    return refused.reason
