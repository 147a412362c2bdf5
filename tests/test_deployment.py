"""The Deployment: facts derived once from the plan, and nodes asked for rather than implied."""

from __future__ import annotations

from pathlib import Path

import pytest

from m31ctl.checkpoint import model_source
from m31ctl.container import container_spec
from m31ctl.deployment import derive, require_fit
from m31ctl.doctor.base import CheckContext
from m31ctl.doctor.checks import checkpoint_state
from m31ctl.engine.adapter import NodeRole, build_invocation
from m31ctl.errors import ExitCode, HostPreconditionError, InputError
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.probe import detect
from m31ctl.probe.nvidia import NvmlProbe
from m31ctl.render import get_target
from tests.conftest import PINNED_COMMIT
from tests.fakes import FakeNvml
from tests.support import cli_json

H200X1 = Path(__file__).parent / "fixtures" / "gpu" / "device-h200x1"


def plan_for(spec: str, *sets: str, profile: str | None = None):  # type: ignore[no-untyped-def]
    return resolve(PlanRequest(hardware=simulated(spec), profile=profile, sets=sets))


def test_the_real_single_h200_probe_does_not_invent_nodes():
    """On the lent 1x H200 the probed plan once became TP1 x PP8 over eight imaginary nodes;
    the Hopper recipe's TP8 stays TP8 on one node and is refused with what the host lacks."""
    hw = detect([NvmlProbe(FakeNvml.from_file(H200X1 / "nvml-capture.json"))], env={}).hardware
    assert (hw.count, hw.simulated) == (1, False)
    plan = resolve(PlanRequest(hardware=hw))
    par = plan.settings.parallelism
    assert (par.nodes, par.tensor, par.pipeline) == (1, 8, 1)
    deployment = derive(plan)
    assert not deployment.layout.fits
    with pytest.raises(HostPreconditionError, match=r"needs 8 GPUs .* this host has 1") as caught:
        require_fit(deployment)
    assert caught.value.exit_code == ExitCode.HOST_PRECONDITION
    assert "parallelism.nodes" in (caught.value.hint or "")


def test_the_plan_command_refuses_a_layout_wider_than_the_host(cli):
    result = cli(
        "plan", "--hardware", "b300x4", "--set", "parallelism.data=8", "--set", "parallelism.tensor=1"
    )
    assert result.returncode == ExitCode.HOST_PRECONDITION
    assert "needs 8 GPUs" in result.stderr and "has 4" in result.stderr


def test_two_nodes_of_data_parallelism_are_asked_for_and_laid_out():
    plan = plan_for("b300x4", "parallelism.nodes=2", "parallelism.data=8", "parallelism.tensor=1")
    layout = derive(plan).layout
    assert (layout.nodes, layout.gpus_per_node, layout.data_local, layout.gpus) == (2, 4, 4, 8)
    assert layout.spans_nodes and not layout.over_ray and layout.fits
    assert [layout.start_rank(i) for i in range(2)] == [0, 4]
    worker = build_invocation(derive(plan), node=NodeRole(False, "leader", "4")).args
    assert worker[worker.index("--data-parallel-size-local") + 1] == "4"
    assert worker[worker.index("--data-parallel-start-rank") + 1] == "4"


def test_tensor_parallelism_wider_than_a_node_becomes_pipeline_stages_only_when_asked():
    split = plan_for("b300x4", "parallelism.nodes=2", "parallelism.tensor=8")
    par = split.settings.parallelism
    assert (par.tensor, par.pipeline) == (4, 2)
    assert derive(split).layout.over_ray
    one_node = plan_for("b300x4", "parallelism.tensor=8")
    assert one_node.settings.parallelism.pipeline == 1
    with pytest.raises(HostPreconditionError):
        require_fit(derive(one_node))


@pytest.mark.parametrize(
    ("sets", "match"),
    [
        (
            ("parallelism.nodes=2", "parallelism.data=3", "parallelism.tensor=1"),
            "multiple of parallelism.nodes",
        ),
        (("parallelism.nodes=3", "parallelism.tensor=8"), r"must\s+equal parallelism.nodes"),
        (("parallelism.nodes=2", "parallelism.tensor=8", "parallelism.data=2"), "parallelism.data=1"),
    ],
)
def test_layouts_that_do_not_divide_over_the_nodes_are_refused(sets, match):
    with pytest.raises(InputError, match=match):
        plan_for("b300x4", *sets)


def test_a_home_relative_model_path_is_one_absolute_path_everywhere(tmp_path, monkeypatch):
    """`model.path=~/tiny`: launch once mounted the expanded path while vLLM's first argument
    stayed the literal `~/tiny`, and doctor called the checkpoint absent."""
    monkeypatch.setenv("HOME", str(tmp_path))
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 4096)
    plan = resolve(PlanRequest(hardware=simulated("cpu"), sets=("model.path=~/tiny",)))
    deployment = derive(plan)
    where = str(model)
    assert deployment.model.reference == where and deployment.model.local
    assert build_invocation(deployment).args[0] == where
    spec = container_spec(deployment)
    assert (where, where) in [(m.source, m.target) for m in spec.mounts]
    assert checkpoint_state(deployment)[0] == "complete"
    for target in ("script", "compose", "systemd", "k8s"):
        (artifact,) = [
            a for a in get_target(target)(deployment) if a.name.endswith((".sh", ".yaml", ".service"))
        ]
        # The header's command to make the file again quotes the option as it was asked.
        acted_on = "\n".join(line for line in artifact.content.splitlines() if "make it again" not in line)
        assert where in acted_on and "~/tiny" not in acted_on, target


