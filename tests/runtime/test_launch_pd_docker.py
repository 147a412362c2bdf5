"""`m31ctl launch --runtime docker` of a P/D plan (issue 36): the group's containers as specs
(fast, no Docker: each role on the pair's network at the fixed address it advertises for NIXL,
the router under the group's name with the rendered command line and the group's clocks, the
secrets through the Engine API's environment only, status and a part that dies named), and once
for real: the CPU rehearsal's pd variant in three containers of m31ctl/vllm-cpu, a completion
through the router with its prompt's KV over NIXL between the containers, status listing the
group, and stop leaving no container and no network behind."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import urllib.error
import urllib.request
import uuid
from typing import Any, ClassVar

import pytest

from m31ctl.deployment import CONTAINER_PORT, RENDERED_ROUTER_METRICS_PORT, Deployment, derive
from m31ctl.engine.adapter import SIDE_CHANNEL_HOST_ENV
from m31ctl.errors import ServerDied
from m31ctl.hardware import simulated
from m31ctl.labels import OWNER, Label
from m31ctl.pair import (
    PAIR_SUBNET,
    ROUTER_API_KEY_ENV,
    docker_pair,
    network_name,
    pair_upstreams,
    rendered_front_invocation,
    rendered_router_invocation,
    role_address,
)
from m31ctl.plan import PlanRequest, resolve
from m31ctl.redact import API_KEY_ENV
from m31ctl.runtime import docker_group, docker_servers
from m31ctl.runtime.converge import ExistingServer
from m31ctl.runtime.docker_create import create_container
from m31ctl.runtime.docker_launch import ContainerLaunch, ContainerRun
from m31ctl.runtime.flow import Found
from m31ctl.runtime.protocol import LaunchOptions, ServerStatus
from m31ctl.runtime.readiness import ProcessState
from tests.conftest import last_json, run_cli
from tests.ports import free_ports
from tests.support import cli_json

SECRET = "sk-CANARY-pd-docker-0123456789"


def _group(*sets: str) -> Deployment:
    api, prefill, decode = free_ports(3)
    ports = (
        f"runtime.port={api}",
        f"disaggregation.prefill.port={prefill}",
        f"disaggregation.decode.port={decode}",
    )
    return derive(resolve(PlanRequest(simulated("cpu"), variant="pd", sets=(*ports, *sets))))


def test_each_role_runs_on_the_pairs_network_at_the_address_it_advertises():
    d = _group()
    group = d.disaggregated
    assert group is not None
    roles = docker_group.role_parts(docker_pair(d, "launch", on_this_host=True))
    assert [p.spec.name for p in roles] == [role.name for role in group.roles]
    for index, part in enumerate(roles):
        address = role_address(index)
        assert part.attachment == (network_name(d), address, part.deployment.kv_transfer.role.value)  # type: ignore[union-attr]
        # NIXL's side channel binds the address the role advertises: the container's own.
        assert dict(part.spec.env)[SIDE_CHANNEL_HOST_ENV] == address
        assert part.labels[Label.GROUP] == d.name and part.labels[Label.OWNER] == OWNER
        # Created, it carries the plan it was launched with, and where launch ran.
        record = json.loads(part.launched_labels("/launch/dir")[Label.PLAN])
        assert (record["plan_hash"], record["cwd"]) == (part.deployment.plan.hash, "/launch/dir")
    assert "kv_producer" in " ".join(roles[0].spec.args) and "kv_consumer" in " ".join(roles[1].spec.args)


def test_the_front_is_the_groups_one_name_and_the_router_runs_the_rendered_command_behind_it():
    d = _group()
    group = d.disaggregated
    assert group is not None
    pair = docker_pair(d, "launch", on_this_host=True, fronted=True)
    front, router = docker_group.front_part(pair), docker_group.router_part(pair)
    # vllm-router checks no key (issue 49): on its loopback, in the front's network namespace.
    invocation = rendered_router_invocation(group, pair_upstreams(group), fronted=True)
    assert router.spec.name == group.router.name and router.deployment is d
    assert (*router.entrypoint, *router.spec.args) == invocation.argv
    assert invocation.argv[1:3] == ("--host", "127.0.0.1")
    assert router.spec.image == invocation.image
    assert router.network_of == d.name and router.attachment is None and router.published == ()
    assert router.labels[Label.GROUP] == d.name
    # The front: the group's name, the pair's network, the published ports, the parts it lists.
    assert front.spec.name == d.name and front.deployment is d
    assert (*front.entrypoint, *front.spec.args) == rendered_front_invocation(d, group).argv
    assert front.attachment is not None and front.attachment.network == network_name(d)
    assert front.labels[Label.PARTS] == ",".join((group.router.name, *(role.name for role in group.roles)))
    clocks = group.router_timeline
    for part in (front, router):
        assert (part.spec.stop_timeout, part.spec.startup_timeout) == (clocks.stop_s, clocks.start_s)
        assert (part.spec.bind, part.spec.host_port, part.spec.container_port) == (
            group.router.network.bind,
            group.router.network.port,
            CONTAINER_PORT,
        )
    # metrics_port 0: Docker picks the host port (two groups never clash on a fixed one).
    assert front.published == ((RENDERED_ROUTER_METRICS_PORT, None),)
    # The API port is the front's: the router's launch does not wait for it to be free.
    options = LaunchOptions(report=lambda _: None, confirm=lambda _: False)
    assert [ContainerLaunch(p, options, None, "/x").publishes for p in (front, router)] == [True, False]


class _Api:
    """The Engine API calls create_container makes, recorded."""

    def __init__(self) -> None:
        self.created: dict[str, Any] = {}

    def create_host_config(self, **kw: Any) -> dict[str, Any]:
        return kw

    def create_endpoint_config(self, **kw: Any) -> dict[str, Any]:
        return kw

    def create_networking_config(self, config: dict[str, Any]) -> dict[str, Any]:
        return config

    def create_container(self, **kw: Any) -> dict[str, str]:
        self.created = kw
        return {"Id": "abc"}


class _Client:
    def __init__(self) -> None:
        self.api = _Api()
        self.containers = self

    def get(self, ident: str) -> str:
        return ident


def _created(part: ContainerRun, environ: dict[str, str]) -> dict[str, Any]:
    client = _Client()
    create_container(
        client,
        part.spec,
        part.environ(environ),
        part.launched_labels("/x"),
        attachment=part.attachment,
        entrypoint=part.entrypoint,
        published=part.published,
        network_of=part.network_of,
    )
    return client.api.created


def test_the_api_key_reaches_roles_and_router_only_through_the_container_environment():
    d = _group("runtime.api_key=true")
    environ = {API_KEY_ENV: SECRET, "HF_TOKEN": "hf_x", "UNRELATED": "1"}
    pair = docker_pair(d, "launch", on_this_host=True, fronted=True)
    roles = docker_group.role_parts(pair)
    front, router = docker_group.front_part(pair), docker_group.router_part(pair)
    for index, part in enumerate(roles):
        made = _created(part, environ)
        assert made["environment"][API_KEY_ENV] == SECRET and "UNRELATED" not in made["environment"]
        endpoint = made["networking_config"][network_name(d)]
        assert endpoint == {"aliases": [part.attachment.alias], "ipv4_address": role_address(index)}  # type: ignore[union-attr]
        assert made["host_config"]["network_mode"] == network_name(d)
    made = _created(router, environ)
    # vllm-router forwards OPENAI_API_KEY to the roles as their bearer token; nothing else of ours.
    assert made["environment"] == {ROUTER_API_KEY_ENV: SECRET}
    assert made["entrypoint"] == ["vllm-router"]
    assert made["host_config"]["network_mode"] == f"container:{d.name}"  # its front's namespace
    assert made["host_config"]["port_bindings"] == {} and made["ports"] == []
    made = _created(front, environ)
    # The front checks the roles' key, read by name from its environment (issue 49).
    assert made["environment"] == {API_KEY_ENV: SECRET}
    assert made["entrypoint"] == ["python3"] and made["command"][-2:] == ["--key-env", API_KEY_ENV]
    ports = made["host_config"]["port_bindings"]
    assert ports[CONTAINER_PORT] == (front.spec.bind, front.spec.host_port)
    assert ports[RENDERED_ROUTER_METRICS_PORT] == (front.spec.bind, None)
    assert made["host_config"]["network_mode"] == network_name(d)
    for part in (*roles, front, router):
        made = _created(part, environ)
        visible = json.dumps([made["command"], made.get("entrypoint"), made["labels"], made["name"]])
        assert SECRET not in visible


def test_dry_run_shows_the_four_containers_and_the_network():
    shown = run_cli(
        "launch", "--hardware", "cpu", "--variant", "pd", "--runtime", "docker", "--dry-run", "--json"
    )
    assert shown.returncode == 0, shown.stderr
    detail = cli_json.data(shown.stdout)
    assert detail["network"]["subnet"] == PAIR_SUBNET
    assert ["--ip", role_address(0)] == detail["prefill"][detail["prefill"].index("--ip") :][:2]
    assert ["--ip", role_address(1)] == detail["decode"][detail["decode"].index("--ip") :][:2]
    front, router = detail["front"], detail["router"]
    assert front == detail["docker_run"] and front[front.index("--name") + 1] == "m31ctl-rehearsal"
    assert front[front.index("--network") :][:2] == ["--network", "m31ctl-rehearsal-pd"]
    assert "--publish" in front and "--publish" not in router
    assert router[router.index("--name") + 1] == "m31ctl-rehearsal-router"
    assert router[router.index("--network") :][:2] == ["--network", "container:m31ctl-rehearsal"]
    assert "--vllm-pd-disaggregation" in router


@dataclasses.dataclass
class _Box:
    """A container as docker_servers.py's status and stop read it."""

    name: str
    status: str = "running"
    labels: dict[str, str] = dataclasses.field(default_factory=dict)


