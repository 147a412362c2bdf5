"""A prefill/decode plan rendered (issue 36): goldens, each runtime's own checks (docker-compose
config, the compose-spec schema, Kubernetes' schemas, promtool), the facts the targets must
agree on (the roles' argv and environment, the router's upstreams, the side-channel address),
and the refusals."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from m31ctl.deployment import RENDERED_ROUTER_METRICS_PORT
from m31ctl.engine.adapter import SIDE_CHANNEL_HOST_ENV, build_invocation
from m31ctl.engine.router import (
    ROUTER_BEHIND_FRONT_PORT,
    ROUTER_WORKERS_PROGRAM,
    Upstreams,
    front_invocation,
    router_invocation,
)
from m31ctl.errors import InputError
from m31ctl.pair import PAIR_SUBNET, ROUTER_LISTEN
from m31ctl.redact import API_KEY_ENV
from m31ctl.render import PD_RENDERERS, get_target
from m31ctl.render.kubelet_expansion import expand, mapping_for
from m31ctl.render.pd import refuse_pd
from m31ctl.render.targets import API_KEY_FILE_VAR, TARGETS
from tests.conftest import PINNED_COMMIT, run_cli
from tests.support.rehearsal import needs_image
from tests.support.render import HOSTILE, PLANS, REFERENCE, pd_deployment, render, tool

CPU_PD = ("--hardware", "cpu", "--variant", "pd")
PROMTOOL = shutil.which("promtool")


@pytest.mark.parametrize("target", sorted(PD_RENDERERS))
@pytest.mark.parametrize("key", sorted(PLANS))
def test_golden(key, target, monkeypatch):
    monkeypatch.setenv("HOME", "/home/operator")
    for artifact in render(key, target):
        golden = REFERENCE / key / artifact.name
        if os.environ.get("M31CTL_UPDATE_GOLDEN"):
            golden.parent.mkdir(parents=True, exist_ok=True)
            golden.write_text(artifact.content)
        assert artifact.content == golden.read_text(), (
            f"re-run with M31CTL_UPDATE_GOLDEN=1 if {golden} should change"
        )


@pytest.mark.parametrize("target", sorted(PD_RENDERERS))
def test_byte_identical(target):
    assert render("pd-b300x8", target) == render("pd-b300x8", target)


def test_every_target_renders_a_pd_plan_and_a_new_one_that_cannot_is_refused_naming_those_that_do():
    assert set(TARGETS) == set(PD_RENDERERS)
    # A target added without a P/D renderer gets one clear line naming those that render a pair.
    with pytest.raises(InputError) as refused:
        refuse_pd("future", tuple(PD_RENDERERS))
    assert "--target future does not render a prefill/decode plan" in str(refused.value)
    assert all(name in refused.value.hint for name in PD_RENDERERS)


def test_compose_refuses_a_pair_wider_than_one_host(cli, tmp_path):
    # B300x4: each TP4 role fits a host, the pair (8 GPUs) does not.
    args = ("--hardware", "b300x4", "--set", "disaggregation.enabled=true", "--revision", PINNED_COMMIT)
    result = cli("render", "--target", "compose", *args, "-o", str(tmp_path / "out"))
    assert result.returncode == 6, result.stderr
    assert "needs 8 GPUs (4 prefill, 4 decode) on one host" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()
    # ...which Kubernetes renders: each role on its own nodes.
    assert cli("render", "--target", "k8s", *args).returncode == 0


# --- Compose -----------------------------------------------------------------------------------


def _compose_config(text: str, tmp_path: Path, env: dict[str, str] | None = None) -> dict:  # type: ignore[type-arg]
    """The file as docker-compose itself reads it (`config`: parsed, validated, interpolated)."""
    path = tmp_path / "compose.yaml"
    path.write_text(text)
    done = subprocess.run(
        [tool("docker-compose"), "-f", str(path), "config"],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], **(env or {})},
    )
    assert done.returncode == 0, done.stderr
    schema = subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
    )
    assert schema.returncode == 0, schema.stdout + schema.stderr
    parsed: dict = yaml.safe_load(done.stdout)  # type: ignore[type-arg]
    return parsed


@pytest.mark.parametrize("key", sorted(PLANS))
def test_compose_runs_each_role_as_planned_and_the_router_after_them(key, tmp_path):
    deployment = pd_deployment(key, (f"model.served_name={HOSTILE}",))
    (artifact,) = get_target("compose")(deployment)
    services = _compose_config(artifact.content, tmp_path)["services"]
    raw = yaml.safe_load(artifact.content)["services"]  # as written (`config` rewrites durations)
    group = deployment.disaggregated
    assert group is not None
    subnet = ipaddress.ip_network(PAIR_SUBNET)
    addresses = []
    for name, role in (("prefill", group.prefill), ("decode", group.decode)):
        service = services[name]
        address = service["networks"]["pd"]["ipv4_address"]
        assert ipaddress.ip_address(address) in subnet
        addresses.append(address)
        # The adapter's argv and environment, with the role's own address as its side channel.
        invocation = build_invocation(role, side_channel_host=address)
        # The hostile name verbatim (`config` prints a literal `$` escaped again, as `$$`).
        assert [a.replace("$$", "$") for a in service["command"]] == list(invocation.args)
        env = service["environment"]  # `config` writes it as a mapping
        assert env[SIDE_CHANNEL_HOST_ENV] == address
        assert {k: v for k, v in invocation.env} == {k: env[k] for k, _ in invocation.env}
        assert service["container_name"] == role.name
        assert raw[name]["ports"] == [f"{role.network.bind}:{role.network.port}:8000"]
        # Each role's own clocks (m31ctl/timeline.py), as the aggregated service uses them.
        assert raw[name]["healthcheck"]["start_period"] == f"{role.timeline.ready_s}s"
        assert raw[name]["stop_grace_period"] == f"{role.timeline.stop_s}s"
    assert len(set(addresses)) == 2
    router, front = services["router"], services["front"]
    bind = group.router.network.bind
    expected = router_invocation(
        group.router,
        Upstreams("http://prefill:8000", "http://decode:8000"),
        host="127.0.0.1",  # behind its front, on the namespace's loopback (issue 49)
        port=ROUTER_BEHIND_FRONT_PORT,
        metrics_port=RENDERED_ROUTER_METRICS_PORT,
        request_timeout_s=group.router_timeline.request_timeout_s,
        metrics_host=ROUTER_LISTEN,
    )
    assert [*router["entrypoint"], *router["command"]] == list(expected.argv)
    assert router["network_mode"] == "service:front" and "ports" not in router
    assert router["depends_on"] == {
        "front": {"condition": "service_started"},
        "prefill": {"condition": "service_healthy"},
        "decode": {"condition": "service_healthy"},
    }
    # The front holds the pair's network and the published ports, and runs the shipped program.
    expected_front = front_invocation(
        group.router.image, host=ROUTER_LISTEN, port=8000, request_timeout_s=group.router_timeline.request_timeout_s,
        key_env=None,
    )  # fmt: skip
    assert [*raw["front"]["entrypoint"], *raw["front"]["command"]] == list(expected_front.argv)
    assert front["image"] == group.router.image and front["networks"] == {"pd": None}
    assert raw["front"]["ports"] == [f"{bind}:{group.router.network.port}:8000", f"{bind}:29000:29000"]
    downloads = [name for name in services if "download" in name]
    if deployment.model.local:
        assert downloads == []
    else:  # once, before both roles; the transfer's environment is the engines' alone
        assert downloads == ["download"]
        assert not any("NIXL" in name or "UCX" in name for name in services["download"]["environment"])
        for name in ("prefill", "decode"):
            assert services[name]["depends_on"] == {
                "download": {"condition": "service_completed_successfully"}
            }


def test_compose_hands_each_role_its_own_gpus():
    (artifact,) = render("pd-b300x8", "compose")
    services = yaml.safe_load(artifact.content)["services"]
    ids = {
        name: services[name]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
        for name in ("prefill", "decode")
    }
    assert ids == {"prefill": ["0", "1", "2", "3"], "decode": ["4", "5", "6", "7"]}


def test_compose_router_fails_closed_without_the_api_key(tmp_path):
    (artifact,) = render("pd-cpu", "compose", ("runtime.api_key=true",))
    path = tmp_path / "compose.yaml"
    path.write_text(artifact.content)
    done = subprocess.run(
        [tool("docker-compose"), "-f", str(path), "config"],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "VLLM_API_KEY": "exported-key"},  # not read: the file is
    )
    assert done.returncode != 0 and "the plan requires VLLM_API_KEY" in done.stderr
    key_file = tmp_path / "api-key"
    key_file.write_text("canary-key\n")
    env = {"VLLM_API_KEY": "exported-key", "M31CTL_API_KEY_FILE": str(key_file)}
    services = _compose_config(artifact.content, tmp_path, env)["services"]
    # The router and both roles read the one key file, each exporting its own variable at start
    # (the router forwards OPENAI_API_KEY to the roles); no environment entry carries a key.
    for name, variable in (
        ("router", "OPENAI_API_KEY"),
        ("prefill", "VLLM_API_KEY"),
        ("decode", "VLLM_API_KEY"),
    ):
        service = services[name]
        assert service["secrets"] == [{"source": "vllm_api_key"}]  # as `config` spells the short form
        at = service["entrypoint"].index("/run/secrets/vllm_api_key")
        assert service["entrypoint"][at + 1 : at + 3] == [variable, "M31CTL_API_KEY_FILE"]
        assert not any("API_KEY" in k for k in (service.get("environment") or {}))
    assert services["router"]["entrypoint"][-1] == "vllm-router"


# --- Kubernetes --------------------------------------------------------------------------------


@pytest.mark.parametrize("key", sorted(PLANS))
def test_k8s_validates_and_wires_the_router_to_the_roles_services(key, tmp_path):
    deployment = pd_deployment(key, (f"model.served_name={HOSTILE}",))
    (artifact,) = get_target("k8s")(deployment)
    path = tmp_path / "k8s.yaml"
    path.write_text(artifact.content)
    done = subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    documents = list(yaml.safe_load_all(artifact.content))
    assert done.stdout.count("passed") == len(documents) == 11
    kinds = [(d["kind"], d["metadata"]["name"].rsplit("-", 1)[-1]) for d in documents]
    assert kinds == [
        ("PersistentVolumeClaim", "cache"), ("Deployment", "prefill"), ("Service", "api"), ("NetworkPolicy", "prefill"),
        ("PersistentVolumeClaim", "cache"), ("Deployment", "decode"), ("Service", "api"), ("NetworkPolicy", "decode"),
        ("Deployment", "router"), ("Service", "api"), ("NetworkPolicy", "router"),
    ]  # fmt: skip
    group = deployment.disaggregated
    assert group is not None
    services = {d["metadata"]["name"]: d for d in documents if d["kind"] == "Service"}
    upstreams = []
    for role, workload in zip(group.roles, (documents[1], documents[5]), strict=True):
        container = workload["spec"]["template"]["spec"]["containers"][0]
        side = [e for e in container["env"] if e["name"] == SIDE_CHANNEL_HOST_ENV]
        assert side == [
            {"name": SIDE_CHANNEL_HOST_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        ]
        # What the kubelet hands vLLM is the adapter's argv, the hostile name included.
        assert [expand(a, mapping_for({})) for a in container["args"]] == list(build_invocation(role).args)
        service = services[f"{role.name}-api"]
        assert service["spec"]["selector"] == {"app.kubernetes.io/name": role.name}
        upstreams.append(f"http://{role.name}-api:{service['spec']['ports'][0]['port']}")
    router = documents[8]["spec"]["template"]["spec"]
    front_container, router_container = router["containers"]
    command = [expand(a, mapping_for({})) for a in router_container["command"]]
    expected = router_invocation(
        group.router,
        Upstreams(*upstreams),
        host="127.0.0.1",  # behind its front, on the pod's loopback (issue 49)
        port=ROUTER_BEHIND_FRONT_PORT,
        metrics_port=RENDERED_ROUTER_METRICS_PORT,
        request_timeout_s=group.router_timeline.request_timeout_s,
        metrics_host=ROUTER_LISTEN,
    )
    assert command == list(expected.argv)
    expected_front = front_invocation(
        group.router.image, host=ROUTER_LISTEN, port=8000, request_timeout_s=group.router_timeline.request_timeout_s,
        key_env=API_KEY_ENV,
    )  # fmt: skip
    assert [expand(a, mapping_for({})) for a in front_container["command"]] == list(expected_front.argv)
    assert front_container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "api"}
    assert "readinessProbe" not in router_container  # the pod is ready by the front's /health
    wait = router["initContainers"][0]["command"]
    assert wait[-2:] == [f"{u}/health" for u in upstreams]
    # Clients reach the router under the aggregated API Service's name.
    api = services[f"{deployment.name}-api"]
    assert api["spec"]["selector"] == {"app.kubernetes.io/name": group.router.name}
    # Each role admits its group (peer and router) on every port; the router admits api_clients.
    group_label = {"app.kubernetes.io/part-of": deployment.name, "app.kubernetes.io/managed-by": "m31ctl"}
    for policy in (documents[3], documents[7]):
        assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": group_label}}]}]
    for workload in (documents[1], documents[5], documents[8]):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert labels.items() >= group_label.items()
    assert documents[10]["spec"]["ingress"][0]["ports"] == [
        {"protocol": "TCP", "port": 8000},
        {"protocol": "TCP", "port": RENDERED_ROUTER_METRICS_PORT},  # its metrics, as an engine's (issue 49)
    ]


def test_k8s_router_forwards_the_groups_api_key():
    (artifact,) = render("pd-b300x8", "k8s")
    documents = list(yaml.safe_load_all(artifact.content))
    secret = "m31ctl-minimax-m31-flash-secrets"
    front, router = documents[8]["spec"]["template"]["spec"]["containers"]
    ref = {"secretKeyRef": {"name": secret, "key": "VLLM_API_KEY", "optional": False}}
    assert router["env"] == [{"name": "OPENAI_API_KEY", "valueFrom": ref}]  # what it sends the roles
    assert front["env"] == [{"name": "VLLM_API_KEY", "valueFrom": ref}]  # what it checks (issue 49)
    for workload in (documents[1], documents[5]):
        refs = [
            e["valueFrom"]["secretKeyRef"]["name"]
            for e in workload["spec"]["template"]["spec"]["containers"][0]["env"]
            if "secretKeyRef" in e.get("valueFrom", {})
        ]
        assert refs and set(refs) == {secret}  # one Secret for the whole group


# --- monitoring --------------------------------------------------------------------------------


def test_monitoring_scrapes_both_roles_and_the_router(tmp_path):
    artifacts = {a.name: a.content for a in render("pd-cpu", "monitoring")}
    config = yaml.safe_load(artifacts["prometheus.yml"])
    (job,) = config["scrape_configs"]
    targets = {c["labels"]["m31ctl_role"]: c["targets"] for c in job["static_configs"]}
    assert targets == {
        "prefill": ["127.0.0.1:8100"],
        "decode": ["127.0.0.1:8200"],
        "router": [f"127.0.0.1:{RENDERED_ROUTER_METRICS_PORT}"],
    }
    monitor = next(
        d for d in yaml.safe_load_all(artifacts["k8s-monitoring.yaml"]) if d["kind"] == "PodMonitor"
    )
    assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["http", "metrics"]
    if PROMTOOL is None:
        pytest.skip("no promtool (scripts/setup-host installs prometheus)")
    for name, content in artifacts.items():
        (tmp_path / name).write_text(content)
    done = subprocess.run(
        [PROMTOOL, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_role_over_nodes_is_a_leader_worker_set_whose_pods_each_advertise_their_ip(cli):
    wide = (
        "disaggregation.decode.data=2",
        "disaggregation.decode.nodes=2",
        "kubernetes.hf_cache_storage_class=nfs",
    )
    (artifact,) = render("pd-b300x8", "k8s", wide)
    documents = list(yaml.safe_load_all(artifact.content))
    lws = next(d for d in documents if d["kind"] == "LeaderWorkerSet")
    assert lws["metadata"]["name"].endswith("-decode")
    template = lws["spec"]["leaderWorkerTemplate"]
    for pod in (template["leaderTemplate"], template["workerTemplate"]):
        assert pod["metadata"]["labels"]["app.kubernetes.io/part-of"] == "m31ctl-minimax-m31-flash"
        (container,) = pod["spec"]["containers"]
        side = [e for e in container["env"] if e["name"] == SIDE_CHANNEL_HOST_ENV]
        assert side == [
            {"name": SIDE_CHANNEL_HOST_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        ]
    # Compose cannot run it: one clear line, exit 6.
    args = ["--hardware", "b300x8", "--set", "disaggregation.enabled=true", "--revision", PINNED_COMMIT]
    for setting in wide[:2]:
        args += ["--set", setting]
    result = cli("render", "--target", "compose", *args)
    assert result.returncode == 6 and "the decode role spans 2 nodes" in result.stderr, result.stderr


# --- the rendered Compose file, run ------------------------------------------------------------
# Bounds for a start on a busy 2-core machine; they decide only when something is broken.
START_BOUND_S = 900


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@needs_image
@pytest.mark.docker
@pytest.mark.vllm
@pytest.mark.slow
def test_the_rendered_pair_serves_with_the_kv_over_nixl_between_containers(tmp_path, tiny_model):
    """docker-compose runs the CPU pd variant's file as rendered, with an API key: the router
    answers once both roles are healthy, and the decode container's prompt tokens came from
    prefill's KV over NIXL (vLLM's own counters), not recomputed. Its front (issue 49) refuses a
    completion without the key (401) and worker registration with it (404), leaving the router's
    worker list as it was, and streams a completion with the key event by event."""
    if not _port_free(RENDERED_ROUTER_METRICS_PORT):
        pytest.skip(
            f"port {RENDERED_ROUTER_METRICS_PORT} (the router's metrics, fixed in rendered files) is taken"
        )
    model = tiny_model
    name = f"m31ctl-pd-{uuid.uuid4().hex[:6]}"
    project = name.replace("-", "")
    base = 20000 + int(uuid.uuid4().hex[:3], 16) % 1000 * 3
    port, prefill_port, decode_port = base, base + 1, base + 2
    compose = tmp_path / "compose.yaml"
    key_file = tmp_path / "api-key"
    environ = {**os.environ, API_KEY_FILE_VAR: str(key_file)}  # every docker-compose call reads it
    try:
        rendered = run_cli(
            "render", "--target", "compose", *CPU_PD,
            "--set", f"model.path={model}", "--set", f"runtime.hf_cache={tmp_path / 'hf'}",
            "--set", f"runtime.container_name={name}", "--set", f"runtime.port={port}",
            "--set", f"disaggregation.prefill.port={prefill_port}",
            "--set", f"disaggregation.decode.port={decode_port}", "--set", "runtime.api_key=true",
        )  # fmt: skip
        assert rendered.returncode == 0, rendered.stderr
        compose.write_text(rendered.stdout)
        (tmp_path / "hf").mkdir()
        key_file.write_text(API_KEY)
        key_file.chmod(0o600)
        override = _cpu_image_serve_override(rendered.stdout, tmp_path)
        up = subprocess.run(
            ["docker-compose", "-p", project, "-f", str(compose), "-f", str(override), "up", "-d"],
            capture_output=True, text=True, timeout=START_BOUND_S, check=False,
            env=environ,
        )  # fmt: skip
        if up.returncode != 0:
            states = subprocess.run(
                ["docker", "ps", "-a", "--filter", f"label=com.docker.compose.project={project}", "--format",
                 "{{.Names}} {{.Status}}"], capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            logs = subprocess.run(
                ["docker-compose", "-p", project, "-f", str(compose), "logs", "--no-color", "--tail", "30"],
                capture_output=True, text=True, timeout=120, check=False, env=environ,
            )  # fmt: skip
            pytest.fail(f"{up.stderr[-1500:]}\n{states.stdout}\n{logs.stdout[-6000:]}")
        deadline = time.monotonic() + START_BOUND_S
        while not _answers(f"http://127.0.0.1:{port}/health"):
            assert time.monotonic() < deadline, "the router never answered /health"
            time.sleep(2)
        body = {
            "model": "m31ctl-rehearsal",
            "prompt": "hello there general",
            "max_tokens": 8,
            "temperature": 0,
        }
        _the_front_refuses_without_the_key_and_keeps_the_workers(port, f"{name}-router", body)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
        )
        try:
            with urllib.request.urlopen(request, timeout=300) as answer:
                completion = json.loads(answer.read())
        except urllib.error.HTTPError as refused:  # what the router said, and each container's last lines
            logs = subprocess.run(
                ["docker-compose", "-p", project, "-f", str(compose), "logs", "--no-color", "--tail", "40"],
                capture_output=True, text=True, timeout=120, check=False, env=environ,
            )  # fmt: skip
            pytest.fail(f"HTTP {refused.code}: {refused.read()[:500]!r}\n{logs.stdout[-6000:]}")
        assert completion["usage"]["completion_tokens"] == 8
        metrics = (
            urllib.request.urlopen(f"http://127.0.0.1:{decode_port}/metrics", timeout=10).read().decode()
        )
        transferred = [
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("vllm:prompt_tokens_by_source_total")
            and 'source="external_kv_transfer"' in line
        ]
        failed = [
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("vllm:nixl_num_failed_transfers_total")
        ]
        assert transferred and transferred[0] > 0, (
            "decode computed the prompt itself: no KV came from prefill"
        )
        assert failed == [0.0]
        router_metrics = urllib.request.urlopen(
            f"http://127.0.0.1:{RENDERED_ROUTER_METRICS_PORT}/metrics", timeout=10
        ).read()
        assert b"vllm_router" in router_metrics  # the monitoring target's third scrape answers
        _the_front_streams_with_the_key(port, body)
    finally:
        subprocess.run(
            ["docker-compose", "-p", project, "-f", str(compose), "down", "-v", "--remove-orphans", "-t", "30"],
            capture_output=True, timeout=300, check=False, env=environ,
        )  # fmt: skip


API_KEY = "m31ctl-pd-test-key"


def _cpu_image_serve_override(rendered: str, tmp_path: Path) -> Path:
    """A Compose override that ends each role's key-exporting start in m31ctl's CPU image's own
    entrypoint (`vllm-serve`): the rendered start execs `vllm serve`, the vLLM images' entrypoint
    (engine/adapter.py SERVE_COMMAND), which this image's vLLM, installed without its package
    metadata, cannot run ("No package metadata was found for vllm"). Everything else, the
    router's front and the router included, runs as rendered."""
    services = yaml.safe_load(rendered)["services"]
    override = {}
    for role in ("prefill", "decode"):
        entrypoint = services[role]["entrypoint"]
        assert entrypoint[-2:] == ["vllm", "serve"], entrypoint
        override[role] = {"entrypoint": [*entrypoint[:-2], "vllm-serve"]}
    path = tmp_path / "cpu-image.override.yaml"
    path.write_text(yaml.safe_dump({"services": override}))
    return path


