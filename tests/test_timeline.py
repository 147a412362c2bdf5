"""Every clock of every rendered file, for every hardware spec and both P/D plans (each role and
the router), against the Deployment's timeline (m31ctl/timeline.py): each is read back from the
artifact as its runtime reads it (systemd's keys, Compose's durations, the kubelet's probe
arithmetic, the script's deadline), never from m31ctl's own values; and what launch hands the
engine (--no-pull, --timeout) against the same timeline."""

from __future__ import annotations

import re
import shlex

import pytest
import yaml

from m31ctl import deploy
from m31ctl.deployment import derive
from m31ctl.engine.adapter import OFFLINE_ENV
from m31ctl.errors import InputError, M31Error
from m31ctl.hardware import PRODUCTS, simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.render import get_target
from m31ctl.runtime.launching import LAUNCH_ENV
from m31ctl.runtime.protocol import LaunchOptions
from m31ctl.timeline import (
    ENDPOINT_REMOVAL_S,
    ENGINE_READY_ENV,
    VLLM_DEFAULT_ENGINE_READY_S,
    VLLM_HANDSHAKE_S,
    Timeline,
    TimelineInputs,
    conflicts,
    timeline_of,
)
from tests.conftest import PINNED_COMMIT
from tests.support.render import PLANS as PD_PLANS
from tests.support.render import pd_deployment

# Every product at the count its recipe asks for (Hopper needs 8), and the CPU rehearsal.
SPECS = [f"{name}x8" for name in PRODUCTS] + [f"{name}x4" for name in PRODUCTS if not name.startswith("h")]


def _deployment(spec: str, *sets: str):  # type: ignore[no-untyped-def]
    try:
        plan = resolve(PlanRequest(hardware=simulated(spec), sets=sets))
    except M31Error as exc:  # a product no recipe serves
        pytest.skip(f"{spec}: {exc}")
    return derive(plan, commit=PINNED_COMMIT)


def _render(deployment, target: str) -> str:  # type: ignore[no-untyped-def]
    (artifact,) = [a for a in get_target(target)(deployment) if not a.name.endswith(".md")]
    return artifact.content


def _seconds(duration: str) -> int:
    match = re.fullmatch(r"(\d+)s", duration)
    assert match, duration
    return int(match.group(1))


def _env_of(argv: list[str]) -> dict[str, str]:
    return dict(
        argv[i + 1].split("=", 1)
        for i, word in enumerate(argv[:-1])
        if word == "--env" and "=" in argv[i + 1]
    )