def test_model_sources():
    assert model_source("MiniMaxAI/MiniMax-M3.1-Flash", "/h", "/w")[:2] == (
        "MiniMaxAI/MiniMax-M3.1-Flash",
        False,
    )
    assert model_source("~/m", "/home/u", "/w")[:2] == ("/home/u/m", True)
    assert model_source("./m", "/h", "/work/dir")[:2] == ("/work/dir/m", True)
    assert model_source("/data//m/", "/h", "/w")[:2] == ("/data/m", True)
    with pytest.raises(InputError, match="current user's home"):
        model_source("~other/m", "/h", "/w")


def test_the_timeline_and_stop_margin_come_from_one_place():
    deployment = derive(plan_for("b300x4", "runtime.download_mbps=500", "serving.shutdown_timeout=45"))
    timeline = deployment.timeline
    assert timeline.download_s == 4002  # 250.1 GB at 500 Mbit/s
    assert timeline.ready_s == timeline.load_s + 60  # the engine's start, after the download
    assert timeline.start_s == timeline.download_s + timeline.ready_s
    assert container_spec(deployment).stop_timeout == timeline.stop_s == 45 + 30
    assert container_spec(deployment).startup_timeout == timeline.ready_s
    # vLLM's own limit raised to the load budget, in the engine's environment on every target.
    assert build_invocation(deployment).env_dict["VLLM_ENGINE_READY_TIMEOUT_S"] == "1200"
    local = derive(resolve(PlanRequest(hardware=simulated("cpu"), sets=("model.path=/models/tiny",))))
    assert local.timeline.download_s == 0  # nothing to download: no download phase in the budget


