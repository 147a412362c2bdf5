"""launch / status / logs / stop against the real Docker Engine, with locally built stand-in engines."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from tests.conftest import last_json, run_cli
from tests.ports import free_port
from tests.slow_docker import SlowDocker
from tests.support import cli_json

pytestmark = pytest.mark.docker

CANARY = "hf_CANARY_launch_0123456789abcdef"


@pytest.fixture(scope="module")
def images():
    from m31ctl.runtime.engine_api import connect
    from tests.dockerlib import build_engine_images

    return build_engine_images(connect())


@pytest.fixture
def docker_client():
    from m31ctl.runtime.engine_api import connect

    return connect()


class Deployment:
    """One test's container: unique name and port; removed afterwards whatever happened."""

    def __init__(self, image: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
        self.name = f"m31ctl-test-{uuid.uuid4().hex[:8]}"
        self.port = free_port()
        self.image = image
        self.model_dir = tmp_path

    def args(self, *extra: str, image: str | None = None, delay: int = 1) -> list[str]:
        return [
            "launch",
            "--hardware",
            "cpu",
            "--name",
            self.name,
            "--port",
            str(self.port),
            "--set",
            f"engine.image={image or self.image}",
            "--set",
            f"model.path={self.model_dir}",
            "--set",
            f"runtime.env.FAKE_ENGINE_DELAY={delay}",
            *extra,
        ]


@pytest.fixture
def deployment(images, tmp_path, docker_client):
    d = Deployment(images["ready"], tmp_path)
    yield d
    with contextlib.suppress(Exception):
        docker_client.containers.get(d.name).remove(force=True)


def test_fresh_launch_status_logs_relaunch_change_stop(deployment, docker_client):
    first = run_cli(*deployment.args("--json"), env={"HF_TOKEN": CANARY})
    assert first.returncode == 0, first.stderr
    result = last_json(first.stdout)
    assert result["action"] == "created" and result["ready"] is True
    # JSON Lines for CI logs: one event per phase as it begins, the result object last.
    events = cli_json.events(first.stdout)
    assert events and all(e["event"] == "phase" and e["elapsed_s"] >= 0 for e in events)
    assert events[-1]["phase"] == "ready" and [e["phase"] for e in events[:-1]] == result["phases"]
    assert result["endpoint"] == f"http://127.0.0.1:{deployment.port}"
    assert result["phases"] and set(result["phases"]) <= {
        "starting the engine",
        "loading weights",
        "compiling",
        "capturing CUDA graphs",
        "serving",
    }
    # The launch is ready on the look that first found the model listed, not a poll period or a
    # wait later: ready follows the first answer of /v1/models with no other milestone between
    # (a bound in seconds would measure this host's load, not the launch).
    timings = result["timings_s"]
    assert timings["models_first_answer"] <= timings["ready"]
    assert not [k for k, v in timings.items() if timings["models_first_answer"] < v < timings["ready"]]
    assert CANARY not in first.stdout + first.stderr
    container = docker_client.containers.get(deployment.name)
    assert container.labels["io.m31ctl.owner"] == "m31ctl" and container.labels["io.m31ctl.recipe"] == "cpu"
    # The plan it was launched with, recorded with it (verify, smoke and status re-resolve it).
    recorded = json.loads(container.labels["io.m31ctl.plan"])
    assert (
        recorded["plan_hash"] == result["plan_hash"]
        and recorded["settings"]["runtime"]["port"] == deployment.port
    )
    assert result["server"] == result["container"] == deployment.name
    assert container.attrs["HostConfig"]["PortBindings"]["8000/tcp"][0] == {
        "HostIp": "127.0.0.1",
        "HostPort": str(deployment.port),
    }
    assert container.attrs["Config"]["Cmd"][:3] == [
        str(deployment.model_dir),
        "--served-model-name",
        "m31ctl-rehearsal",
    ]
    assert f"HF_TOKEN={CANARY}" in container.attrs["Config"]["Env"]  # by reference: env, never argv
    assert not any(CANARY in arg for arg in container.attrs["Config"]["Cmd"])

    status = run_cli("status", "--json")
    row = next(r for r in cli_json.data(status.stdout)["servers"] if r["name"] == deployment.name)
    assert row["state"] == "running" and row["health"] == 200 and row["plan_hash"] == result["plan_hash"]
    assert row["plan_recorded"] is True

    logs = run_cli("logs", "--name", deployment.name, "--tail", "50")
    assert "Application startup complete" in logs.stdout

    again = run_cli(*deployment.args("--json"))
    assert again.returncode == 0 and last_json(again.stdout)["action"] == "unchanged"
    assert docker_client.containers.get(deployment.name).id == container.id

    changed = deployment.args("--set", "serving.max_model_len=1024", "--json")
    refused = run_cli(*changed)  # stdin is no terminal: no confirmation, no change
    assert refused.returncode == 4 and "--yes" in refused.stderr
    assert docker_client.containers.get(deployment.name).id == container.id
    replaced = run_cli(*changed, "--yes")
    assert replaced.returncode == 0 and last_json(replaced.stdout)["action"] == "recreated"
    assert docker_client.containers.get(deployment.name).id != container.id

    # A busy Engine answers the stop late (CI, stop 58: a container's stop outlived docker-py's
    # read timeout, the client's 10 s plus the grace): held 12 s here, the stop still completes.
    with SlowDocker(rb"POST /v[\d.]+/containers/\w+/stop", 12) as slow:
        stopped = run_cli(
            "stop", "--name", deployment.name, "--timeout", "1", "--json", env={"DOCKER_HOST": slow.url}
        )
    assert any(line.endswith("/stop") for line in slow.held), slow.held
    assert stopped.returncode == 0 and cli_json.data(stopped.stdout) == {"stopped": [deployment.name]}, (
        stopped.stderr
    )
    assert deployment.name not in [c.name for c in docker_client.containers.list(all=True)]


def test_foreign_container_with_our_name_is_never_touched(deployment, docker_client):
    foreign = docker_client.containers.run(
        deployment.image, name=deployment.name, detach=True, environment={"FAKE_ENGINE_MODE": "hang"}
    )
    result = run_cli(*deployment.args())
    assert result.returncode == 4 and "not created by m31ctl" in result.stderr
    foreign.reload()
    assert foreign.status == "running"
    assert run_cli("stop", "--name", deployment.name).returncode == 4
    foreign.reload()
    assert foreign.status == "running"


def test_port_in_use(deployment):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", deployment.port))
        busy.listen()
        result = run_cli(*deployment.args())
    assert result.returncode == 4 and f"port 127.0.0.1:{deployment.port} is in use" in result.stderr


def test_crash_while_loading_is_diagnosed(deployment, images, docker_client):
    result = run_cli(*deployment.args("--timeout", "60", image=images["oom"]))
    assert result.returncode == 5
    assert "out of GPU memory" in result.stderr
    assert "CUDA out of memory" in result.stderr  # the last log lines are shown
    assert "Traceback" not in result.stderr
    # Left stopped with its logs, not crash-looping under the restart policy; the message says how
    # to retry.
    assert (
        f"m31ctl logs --name {deployment.name}" in result.stderr
        and "m31ctl launch replaces it" in result.stderr
    )
    container = docker_client.containers.get(deployment.name)
    # Docker never restarts a container whose policy is "no": the policy is the proof, not a wait.
    assert container.attrs["HostConfig"]["RestartPolicy"]["Name"] == "no"
    assert container.status == "exited", container.status
    assert "CUDA out of memory" in run_cli("logs", "--name", deployment.name).stdout


def test_timeout_says_still_loading(deployment, images):
    # The message names the limit it gave up at; the wall-clock time around it (container start
    # and stop) is the machine's, not the product's. 30 s, not 3: the engine must have printed
    # its first phase by then, and a loaded host took longer than 3 s to start the container
    # (the message said "last phase: none").
    result = run_cli(*deployment.args("--timeout", "30", image=images["hang"]))
    assert result.returncode == 5
    assert "not ready after 30 s: still loading (last phase: loading weights)" in result.stderr


def test_ctrl_c_while_waiting_then_next_launch_converges(deployment, docker_client):
    args = deployment.args(delay=8)
    # Ctrl-C at a terminal: SIGINT at its default disposition. A test run started in the background
    # of a non-interactive shell (`bash .ci/run &`) ignores SIGINT, children inherit that, and
    # Python then installs no KeyboardInterrupt handler: the interrupt would never arrive.
    proc = subprocess.Popen(
        [sys.executable, "-m", "m31ctl", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 60
    seen = ""
    while time.monotonic() < deadline and "started" not in seen and proc.poll() is None:
        seen += proc.stderr.readline()
    assert "started" in seen, seen
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, seen + err
    container = docker_client.containers.get(deployment.name)
    assert container.labels["io.m31ctl.owner"] == "m31ctl"
    again = run_cli(*args, "--json")
    assert again.returncode == 0, again.stderr
    assert last_json(again.stdout)["action"] in ("adopted", "unchanged")
    assert docker_client.containers.get(deployment.name).id == container.id


def test_docker_daemon_unreachable(deployment, tmp_path):
    env = {"DOCKER_HOST": f"unix://{tmp_path}/stopped-docker.sock"}
    for command in (deployment.args(), ["status"], ["stop", "--all"], ["logs"]):
        result = run_cli(*command, env=env)
        assert result.returncode == 3, (command, result.stderr)
        assert "cannot reach the Docker Engine" in result.stderr and "Traceback" not in result.stderr


def test_dry_run_starts_nothing(deployment, docker_client):
    result = run_cli(*deployment.args("--dry-run", "--json"))
    assert result.returncode == 0
    data = cli_json.data(result.stdout)
    assert data["docker_run"][:2] == ["docker", "run"] and data["container"]["name"] == deployment.name
    assert deployment.name not in [c.name for c in docker_client.containers.list(all=True)]


def test_unknown_image_without_registry(deployment):
    result = run_cli(*deployment.args(image="m31ctl-test/absent:1"))
    assert result.returncode == 6 and "m31ctl-test/absent:1" in result.stderr
    assert "Traceback" not in result.stderr


if os.environ.get("CI") == "true":  # pragma: no cover - CI must exercise the engine, never skip it

    def test_engine_is_reachable_in_ci(docker_client):
        assert docker_client.ping()


def test_container_removed_while_waiting_is_a_dead_server(deployment, docker_client):
    """A Docker API error after connect (the container removed during the readiness wait) is
    the documented exit 5, not an internal error."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "m31ctl", *deployment.args(delay=20)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    seen = ""
    while time.monotonic() < deadline and "started" not in seen:
        seen += proc.stderr.readline()
    docker_client.containers.get(deployment.name).remove(force=True)
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 5, err
    assert "removed while starting" in err and "internal error" not in err and "Traceback" not in err


def test_concurrent_launches_of_one_plan_make_one_container(deployment, docker_client):
    """Four launches of the same plan at once (same name, same port): exactly one container; every
    launch ends converged on it (exit 0) or reports the conflict (exit 4); none removes another's
    container, none ends in an internal error."""
    argv = [sys.executable, "-m", "m31ctl", *deployment.args("--json", delay=3)]
    procs = [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(4)
    ]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    codes = [code for code, _out, _err in results]
    assert set(codes) <= {0, 4}, [(c, e[-500:]) for c, _o, e in results]
    assert 0 in codes
    ours = [c for c in docker_client.containers.list(all=True) if c.name == deployment.name]
    assert len(ours) == 1 and ours[0].status == "running"
    for code, out, err in results:
        assert "Traceback" not in err and "internal error" not in err
        if code == 0:
            assert last_json(out)["action"] in ("created", "adopted", "unchanged")


def test_status_survives_odd_containers_carrying_our_label(images, docker_client):
    """Labels and container state are untrusted input: a container with our owner label that
    publishes an ephemeral port, or carries nonsense labels, must not break `status`."""
    name = f"m31ctl-odd-{uuid.uuid4().hex[:6]}"
    container = docker_client.containers.run(
        images["ready"],
        name=name,
        detach=True,
        labels={"io.m31ctl.owner": "m31ctl", "io.m31ctl.plan-hash": "", "io.m31ctl.version": "\x00?"},
        ports={"8000/tcp": None},  # an ephemeral host port
        environment={"FAKE_ENGINE_DELAY": "1"},
    )
    try:
        result = run_cli("status", "--runtime", "docker", "--json")
        assert result.returncode == 0, result.stderr
        assert name in [s["name"] for s in cli_json.data(result.stdout)["containers"]]
    finally:
        container.remove(force=True)


def test_amd_group_add_works_where_the_image_lacks_a_render_group(images, docker_client, tmp_path):
    """`--group-add render` aborts `docker run` when the image's /etc/group lacks the name (seen
    with stand-in images; base images lack it too). Launch adds `video` (in every Debian and
    Ubuntu image) and the host's numeric render GID, as ROCm's container docs do."""
    import io

    from docker.errors import APIError

    from m31ctl.container import container_spec
    from m31ctl.hardware import simulated
    from m31ctl.plan import PlanRequest, resolve

    if os.geteuid() != 0:
        pytest.skip("creating the host's render group needs root")
    created = subprocess.run(["getent", "group", "render"], capture_output=True).returncode != 0
    if created:
        subprocess.run(["groupadd", "--system", "render"], check=True)
    try:
        tag = "m31ctl-test/engine:no-render-group"
        dockerfile = f'FROM {images["ready"]}\nRUN ["/bin/sh", "-c", "printf \'root:x:0:\\\\nvideo:x:44:\\\\n\' > /etc/group"]\n'
        docker_client.images.build(fileobj=io.BytesIO(dockerfile.encode()), tag=tag, rm=True)
        with pytest.raises(APIError, match="render"):
            docker_client.containers.run(tag, entrypoint=["/bin/true"], group_add=["render"], remove=True)
        for refused in docker_client.containers.list(all=True, filters={"ancestor": tag}):
            refused.remove(force=True)  # run(remove=True) leaves a container whose start failed
        from m31ctl.deployment import derive

        spec = container_spec(derive(resolve(PlanRequest(hardware=simulated("mi355xx8")))))
        render_gid = subprocess.run(
            ["getent", "group", "render"], capture_output=True, text=True
        ).stdout.split(":")[2]
        assert spec.group_add == ("video", render_gid)
        out = docker_client.containers.run(
            tag, entrypoint=["/bin/id", "-G"], group_add=list(spec.group_add), remove=True
        )
        assert {"44", render_gid} <= set(out.decode().split())
    finally:
        if created:
            subprocess.run(["groupdel", "render"], check=False)


def test_watchdog_stops_a_silent_engine_with_a_triage_bundle(deployment, images, tmp_path):
    """No log progress for the phase's budget (runtime.load_and_compile_s here): stop waiting long
    before the overall timeout, classify, leave a triage bundle, exit 5."""
    state = tmp_path / "state"
    result = run_cli(
        *deployment.args("--timeout", "120", "--set", "runtime.load_and_compile_s=4", image=images["hang"]),
        env={"M31CTL_STATE_DIR": str(state)},
    )
    assert result.returncode == 5, result.stderr
    # The watchdog's words, not the 120 s timeout's ("not ready after 120 s"): it stopped first.
    assert "made no progress for" in result.stderr and "while loading weights" in result.stderr
    assert "not ready after 120 s" not in result.stderr
    bundles = list((state / "triage").glob(f"{deployment.name}-*.json"))
    assert len(bundles) == 1 and str(bundles[0]) in result.stderr
    bundle = json.loads(bundles[0].read_text())
    assert bundle["phase"] == "loading weights" and bundle["timeline"][0]["phase"]
    assert any("Loading weights" in line for line in bundle["log_tail"])
    assert bundle["plan"]["hash"] and "checks" in bundle["doctor"]


@pytest.mark.skipif(not shutil.which("script"), reason="util-linux script emulates the terminal")
def test_launch_on_a_terminal_shows_the_phases_live(deployment, tmp_path):
    import shlex

    transcript = tmp_path / "tty.out"
    command = shlex.join([sys.executable, "-m", "m31ctl", *deployment.args("--no-validate")])
    done = subprocess.run(["script", "-q", "-c", command, str(transcript)], capture_output=True, timeout=120)
    assert done.returncode == 0, transcript.read_text(errors="replace")[-2000:]
    screen = transcript.read_text(errors="replace")
    assert "\x1b[" in screen  # a live (rich) display, not plain lines
    assert "compiling (" in screen and "ready (" in screen and "ready in" in screen


def test_throwaway_containers_are_removed_whatever_happens(images, docker_client, monkeypatch):
    """Every container m31ctl creates for a check (doctor's ulimit trial, the deep probes, schema
    extraction) is removed whatever happens after it is created: a start the engine refuses (the
    old code left each one behind, 'Created'), a failed run, Ctrl-C during the wait. Counted by
    images of this test's own, so other tests' containers do not count."""
    import io

    from docker.models.containers import Container

    from m31ctl.container import container_spec
    from m31ctl.deployment import derive
    from m31ctl.hardware import simulated
    from m31ctl.plan import PlanRequest, resolve
    from m31ctl.runtime.docker_create import run_in_engine, trial_run
    from m31ctl.runtime.images import engine_schema

    mark = uuid.uuid4().hex[:8]
    built = {}
    for kind, base in (("empty", "scratch"), ("shell", images["ready"])):
        tag = f"m31ctl-test/throwaway-{kind}:{mark}"
        dockerfile = f"FROM {base}\nLABEL m31ctl.test.throwaway={mark}\n".encode()
        docker_client.images.build(fileobj=io.BytesIO(dockerfile), tag=tag, rm=True)
        built[kind] = tag

    def left() -> list[str]:
        return [
            c.name
            for tag in built.values()
            for c in docker_client.containers.list(all=True, filters={"ancestor": tag})
        ]

    def spec_of(image: str):  # type: ignore[no-untyped-def]
        plan = resolve(PlanRequest(simulated("cpu"), sets=(f"engine.image={image}",)))
        return container_spec(derive(plan))

    try:
        # Nothing to execute in an empty image: the engine refuses every start.
        assert trial_run(docker_client, spec_of(built["empty"])) is not None
        with pytest.raises(Exception, match=r"no such file|not found"):
            run_in_engine(docker_client, spec_of(built["empty"]), ["/bin/nothing"], {}, 10)
        with pytest.raises(Exception, match=r"no such file|not found"):
            engine_schema(docker_client, docker_client.images.get(built["empty"]))
        assert left() == []

        def interrupted(self, **kwargs):  # type: ignore[no-untyped-def]
            raise KeyboardInterrupt

        monkeypatch.setattr(Container, "wait", interrupted)
        with pytest.raises(KeyboardInterrupt):
            run_in_engine(docker_client, spec_of(built["shell"]), ["/bin/sleep", "30"], {}, 60)
        assert left() == []
    finally:
        for name in left():
            docker_client.containers.get(name).remove(force=True)
        for tag in built.values():
            docker_client.images.remove(tag, force=True)