def _row(box: _Box) -> ServerStatus:
    return ServerStatus(box.name, "docker", box.status, None, None, None, None, None)


def test_status_shows_the_group_then_its_parts_and_names_a_part_that_is_down():
    router = _Box("g", labels={Label.PARTS: "g-prefill,g-decode"})
    prefill = _Box("g-prefill", labels={Label.GROUP: "g"})
    decode = _Box("g-decode", status="exited", labels={Label.GROUP: "g"})
    alone = _Box("other")
    rows = docker_servers.statuses([router, prefill, decode, alone], _row)
    assert [(r.name, r.state, r.group) for r in rows] == [
        ("g", "degraded: g-decode down", None),
        ("g-prefill", "running", "g"),
        ("g-decode", "exited", "g"),
        ("other", "running", None),
    ]
    rows = docker_servers.statuses([router, prefill], _row)
    assert [(r.name, r.state) for r in rows][::2] == [
        ("g", "degraded: g-decode down"),
        ("g-decode", "missing"),
    ]
    # A role whose router is gone stands alone, so `stop --name` reaches it.
    assert [(r.name, r.group) for r in docker_servers.statuses([prefill], _row)] == [("g-prefill", None)]


class _Dead:
    kind = "container"

    def __init__(self, name: str) -> None:
        self.name = name

    def state(self) -> ProcessState:
        return ProcessState(running=False, dead=True, exit_code=1)

    def log_tail(self, lines: int) -> str:
        return "RuntimeError: the decode engine failed\n"