def test_doctor_reads_the_deployment_not_the_raw_setting(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    plan = resolve(PlanRequest(hardware=simulated("cpu"), sets=("model.path=~/absent",)))
    ctx = CheckContext(deployment=derive(plan), plan_error=None, probe=detect([], env={}), env={})
    from m31ctl.doctor.checks import disk

    outcome = disk(ctx)
    assert outcome.status == "fail" and str(tmp_path / "absent") in outcome.message


def test_plan_json_says_how_many_nodes(cli):
    result = cli(
        "plan", "--hardware", "b300x4", "--json", "--no-validate",
        "--set", "parallelism.nodes=2", "--set", "parallelism.data=8", "--set", "parallelism.tensor=1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert cli_json.data(result.stdout)["nodes"] == 2


def test_doctor_on_the_replayed_h200_finds_what_the_real_host_reported():
    """doctor on the lent 1x H200 (2026-12-01, the probed Hopper plan): its GPUs check failed
    with the layout the host lacks, the plan hash and the deployment-derived checks as recorded.
    The same NVML answers replayed here through the same code must give the same findings."""
    from m31ctl.doctor import diagnose
    from m31ctl.errors import DockerUnreachable

    recorded = cli_json.captured((H200X1 / "doctor-probed-2026-12-01.json").read_text())
    probe = detect([NvmlProbe(FakeNvml.from_file(H200X1 / "nvml-capture.json"))], env={})

    def no_engine() -> None:
        raise DockerUnreachable("no Docker Engine on the lent host either")

    report = diagnose(None, probe, docker=no_engine)
    # The recorded hash is of the plan as it was that day; the Hopper plan changed since (the MoE
    # layout and max_num_seqs decided explicitly, issue 35; the labelled-client NetworkPolicy default,
    # issue 39; the rollout, autoscaling and CPU-tier settings, issue 50), so the hash it has now is
    # pinned here.
    assert recorded["plan_hash"] == "4d66177755f3"
    assert report.plan is not None and report.plan.hash == "499456cc66e2"
    found = {r.id: r for r in report.results}
    for check in recorded["checks"]:
        if check["id"] == "capacity":  # the KV token count moved with M3.1's own geometry (issue 35)
            assert found["capacity"].status == check["status"]
            assert found["capacity"].message.split(" (")[0] == check["message"].split(" (")[0]
        elif check["id"] in ("gpus", "mig", "api-key"):  # decided by the capture and the plan alone
            assert (found[check["id"]].status, found[check["id"]].message) == (
                check["status"],
                check["message"],
            )


def test_the_cpu_rehearsal_runs_any_number_of_ranks_on_its_one_host():
    """Ranks on the CPU backend are processes: TP2 on `--hardware cpu` (one device) is a layout the
    rehearsal serves (tests/rehearsal/test_rehearsal.py runs it), not a host too small."""
    deployment = derive(resolve(PlanRequest(hardware=simulated("cpu"), sets=("parallelism.tensor=2",))))
    require_fit(deployment)  # no refusal
    assert deployment.layout.gpus_per_node == 2


def test_the_draft_folder_is_one_fact_for_pull_render_and_doctor(tmp_path):
    """Blackwell drafts with DSpark from the checkpoint's dspark/ folder: doctor requires it, the
    rendered download fetches it; Hopper does not draft, so its download leaves the folder out."""
    from m31ctl.render.download import download_step

    model = tmp_path / "ckpt"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 4096)
    blackwell = derive(plan_for("b300x4", f"model.path={model}"))
    assert blackwell.draft == ("dspark/", True) and blackwell.draft.skipped is None
    state, why = checkpoint_state(blackwell)
    assert (state, why) == ("partial", "the dspark/ draft the plan uses is missing")
    (model / "dspark").mkdir()
    assert checkpoint_state(blackwell)[0] == "complete"
    hopper = derive(plan_for("h200x8"), commit=PINNED_COMMIT)
    assert hopper.draft == ("dspark/", False)
    step = download_step(hopper, ())
    assert step is not None and step.command[-1] == "dspark/*"
    step = download_step(derive(plan_for("b300x4"), commit=PINNED_COMMIT), ())
    assert step is not None and step.command[-1] != "dspark/*"


def test_listeners_are_every_port_of_every_part():
    """What doctor's port check probes: the endpoint alone for one server; for a P/D group also
    each role's API port and one NIXL side-channel port per data-parallel rank, and a fixed
    router metrics port."""
    alone = derive(resolve(PlanRequest(simulated("b300x4"), sets=("runtime.port=9000",))))
    assert [(one.setting, one.port) for one in alone.listeners] == [("runtime.port", 9000)]
    sets = (
        "disaggregation.enabled=true", "disaggregation.decode.data=2", "disaggregation.decode.tensor=2",
        "disaggregation.router.metrics_port=29100",
    )  # fmt: skip
    pair = derive(resolve(PlanRequest(simulated("b300x8"), sets=sets)))
    ports = [(one.setting, one.port) for one in pair.listeners]
    decode_side = pair.disaggregated.decode.kv_transfer.side_channel_port  # type: ignore[union-attr]
    assert ports[0] == ("runtime.port", pair.network.port)
    assert ("disaggregation.decode.side_channel_port", decode_side) in ports
    assert ("disaggregation.decode.side_channel_port", decode_side + 1) in ports  # its second DP rank
    assert ("disaggregation.router.metrics_port", 29100) in ports
    assert len({port for _, port in ports}) == len(ports) == 7


def test_a_gpu_pair_routes_through_vllm_routers_own_image_and_the_rehearsal_through_its_engines():
    """vLLM's images carry no vllm-router: a GPU pair's router runs from vllm-router's own image
    (issue 49); the CPU rehearsal's image installs the router, the only image there offline."""
    gpu = derive(plan_for("b300x8", "disaggregation.enabled=true"), commit=PINNED_COMMIT)
    assert gpu.disaggregated is not None and gpu.disaggregated.router.image == "vllm/vllm-router:v0.1.17"
    cpu = derive(resolve(PlanRequest(hardware=simulated("cpu"), variant="pd")), commit=PINNED_COMMIT)
    assert cpu.disaggregated is not None
    assert cpu.disaggregated.router.image == cpu.plan.settings.engine.image


def test_a_pair_wider_than_its_host_numbers_each_roles_gpus_on_its_own_node():
    """b300x8 shares one host: decode takes GPUs 4-7 after prefill's 0-3. On b300x4 the pair needs
    two nodes (Kubernetes places them); each role starts at its node's GPU 0, not at GPUs 4-7 the
    host does not have."""
    shared = derive(plan_for("b300x8", "disaggregation.enabled=true"), commit=PINNED_COMMIT).disaggregated
    assert shared is not None and shared.decode.gpus.indices == (4, 5, 6, 7)
    apart = derive(plan_for("b300x4", "disaggregation.enabled=true"), commit=PINNED_COMMIT).disaggregated
    assert apart is not None and not apart.fits_one_host
    assert apart.prefill.gpus.indices == apart.decode.gpus.indices == (0, 1, 2, 3)


@pytest.mark.parametrize("runtime", ["docker", "native"])
def test_a_pair_wider_than_this_host_is_refused_before_any_check_or_download(runtime):
    """launch of a P/D plan one host cannot hold says so first: no probe, no check, and above all
    no checkpoint download (fetch) that the refusal would have followed."""
    from m31ctl import deploy
    from m31ctl.pair import PairWiderThanHost
    from m31ctl.runtime.protocol import LaunchOptions

    fetched: list[str] = []
    deployment = derive(plan_for("b300x4", "disaggregation.enabled=true"), commit=PINNED_COMMIT)
    options = LaunchOptions(report=lambda _: None, confirm=lambda _: False)
    with pytest.raises(PairWiderThanHost, match="needs 8 GPUs"):
        deploy.launch(deployment, runtime, options, fetch=lambda d: fetched.append(d.name) or True)
    assert fetched == []