@pytest.mark.parametrize("spec", SPECS)
def test_every_clock_of_every_target_is_the_timelines(spec):
    d = _deployment(spec)
    t = d.timeline
    # vLLM's own limit covers the load budget (its default 600 s would end a 1,200 s load).
    assert t.engine_ready_s >= t.load_s and t.engine_ready_s > VLLM_DEFAULT_ENGINE_READY_S
    drain = d.plan.settings.serving.shutdown_timeout

    # script: the engine's environment, the download's own budget, --wait's deadline, docker's stop.
    script = _render(d, "script")
    words = shlex.split(script.replace("\\\n", " "), comments=True)
    assert f"VLLM_ENGINE_READY_TIMEOUT_S={t.engine_ready_s}" in words and "HF_HUB_OFFLINE=1" in words
    download_at = words.index(PINNED_COMMIT, words.index("--entrypoint"))
    assert words[download_at + 1] == str(t.download_s)
    assert f"deadline=$((SECONDS + {t.ready_s}))" in script
    assert words[words.index("--stop-timeout") + 1] == str(t.stop_s) and t.stop_s > drain

    # systemd: the start covers the download and the readiness wait; the stop covers docker's.
    unit = _render(d, "systemd")
    keys = dict(line.split("=", 1) for line in unit.splitlines() if re.match(r"^Timeout\w+Sec=", line))
    assert int(keys["TimeoutStartSec"]) >= t.download_s + t.ready_s
    as_run = unit.replace("$$", "$").replace("%%", "%")  # systemd unescapes both in Exec lines
    assert f"deadline=$(($(date +%s) + {t.ready_s}))" in as_run
    assert f"docker stop --time {t.stop_s} " in unit and int(keys["TimeoutStopSec"]) > t.stop_s

    # Compose: the engine waits for the one-shot download; the health check's start period is the
    # engine's start; the grace period is the stop.
    compose = yaml.safe_load(_render(d, "compose"))["services"]
    engine = compose["vllm"]
    assert engine["depends_on"] == {"download": {"condition": "service_completed_successfully"}}
    assert compose["download"]["command"][3:5] == [PINNED_COMMIT, str(t.download_s)]
    assert "HF_HUB_OFFLINE=1" not in compose["download"]["environment"]  # the download must reach the hub
    assert _seconds(engine["healthcheck"]["start_period"]) == t.ready_s
    assert _seconds(engine["stop_grace_period"]) == t.stop_s
    assert f"VLLM_ENGINE_READY_TIMEOUT_S={t.engine_ready_s}" in engine["environment"]

    # Kubernetes: the kubelet's startup probe allows the readiness wait in whole periods; the
    # rollout's deadline covers the pull, the download and the start; the grace covers the drain.
    documents = list(yaml.safe_load_all(_render(d, "k8s")))
    workload = documents[1]
    pod = workload["spec"]["template"]["spec"]
    container = pod["containers"][0]
    probe = container["startupProbe"]
    allowed = probe["failureThreshold"] * probe["periodSeconds"]
    assert t.ready_s <= allowed < t.ready_s + probe["periodSeconds"]
    assert allowed >= t.engine_ready_s  # vLLM's limit fires first: its own words are in the log
    assert workload["spec"]["progressDeadlineSeconds"] >= t.download_s + t.ready_s
    # The grace counts from the preStop wait for the endpoints to drop the pod, then the drain.
    assert pod["terminationGracePeriodSeconds"] == t.pod_grace_s == ENDPOINT_REMOVAL_S + t.stop_s
    assert t.stop_s > drain
    assert container["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(ENDPOINT_REMOVAL_S)]
    assert {"name": "VLLM_ENGINE_READY_TIMEOUT_S", "value": str(t.engine_ready_s)} in container["env"]
    assert pod["initContainers"][0]["command"][5] == str(t.download_s)


def _compose_pd_role_clocks(services, role) -> None:  # type: ignore[no-untyped-def]
    """A role's Compose service keeps its own Deployment's timeline, as the aggregated one does."""
    t = role.timeline
    service = services[role.kv_transfer.role.value]
    assert _seconds(service["healthcheck"]["start_period"]) == t.ready_s
    assert _seconds(service["stop_grace_period"]) == t.stop_s > role.plan.settings.serving.shutdown_timeout
    assert f"VLLM_ENGINE_READY_TIMEOUT_S={t.engine_ready_s}" in service["environment"]
    if t.download_s:  # one download for both roles, before either starts
        assert services["download"]["command"][3:5] == [PINNED_COMMIT, str(t.download_s)]
        assert service["depends_on"] == {"download": {"condition": "service_completed_successfully"}}
    else:
        assert "download" not in services and "depends_on" not in service


def _k8s_pd_role_clocks(workload, role) -> None:  # type: ignore[no-untyped-def]
    """A role's Kubernetes Deployment: its probe, rollout deadline, grace and download budget."""
    t = role.timeline
    pod = workload["spec"]["template"]["spec"]
    container = pod["containers"][0]
    probe = container["startupProbe"]
    allowed = probe["failureThreshold"] * probe["periodSeconds"]
    assert t.ready_s <= allowed < t.ready_s + probe["periodSeconds"]
    assert workload["spec"]["progressDeadlineSeconds"] == t.progress_deadline_s >= t.download_s + t.ready_s
    assert pod["terminationGracePeriodSeconds"] == t.pod_grace_s
    assert t.stop_s > role.plan.settings.serving.shutdown_timeout
    assert {"name": "VLLM_ENGINE_READY_TIMEOUT_S", "value": str(t.engine_ready_s)} in container["env"]
    downloads = [c for c in pod.get("initContainers", []) if c["name"] == "download"]
    assert [c["command"][5] for c in downloads] == ([str(t.download_s)] if t.download_s else [])


@pytest.mark.parametrize("key", sorted(PD_PLANS))
def test_every_clock_of_a_pd_render_is_its_roles_and_routers_timeline(key):
    """A P/D plan (the CPU recipe's pd variant, B300x8 split 4 + 4): each role's clocks are its
    own Deployment's timeline, and the router's are the timeline's router clocks, which start
    only once both roles may have started (so vllm-router never gives up on a role first)."""
    d = pd_deployment(key)
    group = d.disaggregated
    assert group is not None
    router = group.router_timeline
    slowest = max(role.timeline.progress_deadline_s for role in group.roles)
    assert router.roles_wait_s == slowest and router.progress_deadline_s >= slowest + router.start_s

    services = yaml.safe_load(_render(d, "compose"))["services"]
    for role in group.roles:
        _compose_pd_role_clocks(services, role)
    # The router's healthcheck is its front's, which answers /health once the router does (issue 49).
    assert _seconds(services["front"]["healthcheck"]["start_period"]) == router.start_s
    assert _seconds(services["router"]["stop_grace_period"]) == router.stop_s
    assert _seconds(services["front"]["stop_grace_period"]) == router.stop_s
    healthy = {"condition": "service_healthy"}
    assert services["router"]["depends_on"] == {
        "front": {"condition": "service_started"},
        **{role.kv_transfer.role.value: healthy for role in group.roles},  # type: ignore[union-attr]
    }

    workloads = {
        doc["metadata"]["name"]: doc
        for doc in yaml.safe_load_all(_render(d, "k8s"))
        if doc["kind"] == "Deployment"
    }
    assert set(workloads) == {role.name for role in group.roles} | {group.router.name}
    for role in group.roles:
        _k8s_pd_role_clocks(workloads[role.name], role)
    routed = workloads[group.router.name]
    assert routed["spec"]["progressDeadlineSeconds"] == router.progress_deadline_s
    pod = routed["spec"]["template"]["spec"]
    (wait,) = pod["initContainers"]
    assert wait["name"] == "wait-for-roles" and wait["command"][3] == str(router.roles_wait_s)
    assert pod["terminationGracePeriodSeconds"] == router.stop_s


@pytest.mark.parametrize("spec,sets", [("h100x4", ("parallelism.nodes=2",)), ("b300x4", ("parallelism.nodes=2",
                         "parallelism.data=8", "parallelism.tensor=1"))])  # fmt: skip
def test_a_group_waits_for_its_leader_longer_than_vllms_handshake(spec, sets):
    d = _deployment(spec, *sets, "kubernetes.hf_cache_storage_class=nfs")
    t = d.timeline
    lws = yaml.safe_load_all(_render(d, "k8s"))
    lws = next(doc for doc in lws if doc["kind"] == "LeaderWorkerSet")
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"  # LeaderReady would deadlock the join
    template = lws["spec"]["leaderWorkerTemplate"]
    leader, worker = template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]
    # Only the leader downloads into the shared claim; each worker waits for its marker.
    assert leader["initContainers"][0]["name"] == "download"
    (wait,) = worker["initContainers"]
    assert wait["name"] == "wait-for-checkpoint" and wait["command"][-1] == str(t.checkpoint_wait_s)
    assert t.checkpoint_wait_s > t.download_s
    assert wait["volumeMounts"][0]["readOnly"] is True
    script = worker["containers"][0]["command"][2]
    assert f"-ge {t.leader_wait_s} ]" in script.replace("$$", "$") and t.leader_wait_s > VLLM_HANDSHAKE_S
    probe = leader["containers"][0]["startupProbe"]
    assert probe["failureThreshold"] * probe["periodSeconds"] >= t.join.seconds + t.load_s
    for spec_ in (leader, worker):
        assert spec_["terminationGracePeriodSeconds"] == t.pod_grace_s