class _FakeLaunch:
    """A part's primitives without Docker: a part already serving this plan (found), or one that
    is created and dies while it starts."""

    def __init__(self, part: ContainerRun, options: LaunchOptions, seen: list[Any], serving: bool) -> None:
        self.part, self.options, self.serving, self.created = part, options, serving, False
        seen.append(self)

    def claim(self) -> contextlib.AbstractContextManager[object]:
        return contextlib.nullcontext()

    def find(self, api_key: str | None) -> Found[str] | None:
        if not self.serving:
            return None
        existing = ExistingServer(True, self.part.deployment.plan.hash, "running", serving=True)
        return Found(existing, self.part.spec.name)

    def resume(self, server: Any) -> None: ...

    def remove(self, server: Any) -> None: ...

    def prepare(self) -> None: ...

    def create(self) -> str:
        self.created = True
        return self.part.spec.name

    def handle(self, server: str) -> _Dead:
        return _Dead(server)

    def endpoint(self, server: str) -> str:
        return f"http://127.0.0.1:{self.part.spec.host_port}"

    def died(self, server: str, error: ServerDied) -> ServerDied:
        return error

    def describe(self, server: str) -> str:
        return server

    def started(self, server: str) -> str:
        return f"started {server}"


class _Network:
    def __init__(self, name: str, attrs: dict[str, Any]) -> None:
        self.name, self.attrs = name, attrs


class _Engine:
    """Networks and containers as launch_group and halt use them."""

    def __init__(self, group: str = "") -> None:
        self.group = group
        self.made: list[tuple[str, str]] = []
        self.stopped: list[str] = []
        self.networks, self.containers = self, self

    def list(self, **kw: Any) -> list[_Network]:
        labels = {Label.OWNER: OWNER}
        return [_Network(n, {"Labels": labels, "IPAM": {"Config": [{"Subnet": s}]}}) for n, s in self.made]

    def create(self, name: str, labels: dict[str, str], ipam: Any) -> None:
        self.made.append((name, ipam["Config"][0]["Subnet"]))

    def get(self, name: str) -> Any:
        engine = self
        group = name.rsplit("-", 1)[0]
        mine = {Label.PARTS: f"{name}-prefill,{name}-decode"} if name == self.group else {Label.GROUP: group}

        class Container:
            labels: ClassVar[dict[str, str]] = {Label.OWNER: OWNER, **mine}

            def update(self, **kw: Any) -> None: ...

            def stop(self, timeout: int) -> None:
                engine.stopped.append(name)

        return Container()


