"""Readiness proves tokens (issue 50): every engine container of the Kubernetes target (the
aggregated server, a LeaderWorkerSet's leader, each P/D role) is Ready only while it generates one
token with the API key; liveness keeps /health. Read as the kubelet reads it: the exec probe's
words expanded against the container's literal env (prober.go ExpandContainerCommandOnlyStatic),
then run against the stand-in engine (tests/standin_vllm) in each of its generation modes, quickly
on this host's Python and, under Docker, inside the rehearsal image exactly as the pod spec says.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from m31ctl.deployment import derive
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.redact import API_KEY_ENV
from m31ctl.render import get_target
from m31ctl.render.k8s_probes import (
    TOKEN_DEADLINE_S,
    TOKEN_PROBE_FAILURES,
    TOKEN_PROBE_PERIOD_S,
    TOKEN_PROBE_PROGRAM,
    TOKEN_PROBE_TIMEOUT_S,
)
from m31ctl.render.kubelet_expansion import expand, mapping_for
from tests.conftest import PINNED_COMMIT
from tests.ports import free_port
from tests.support.render import HOSTILE

STANDIN = Path(__file__).parent.parent / "standin_vllm"
CANARY_KEY = "m31ctl-canary-readiness-key-5c1e07"
RWX = "kubernetes.hf_cache_storage_class=nfs-rwx"
# A served name the kubelet would expand if the probe's words were not escaped: HF_HUB_OFFLINE is
# a literal env value of every engine container (the test checks it is).
EXPANDED_NAME = f"{HOSTILE}$(HF_HUB_OFFLINE)"
# The engine containers each layout renders, by how they are found in its documents.
LAYOUTS = {
    "one node": ("h200x8", ()),
    "lws": ("h100x4", ("parallelism.nodes=2", RWX)),
    "pd": ("b300x8", ("disaggregation.enabled=true",)),
}


def _documents(layout: str) -> list[dict[str, Any]]:
    hw, sets = LAYOUTS[layout]
    plan = resolve(PlanRequest(hardware=simulated(hw), sets=(*sets, f"model.served_name={EXPANDED_NAME}")))
    (artifact,) = get_target("k8s")(derive(plan, commit=PINNED_COMMIT))
    return [d for d in yaml.safe_load_all(artifact.content) if d]


def _pod_specs(documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    specs = []
    for document in documents:
        if document["kind"] == "Deployment":
            specs.append(document["spec"]["template"]["spec"])
        elif document["kind"] == "LeaderWorkerSet":
            template = document["spec"]["leaderWorkerTemplate"]
            specs += [template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]]
    return specs


def _containers(documents: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"] + f"#{i}": c for i, s in enumerate(_pod_specs(documents)) for c in s["containers"]}


def _engines(documents: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The containers that serve vLLM's API: the engine (`vllm`), not an LWS worker or the router."""
    return [c for name, c in _containers(documents).items() if name.startswith("vllm#")]


def kubelet_argv(container: dict[str, Any]) -> list[str]:
    """The readiness probe's argv as the kubelet hands it to the runtime."""
    literal_env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    mapping = mapping_for(literal_env)
    return [expand(word, mapping) for word in container["readinessProbe"]["exec"]["command"]]