def test_a_user_engine_ready_limit_below_the_load_budget_is_named():
    t = timeline_of(TimelineInputs(250.1, False, 1000.0, 1200, None, 30, 1, False))
    (found,) = conflicts(t, {"VLLM_ENGINE_READY_TIMEOUT_S": "600"})
    assert found.settings == ("runtime.env.VLLM_ENGINE_READY_TIMEOUT_S", "runtime.load_and_compile_s")
    short = timeline_of(TimelineInputs(250.1, False, 1000.0, 1200, 300, 30, 1, False))
    (found,) = conflicts(short, {})
    assert found.settings == ("runtime.startup_timeout", "runtime.load_and_compile_s")
    assert conflicts(t, {"VLLM_ENGINE_READY_TIMEOUT_S": "5000"}) == []


def test_a_hub_checkpoint_that_names_no_revision_is_not_rendered():
    """A Deployment derived without a revision (not through `m31ctl render`, which names one:
    tests/render/test_render_without_hub.py) is refused rather than rendered unpinned and online."""
    plan = resolve(PlanRequest(hardware=simulated("b300x4")))
    with pytest.raises(InputError, match="names no revision"):
        get_target("script")(derive(plan))


# --- launch keeps the same timeline ---------------------------------------------------------------
class _Started:
    """The runtime seam (as tests/pull/test_pull.py uses it): the options the engine would start with."""

    name, gates, runs_groups = "fake", (), False

    def __init__(self) -> None:
        self.options: list[LaunchOptions] = []

    def launch(self, deployment, options):  # type: ignore[no-untyped-def]
        self.options.append(options)
        return "started"