def _status(
    url: str, method: str = "POST", headers: dict[str, str] | None = None, body: object = None
) -> int:
    data = json.dumps(body).encode() if body is not None else b""
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as refused:
        return int(refused.code)


def _router_workers(router: str) -> object:
    """The router's own worker list, asked on its loopback inside its network namespace (the one
    place it listens), as an operator's `docker exec` would."""
    done = subprocess.run(
        ["docker", "exec", router, "python3", "-c", ROUTER_WORKERS_PROGRAM],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-1000:]
    return json.loads(done.stdout)


def _the_front_refuses_without_the_key_and_keeps_the_workers(
    port: int, router: str, body: dict[str, object]
) -> None:
    """Without the key a completion is 401; worker management (/add_worker, POST /workers,
    /list_workers, /remove_worker) is 404 with the key or without, and the exporter's port serves
    metrics alone: the router's own list is what it was."""
    workers = _router_workers(router)
    assert "prefill:8000" in json.dumps(workers) and "decode:8000" in json.dumps(workers), workers
    base = f"http://127.0.0.1:{port}"
    assert _status(f"{base}/v1/completions", body=body) == 401
    assert _status(f"{base}/v1/completions", headers={"Authorization": "Bearer wrong"}, body=body) == 401
    assert _status(f"{base}/v1/models", method="GET") == 401
    keyed = {"Authorization": f"Bearer {API_KEY}"}
    for headers in ({}, keyed):
        assert _status(f"{base}/add_worker?url=http://10.231.36.99:8000", headers=headers) == 404
        assert _status(f"{base}/workers", headers=headers, body={"url": "http://10.231.36.99:8000"}) == 404
        assert _status(f"{base}/list_workers", method="GET", headers=headers) == 404
        # What 0.1.17's P/D router does act on unauthenticated: it drops the role from its list.
        assert _status(f"{base}/remove_worker?url=http://decode:8000", headers=headers) == 404
    metrics = f"http://127.0.0.1:{RENDERED_ROUTER_METRICS_PORT}"
    _status(f"{metrics}/remove_worker?url=http://decode:8000")  # the exporter serves metrics alone
    assert _router_workers(router) == workers