@pytest.mark.parametrize("layout", ["one node", "pd"])
def test_every_engine_is_ready_only_while_it_generates_and_lives_on_health(layout: str) -> None:
    documents = _documents(layout)
    engines = _engines(documents)
    assert len(engines) == (2 if layout == "pd" else 1)  # each role; the LWS leader, not its worker
    for engine in engines:
        readiness = engine["readinessProbe"]
        assert (readiness["periodSeconds"], readiness["failureThreshold"]) == (
            TOKEN_PROBE_PERIOD_S,
            TOKEN_PROBE_FAILURES,
        )
        # The program gives up before the kubelet does, so the failure is its own line.
        assert TOKEN_DEADLINE_S < readiness["timeoutSeconds"] == TOKEN_PROBE_TIMEOUT_S
        port = str(engine["ports"][0]["containerPort"])
        argv = [
            "python3", "-c", TOKEN_PROBE_PROGRAM, port, EXPANDED_NAME, str(TOKEN_DEADLINE_S), API_KEY_ENV,
        ]  # fmt: skip
        assert kubelet_argv(engine) == argv
        assert "HF_HUB_OFFLINE" in {e["name"] for e in engine["env"] if "value" in e}  # it would expand
        # The key: a Secret reference in the env, never a value, and only its name in the argv.
        (key,) = [e for e in engine["env"] if e["name"] == API_KEY_ENV]
        assert set(key) == {"name", "valueFrom"} and "secretKeyRef" in key["valueFrom"]
        assert engine["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
        assert engine["startupProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    others = [c for name, c in _containers(documents).items() if not name.startswith("vllm#")]
    for other in others:  # the LWS worker has no probes; the P/D router keeps its own
        assert TOKEN_PROBE_PROGRAM not in str(other.get("readinessProbe", ""))
    assert [o["name"] for o in others] == {"one node": [], "lws": ["vllm-worker"], "pd": ["front", "router"]}[
        layout
    ]


def test_the_header_states_the_readiness_period_and_cost() -> None:
    plan = resolve(PlanRequest(hardware=simulated("h200x8")))
    (artifact,) = get_target("k8s")(derive(plan, commit=PINNED_COMMIT))
    header = " ".join(line[2:] for line in artifact.content.splitlines() if line.startswith("# "))
    assert f"Readiness: every {TOKEN_PROBE_PERIOD_S} s each engine pod generates one token" in header
    assert f"after {TOKEN_PROBE_FAILURES} periods in a row without one within {TOKEN_DEADLINE_S} s" in header


# --- the probe against the stand-in engine -----------------------------------------------------


def _standin(generation: str, port: int, served_name: str, key: str) -> subprocess.Popen[bytes]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": str(STANDIN),
        "FAKE_ENGINE_DELAY": "0",
        "FAKE_ENGINE_GENERATION": generation,
        API_KEY_ENV: key,
    }
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--port", str(port)]
    return subprocess.Popen([*argv, "--served-model-name", served_name], env=env)


def _wait_for_health(port: int) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


# generation mode, the key the probe's container holds, whether the probe passes
CASES = [
    ("ok", CANARY_KEY, True),
    ("fail", CANARY_KEY, False),
    ("empty", CANARY_KEY, False),
    ("hang", CANARY_KEY, False),
    ("ok", "not-the-key", False),  # the key is what lets it through
]


@pytest.mark.parametrize(("generation", "key", "passes"), CASES)
def test_the_probe_passes_only_when_a_token_is_generated(generation: str, key: str, passes: bool) -> None:
    """The rendered argv on this host's Python, its deadline shortened to 2 s (an argv word) so
    that the hanging engine costs 2 s here; the Docker test below waits the rendered deadline."""
    (engine,) = _engines(_documents("one node"))
    port = free_port()
    argv = kubelet_argv(engine)
    argv[3], argv[5] = str(port), "2"
    server = _standin(generation, port, EXPANDED_NAME, CANARY_KEY)
    try:
        _wait_for_health(port)  # /health answers in every mode
        started = time.monotonic()
        probe = subprocess.run(
            [sys.executable, *argv[1:]], env={API_KEY_ENV: key}, capture_output=True, text=True, timeout=10
        )
        took = time.monotonic() - started
    finally:
        server.kill()
        server.wait()
    assert (probe.returncode == 0) is passes, probe.stderr
    assert took < 4
    if not passes:
        assert probe.stderr.startswith("m31ctl readiness: ") and probe.stderr.count("\n") == 1
        assert CANARY_KEY not in probe.stderr


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_rendered_probe_in_the_engine_image_takes_a_tokenless_engine_out(rehearsal_image: str) -> None:
    """The rehearsal image (the cpu recipe's engine image: vLLM's python3) runs the stand-in engine
    as its `vllm` with the key in its environment, as a pod's secretKeyRef puts it; the kubelet's
    expanded argv is exec'd inside it, as the kubelet's ExecSync does, in each generation mode."""
    from m31ctl.runtime import engine_api

    (engine,) = _engines(_documents("one node"))
    argv = kubelet_argv(engine)
    port = engine["ports"][0]["containerPort"]
    assert CANARY_KEY not in " ".join(argv)
    client = engine_api.connect()
    for generation, passes in (("ok", True), ("fail", False), ("empty", False), ("hang", False)):
        container = client.containers.run(
            rehearsal_image,
            [
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--port",
                str(port),
                "--served-model-name",
                EXPANDED_NAME,
            ],
            entrypoint=["python3"],
            environment={
                "PYTHONPATH": "/standin",
                "FAKE_ENGINE_DELAY": "0",
                "FAKE_ENGINE_GENERATION": generation,
                API_KEY_ENV: CANARY_KEY,
            },
            volumes={str(STANDIN): {"bind": "/standin", "mode": "ro"}},
            network_mode="none",
            name=f"m31ctl-test-readiness-{uuid.uuid4().hex[:8]}",
            detach=True,
        )
        try:
            _exec_until_healthy(container, port)
            code, took, seen = _probe_in(client, container, argv)
        finally:
            container.remove(force=True)
        assert (code == 0) is passes, generation
        assert took < TOKEN_PROBE_TIMEOUT_S  # within the kubelet's timeoutSeconds, in every mode
        if generation == "hang":
            assert took >= TOKEN_DEADLINE_S - 1  # it waited its deadline, then gave up itself
            assert "m31ctl readiness" in seen  # the scan saw the probe running, its argv without the key
        assert CANARY_KEY not in seen


def _probe_in(client: Any, container: Any, argv: list[str]) -> tuple[int, float, str]:
    """The probe exec'd in `container` as the kubelet's ExecSync runs it: its exit code, how long it
    took, and the argv of every process in the container while it ran."""
    started = time.monotonic()
    made = client.api.exec_create(container.id, argv)
    client.api.exec_start(made["Id"], detach=True)
    time.sleep(1)
    seen = container.exec_run(["python3", "-c", _ARGV_OF_EVERY_PROCESS]).output.decode()
    while (state := client.api.exec_inspect(made["Id"]))["Running"]:
        assert time.monotonic() - started < 2 * TOKEN_PROBE_TIMEOUT_S
        time.sleep(0.2)
    return state["ExitCode"], time.monotonic() - started, seen


# The argv of every process in the container (/proc/*/cmdline): the key must be in none.
_ARGV_OF_EVERY_PROCESS = """\
import glob
for path in glob.glob("/proc/[0-9]*/cmdline"):
    try:
        print(open(path, "rb").read().replace(b"\\0", b" ").decode(errors="replace"))
    except OSError:
        pass
"""


def _exec_until_healthy(container: Any, port: int) -> None:
    """/health from inside the container: it answers 200 in every generation mode."""
    check = f"import urllib.request; urllib.request.urlopen('http://127.0.0.1:{port}/health', timeout=1)"
    deadline = time.monotonic() + 60
    while container.exec_run(["python3", "-c", check]).exit_code != 0:
        assert time.monotonic() < deadline, container.logs().decode()[-2000:]
        time.sleep(0.5)


def test_a_layout_spanning_nodes_keeps_the_readiness_of_before() -> None:
    """The LWS leader of a layout over two nodes answers /v1/models with the key to be ready, and
    says why in the header: on vLLM's CPU build the leader of data-parallel ranks over two nodes
    died on a first request while the other node's rank still loaded (the two-node DP rehearsal
    with the token probe)."""
    documents = _documents("lws")
    (leader,) = _engines(documents)
    readiness = leader["readinessProbe"]
    assert TOKEN_PROBE_PROGRAM not in str(readiness)
    assert "/v1/models" in " ".join(readiness["exec"]["command"]) and readiness["timeoutSeconds"] == 10
    assert leader["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