def _launch(
    monkeypatch: pytest.MonkeyPatch, timeout: float | None, pulled: bool | None
) -> tuple[LaunchOptions, list[str], Timeline]:
    """`m31ctl launch` of a hub checkpoint on b300x4 with no Docker, vLLM or hub: `pulled` None is
    --no-pull (no fetch), else what m31ctl pull reported."""
    runtime, said = _Started(), []
    monkeypatch.setattr(deploy, "get_runtime", lambda name: runtime)
    monkeypatch.setattr(deploy, "preflight", lambda *args, **kwargs: [])
    d = derive(resolve(PlanRequest(hardware=simulated("b300x4"))))
    assert not d.model.local and d.timeline.download_s > 0
    options = LaunchOptions(report=said.append, confirm=lambda question: False, timeout=timeout)
    deploy.launch(d, "fake", options, deep=False, fetch=None if pulled is None else lambda _: pulled)
    (started,) = runtime.options
    return started, said, d.timeline


def test_launch_no_pull_raises_vllms_ready_limit_to_the_download_and_the_load(monkeypatch):
    """--no-pull: vLLM downloads inside its engine core's start, so its ready limit (which the
    runtimes hand the engine over the adapter's, runtime/launching.py LAUNCH_ENV) and launch's
    wait cover the download too; after a pull the engine runs offline on the load budget alone."""
    started, said, t = _launch(monkeypatch, None, None)
    raised = started.environ[ENGINE_READY_ENV]
    assert raised == str(t.download_s + t.load_s) == str(t.engine_ready_with_download_s)
    assert int(raised) > t.engine_ready_s and ENGINE_READY_ENV in LAUNCH_ENV
    assert started.timeout == t.download_s + t.ready_s == t.start_s
    assert OFFLINE_ENV not in started.environ and said == []

    pulled, said, t = _launch(monkeypatch, None, True)
    assert ENGINE_READY_ENV not in pulled.environ and pulled.environ[OFFLINE_ENV] == "1"
    assert pulled.timeout is None and said == []


def test_launch_warns_of_a_timeout_shorter_than_the_download_and_the_start(monkeypatch):
    """launch --timeout below what the timeline needs names both settings; a --timeout the user
    set is kept (launch gives up when told), and one that covers the start says nothing."""
    t = _launch(monkeypatch, None, None)[2]
    started, said, _ = _launch(monkeypatch, t.start_s - 1, None)
    (warning,) = said
    assert warning.startswith(f"warning: --timeout {t.start_s - 1} is shorter than the download ")
    assert f"({t.download_s} s, runtime.download_mbps) plus the start ({t.ready_s} s)" in warning
    assert started.timeout == t.start_s - 1
    assert _launch(monkeypatch, t.start_s, None)[1] == []

    # After a pull the download is done: only the start counts.
    assert _launch(monkeypatch, t.ready_s, True)[1] == []
    (warning,) = _launch(monkeypatch, t.ready_s - 1, True)[1]
    assert f"shorter than the start ({t.ready_s} s: runtime.load_and_compile_s={t.load_s}" in warning


@pytest.mark.parametrize(("key", "timeout"), [("pd-b300x8", 13107), ("pd-cpu", 1800)])
def test_the_router_outwaits_the_longest_generation_and_the_roles_drain(key, timeout):
    """vllm-router's 1,800 s default would end a 256K generation; it drains its streams on SIGTERM
    (measured, 0.1.17), so its stop covers the roles' drain; a P/D request is retried once, not
    four times (each attempt runs the prompt's prefill again)."""
    from m31ctl.engine.router import ROUTER_ATTEMPTS
    from m31ctl.timeline import ROUTER_STOP_MARGIN_S

    hardware, options = PD_PLANS[key]
    plan = resolve(
        PlanRequest(
            hardware=simulated(hardware), variant=options.get("variant"), sets=options.get("sets", ())
        )
    )
    group = derive(plan, commit=PINNED_COMMIT).disaggregated
    assert group is not None
    clocks = group.router_timeline
    assert clocks.request_timeout_s == timeout
    assert clocks.stop_s == max(role.timeline.drain_s for role in group.roles) + ROUTER_STOP_MARGIN_S
    (artifact,) = get_target("compose")(derive(plan, commit=PINNED_COMMIT))
    router = yaml.safe_load(artifact.content)["services"]["router"]
    argv = [*router["entrypoint"], *router["command"]]
    assert argv[argv.index("--request-timeout-secs") + 1] == str(timeout)
    assert argv[argv.index("--retry-max-retries") + 1] == str(ROUTER_ATTEMPTS) == "2"
    assert router["stop_grace_period"] == f"{clocks.stop_s}s"
