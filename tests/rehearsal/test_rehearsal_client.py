"""The rehearsal's Docker verbs (m31ctl/rehearsal/docker_verbs.py, and the kubelet's own for a
pod's container, m31ctl/rehearsal/kubelet.py) and the calls of the one Docker client
(m31ctl/runtime/engine_api.py) they stand on, against the real Engine, with the stand-in engine image (busybox, seconds): each answers as the `docker` CLI it
replaced did, checked against the CLI itself where the CLI is the reference (exit codes, which
stream a log line is on, what a label filter lists)."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from m31ctl.labels import Label
from m31ctl.rehearsal import docker_verbs
from m31ctl.rehearsal.kubelet import container_state, run_detached
from m31ctl.rehearsal.prober import exec_in
from m31ctl.runtime import engine_api

pytestmark = pytest.mark.docker

IMAGE = "m31ctl-test/engine:ready"


@pytest.fixture(scope="module")
def client() -> Any:
    from tests.dockerlib import build_engine_images

    found = engine_api.connect(timeout=120)
    if engine_api.local_image(found, IMAGE) is None:
        build_engine_images(found)
    return found


@pytest.fixture
def session(client: Any) -> Iterator[str]:
    name = f"t{uuid.uuid4().hex[:8]}"
    yield name
    assert docker_verbs.remove_labelled(client, Label.REHEARSAL, name) == []
    assert engine_api.labelled(client, Label.REHEARSAL, name) == []


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120, check=False)


def _shell(client: Any, session: str, name: str, script: str, **extra: Any) -> docker_verbs.Ran:
    return run_detached(
        client,
        name=name,
        image=IMAGE,
        labels={Label.REHEARSAL: session},
        entrypoint=["/bin/sh"],
        command=["-c", script],
        host=extra.pop("host", {}),
        **extra,
    )


def test_a_pod_on_its_network_answers_exec_and_state(client, session):
    network = f"m31ctl-rh-{session}"
    assert engine_api.create_network(client, network, {Label.REHEARSAL: session}) is None
    started = _shell(client, session, f"{network}-a", "exec sleep 600", network=network, aliases=["pod-a"])
    assert started.ok, started.err
    status, code, ip = container_state(client, f"{network}-a")
    assert status == "running" and ip and code == 0
    # The alias resolves on the network, as `--network-alias` made it.
    peer = docker_verbs.run_to_end(
        client,
        120,
        host={"network_mode": network},
        image=IMAGE,
        labels={Label.REHEARSAL: session},
        entrypoint=["/bin/sh"],
        command=["-c", "ping -c 1 -W 5 pod-a >/dev/null && echo reached"],
    )
    assert peer == docker_verbs.Ran(0, "reached\n", ""), peer
    done = exec_in(client, f"{network}-a", ["/bin/sh", "-c", "echo out; echo err >&2; exit 3"], 120)
    assert done == docker_verbs.Ran(3, "out\n", "err\n")
    # A probe that outlives its timeout: 124, as a timed-out `docker exec` was reported.
    late = exec_in(client, f"{network}-a", ["sleep", "600"], 1)
    assert late == docker_verbs.Ran(124, "", "docker exec timed out after 1 s")
    assert container_state(client, "m31ctl-rh-no-such-container") == ("", -1, "")


def test_logs_come_back_by_stream_as_the_cli_gives_them(client, session):
    name = f"m31ctl-rh-{session}-logs"
    done = docker_verbs.run_to_end(
        client,
        120,
        host={},
        name=name,
        image=IMAGE,
        labels={Label.REHEARSAL: session},
        entrypoint=["/bin/sh"],
        command=["-c", "echo o1; echo e1 >&2; echo o2; echo e2 >&2; exit 4"],
    )
    assert done == docker_verbs.Ran(4, "o1\no2\n", "e1\ne2\n")
    kept = _shell(client, session, name, "echo o1; echo e1 >&2; echo o2; echo e2 >&2")
    assert kept.ok
    assert docker_verbs.wait_exit(client, name, 120) == 0
    for tail in (None, 1, 3):
        cli = _cli("logs", "--timestamps", *(["--tail", str(tail)] if tail else []), name)
        assert docker_verbs.logs_by_stream(client, name, tail) == (cli.stdout, cli.stderr)
    out, err = docker_verbs.logs_by_stream(client, name)
    assert out.count("Z o") == 2 and err.count("Z e") == 2
    assert docker_verbs.logs_by_stream(client, "m31ctl-rh-no-such-container") == ("", "")


def test_a_start_the_engine_refuses_gets_the_clis_exit_code(client, session):
    assert _shell(client, session, f"m31ctl-rh-{session}-x", "true", host={}).ok
    refused = run_detached(
        client,
        name=f"m31ctl-rh-{session}-nope",
        image=IMAGE,
        labels={Label.REHEARSAL: session},
        entrypoint=["/no/such/command"],
        host={},
    )
    cli = _cli(
        "run", "-d", "--label", f"{Label.REHEARSAL}={session}", "--entrypoint", "/no/such/command", IMAGE
    )
    assert refused.code == cli.returncode == 127, (refused, cli.stderr)
    assert "/no/such/command" in refused.err
    # Created, not started: the session's label still finds it for the cleanup.
    assert len(engine_api.labelled(client, Label.REHEARSAL, session)) == 3


def test_cleanup_by_label_removes_what_the_cli_lists(client, session):
    labels = {Label.REHEARSAL: session}
    assert engine_api.create_network(client, f"m31ctl-rh-{session}", labels) is None
    assert docker_verbs.create_volume(client, f"m31ctl-rh-{session}-claim", labels) is None
    claim = {"Type": "volume", "Source": f"m31ctl-rh-{session}-claim", "Target": "/claim", "ReadOnly": True}
    assert _shell(client, session, f"m31ctl-rh-{session}-a", "exec sleep 600", host={"mounts": [claim]},
                  network=f"m31ctl-rh-{session}").ok  # fmt: skip
    label = f"label={Label.REHEARSAL}={session}"
    listed = [
        word
        for listing in (["ps", "-aq"], ["network", "ls", "-q"], ["volume", "ls", "-q"])
        for word in _cli(*listing, "--filter", label).stdout.split()
    ]
    assert engine_api.labelled(client, Label.REHEARSAL, session) == listed and len(listed) == 3
    assert docker_verbs.remove_labelled(client, Label.REHEARSAL, session) == []
    assert engine_api.labelled(client, Label.REHEARSAL, session) == []


def test_an_image_is_built_from_a_dockerfile_alone(client, session):
    tag = f"m31ctl-test/rehearsal-build:{session}"
    try:
        failed = docker_verbs.build_image(client, tag, f"FROM {IMAGE}\nRUN exit 7\n", 300)
        assert failed is not None and "returned a non-zero code: 7" in failed
        built = docker_verbs.build_image(
            client, tag, f'FROM {IMAGE}\nLABEL {Label.REHEARSAL_BASE}="{IMAGE}"\n', 300
        )
        assert built is None
        image = engine_api.local_image(client, tag)
        assert image is not None and image.labels[Label.REHEARSAL_BASE] == IMAGE
    finally:
        _cli("image", "rm", "-f", tag)