def test_a_role_that_dies_while_the_group_starts_is_named_and_the_group_is_stopped():
    d = _group()
    engine, seen = _Engine(d.name), []
    options = LaunchOptions(report=lambda _: None, confirm=lambda _: False, timeout=5, detach=True)
    serving = iter([True, False])  # prefill serves this plan already; decode is created and dies
    with pytest.raises(ServerDied) as died:
        docker_group.launch_group(
            docker_pair(d, "launch", on_this_host=True, fronted=True),
            options,
            engine,
            lambda part, o: _FakeLaunch(part, o, seen, next(serving)),
        )
    assert engine.made == [(network_name(d), PAIR_SUBNET)]
    message = died.value.message
    assert message.startswith(f"P/D group {d.name}: {d.name}-decode exited (code 1) while starting")
    assert "stopped the group" in message
    # Even detached, each role is waited for: the router is never started before both answer.
    assert [f.part.spec.name for f in seen] == [f"{d.name}-prefill", f"{d.name}-decode"]
    assert all(not f.options.detach for f in seen)
    assert set(engine.stopped) == {d.name, f"{d.name}-router", f"{d.name}-prefill", f"{d.name}-decode"}


def test_without_timeout_the_router_waits_on_the_groups_router_clock():
    d = _group()
    group = d.disaggregated
    assert group is not None
    seen: list[_FakeLaunch] = []
    options = LaunchOptions(report=lambda _: None, confirm=lambda _: False)
    pair = docker_pair(d, "launch", on_this_host=True, fronted=True)
    result = docker_group.launch_group(pair, options, _Engine(), lambda p, o: _FakeLaunch(p, o, seen, True))
    assert result.server == d.name and result.action == "unchanged"
    names = [f"{d.name}-prefill", f"{d.name}-decode", d.name, group.router.name]  # the front, then the router
    assert [f.part.spec.name for f in seen] == names
    assert [f.options.timeout for f in seen] == [None, None, None, group.router_timeline.start_s]
    # The front is started, not waited for: it answers once the router behind it does.
    assert [f.options.detach for f in seen] == [False, False, True, False]


# --- for real --------------------------------------------------------------------------------

IMAGE = "m31ctl/vllm-cpu:0.32.0"  # the cpu recipe's engine.image: vLLM's CPU build, nixl, vllm-router
SERVED = "m31ctl-rehearsal"
LAUNCH_TIMEOUT_S = 900  # two vLLM starts on two shared cores, then the router
PROMPT = "the model serves tokens on four GPUs with sparse attention and a speculative draft; " * 12


def _post(url: str, body: dict[str, Any], key: str) -> dict[str, Any]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"},
    )
    with urllib.request.urlopen(request, timeout=300) as answer:
        return dict(json.loads(answer.read()))


def _external_prompt_tokens(url: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prompt_tokens_by_source_total") and 'source="external_kv_transfer"' in line
    )


def _refused_without_the_key(endpoint: str, body: dict[str, Any]) -> None:
    """The router's front (issue 49): a completion without the key is 401, worker management
    404 with it."""
    for path, key in (("/v1/completions", None), ("/v1/completions", "wrong"), ("/remove_worker", SECRET)):
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        request = urllib.request.Request(f"{endpoint}{path}", data=json.dumps(body).encode(), headers=headers)
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == (404 if path == "/remove_worker" else 401), path


def _leftovers(client: Any, name: str) -> list[str]:
    from m31ctl.runtime import engine_api

    parts = _parts(name)
    found = [p for p in parts if engine_api.find_container(client, p) is not None]
    found += engine_api.labelled(client, Label.GROUP, name)
    found += [n.name for n in client.networks.list(names=[f"{name}-pd"])]
    return found