def _the_front_streams_with_the_key(port: int, body: dict[str, object]) -> None:
    """A streamed completion through the front: SSE events one by one, then [DONE]."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    with urllib.request.urlopen(request, timeout=300) as answer:
        assert answer.headers.get("Content-Type", "").startswith("text/event-stream")
        events = [line for line in answer.read().decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3, events
    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])


# --- issue 49: the router's metrics admitted, one checkpoint download per group ---------------


def _port_numbers(container: dict) -> dict[str, int]:  # type: ignore[type-arg]
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def test_k8s_router_admits_its_api_clients_to_its_metrics_as_to_its_api():
    """An engine's /metrics is on its API port, which kubernetes.api_clients reach; the router's
    exporter listens on its own port (--prometheus-port), which its NetworkPolicy admitted none
    to. The monitoring target's NetworkPolicy admits its scraper to every port its PodMonitor
    scrapes on the router."""
    documents = list(yaml.safe_load_all(render("pd-b300x8", "k8s")[0].content))
    (router,) = [
        d for d in documents if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router")
    ]
    ports = {
        k: v for c in router["spec"]["template"]["spec"]["containers"] for k, v in _port_numbers(c).items()
    }
    assert ports == {"api": 8000, "metrics": RENDERED_ROUTER_METRICS_PORT}
    (policy,) = [
        d for d in documents if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-router")
    ]
    (rule,) = policy["spec"]["ingress"]
    assert sorted(p["port"] for p in rule["ports"]) == sorted(ports.values())
    monitoring = list(
        yaml.safe_load_all(
            {a.name: a.content for a in render("pd-b300x8", "monitoring")}["k8s-monitoring.yaml"]
        )
    )
    monitor = next(d for d in monitoring if d["kind"] == "PodMonitor")
    scraper = next(d for d in monitoring if d["kind"] == "NetworkPolicy")
    admitted = {p["port"] for r in scraper["spec"]["ingress"] for p in r["ports"]}
    scraped = {ports[e["port"]] for e in monitor["spec"]["podMetricsEndpoints"] if e["port"] in ports}
    assert scraped == {RENDERED_ROUTER_METRICS_PORT} and scraped <= admitted
    assert (
        router["spec"]["template"]["metadata"]["labels"].items()
        >= scraper["spec"]["podSelector"]["matchLabels"].items()
    )


def _cache(documents: list) -> tuple[list[str], dict[str, tuple[str, list[str]]]]:  # type: ignore[type-arg]
    """The claims made, and each role's (claim mounted, init containers)."""
    claims = [d["metadata"]["name"] for d in documents if d["kind"] == "PersistentVolumeClaim"]
    roles = {}
    for d in documents:
        if d["kind"] != "Deployment" or d["metadata"]["name"].endswith("-router"):
            continue
        pod = d["spec"]["template"]["spec"]
        (claim,) = [
            v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v
        ]
        roles[d["metadata"]["name"].rsplit("-", 1)[-1]] = (claim, [c["name"] for c in pod["initContainers"]])
    return claims, roles


def test_k8s_roles_share_one_claim_downloaded_once_where_the_plan_names_a_rwx_class(tmp_path):
    shared = pd_deployment("pd-b300x8", ("kubernetes.hf_cache_storage_class=nfs",))
    (artifact,) = get_target("k8s")(shared)
    documents = list(yaml.safe_load_all(artifact.content))
    claims, roles = _cache(documents)
    name = "m31ctl-minimax-m31-flash-pd-hf-cache"
    assert claims == [name]
    (claim,) = [d for d in documents if d["kind"] == "PersistentVolumeClaim"]
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"] and claim["spec"]["storageClassName"] == "nfs"
    # One download on the claim: the decode's pod waits for the prefill's marker, never races it.
    assert roles == {"prefill": (name, ["download"]), "decode": (name, ["wait-for-checkpoint"])}
    download, wait = (
        next(d for d in documents if d["metadata"]["name"].endswith(f"-{r}") and d["kind"] == "Deployment")[
            "spec"
        ]["template"]["spec"]["initContainers"][0]["command"]
        for r in ("prefill", "decode")
    )
    assert wait[3] == download[6]  # the marker the download leaves is the one the decode waits for
    header = " ".join(line[2:] for line in artifact.content.splitlines() if line.startswith("# "))
    assert "the checkpoint is downloaded once" in header
    path = tmp_path / "k8s.yaml"
    path.write_text(artifact.content)
    done = subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_k8s_roles_without_a_class_download_once_each_and_the_header_says_why():
    (artifact,) = render("pd-b300x8", "k8s")
    claims, roles = _cache(list(yaml.safe_load_all(artifact.content)))
    assert claims == [roles["prefill"][0], roles["decode"][0]] and len(set(claims)) == 2
    assert {r[1][0] for r in roles.values()} == {"download"}
    header = " ".join(line[2:] for line in artifact.content.splitlines() if line.startswith("# "))
    assert "each role downloads the checkpoint into a claim of its own" in header
    assert "kubernetes.hf_cache_storage_class is unset" in header and "ReadWriteOnce" in header