@pytest.mark.docker
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(1800)  # two launches that may each wait 900 s
def test_pd_group_in_docker_serves_through_the_router_and_stops_as_one(
    vllm_py, tiny_model, tmp_path, rehearsal_image
):
    from m31ctl.runtime import engine_api

    client = engine_api.connect()
    if _pair_subnet_taken(client):
        pytest.skip(f"another network of this host holds {PAIR_SUBNET} (a P/D group's or Compose's)")
    name = f"m31ctl-pdd-{uuid.uuid4().hex[:6]}"
    api, prefill, decode = free_ports(3)
    (tmp_path / "hf").mkdir()
    env = {"M31CTL_STATE_DIR": str(tmp_path / "state"), API_KEY_ENV: SECRET}
    args = ["launch", "--runtime", "docker", "--hardware", "cpu", "--variant", "pd", "--name", name]
    args += ["--port", str(api), "--timeout", str(LAUNCH_TIMEOUT_S), "--skip-deep", "--json"]
    for key, value in {
        "model.path": tiny_model,
        "runtime.hf_cache": tmp_path / "hf",
        "runtime.api_key": "true",
        "disaggregation.prefill.port": prefill,
        "disaggregation.decode.port": decode,
    }.items():
        args += ["--set", f"{key}={value}"]
    try:
        launched = run_cli(*args, env=env)
        assert launched.returncode == 0, launched.stderr[-3000:]
        assert SECRET not in launched.stdout + launched.stderr
        result = last_json(launched.stdout)
        assert result["ready"] and result["server"] == name and result["runtime"] == "docker", result
        _serves_as_one(client, name, result["endpoint"], f"http://127.0.0.1:{decode}", env)
        again = run_cli(*args, env=env)
        assert again.returncode == 0 and last_json(again.stdout)["action"] == "unchanged", again.stderr[
            -2000:
        ]
        logs = run_cli("logs", "--runtime", "docker", "--name", name, "--tail", "300", env=env)
        assert logs.returncode == 0 and all(f"==> {p} (container " in logs.stdout for p in _parts(name))
        stopped = run_cli("stop", "--name", name, env=env)
        assert stopped.returncode == 0, stopped.stderr
        assert _leftovers(client, name) == []
    finally:
        for part in _parts(name):
            with contextlib.suppress(Exception):
                client.containers.get(part).remove(force=True)
        with contextlib.suppress(Exception):
            client.networks.get(f"{name}-pd").remove()


def _parts(name: str) -> list[str]:
    """The group's containers as status lists them: the front (the group), the router, the roles."""
    return [name, f"{name}-router", f"{name}-prefill", f"{name}-decode"]


def _pair_subnet_taken(client: Any) -> bool:
    for network in client.networks.list():
        network.reload()
        configs = (network.attrs.get("IPAM") or {}).get("Config") or []
        if any(c.get("Subnet") == PAIR_SUBNET for c in configs):
            return True
    return False


def _serves_as_one(client: Any, name: str, endpoint: str, decode_url: str, env: dict[str, str]) -> None:
    """status lists the group then its roles; each role holds the address it advertises; the
    secret is in no argv or label; a completion through the router had its KV over NIXL."""
    shown = run_cli("status", "--runtime", "docker", "--json", env=env)
    rows = [r for r in cli_json.data(shown.stdout)["servers"] if r["name"] in _parts(name)]
    assert [(r["name"], r["state"], r["group"]) for r in rows] == [
        (name, "running", None),
        (f"{name}-router", "running", name),
        (f"{name}-prefill", "running", name),
        (f"{name}-decode", "running", name),
    ]
    assert rows[0]["endpoint"] == endpoint
    for part in _parts(name):
        attrs = client.containers.get(part).attrs
        config = attrs["Config"]
        assert SECRET not in json.dumps([config["Cmd"], config["Entrypoint"], config["Labels"]])
        environ = dict(e.split("=", 1) for e in config["Env"])
        if part == name:  # the front checks the key (issue 49)
            assert environ[API_KEY_ENV] == SECRET and ROUTER_API_KEY_ENV not in environ
        elif part == f"{name}-router":  # which the router sends the roles
            assert environ[ROUTER_API_KEY_ENV] == SECRET
            assert attrs["HostConfig"]["NetworkMode"] == f"container:{client.containers.get(name).id}"
        else:
            assert environ[API_KEY_ENV] == SECRET
            networks = attrs["NetworkSettings"]["Networks"].values()
            assert environ[SIDE_CHANNEL_HOST_ENV] == next(n["IPAddress"] for n in networks if n["IPAddress"])
    before = _external_prompt_tokens(decode_url)
    body = {"model": SERVED, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    _refused_without_the_key(endpoint, body)
    answer = _post(f"{endpoint}/v1/completions", body, SECRET)
    assert answer["usage"]["completion_tokens"] == 8, answer
    assert _external_prompt_tokens(decode_url) > before, "decode computed the prompt: no KV came over NIXL"
