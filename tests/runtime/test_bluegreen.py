"""Blue-green's pure decisions (m31ctl/runtime/bluegreen.py) on probed-host fakes: the real
2xH200 capture (tests/fixtures/gpu/device-h200x2/nvml-capture.json) read through the real probe,
its GPUs' free memory set to what a live vLLM leaves where a test says one runs. And deploy's
switch without a free GPU, on that host, with the runtime's acts recorded instead of done."""

from __future__ import annotations

import copy
import json

import pytest

from m31ctl import deploy
from m31ctl.deployment import derive
from m31ctl.errors import ConflictError, ExitCode, HostPreconditionError
from m31ctl.hardware import Hardware, simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.probe import detect
from m31ctl.probe.nvidia import NvmlProbe
from m31ctl.runtime import bluegreen
from m31ctl.runtime.bluegreen import GateVerdict, Live
from m31ctl.runtime.planrecord import record_of
from m31ctl.runtime.protocol import LaunchOptions, LaunchResult
from tests.fakes import GPU_FIXTURES, FakeNvml

CAPTURE = GPU_FIXTURES / "device-h200x2" / "nvml-capture.json"
UUIDS = ("GPU-38ca269f-b935-2584-ff0c-0cfce88613e2", "GPU-c4639c8d-ad3a-2f07-84ea-bf83d611a8cf")


def probed(held_by_vllm: tuple[int, ...] = (), utilization: float = 0.9) -> Hardware:
    """The 2xH200 host as the probe reads it, with `held_by_vllm`'s GPUs holding what a vLLM at
    `utilization` takes (its free memory then below the next one's bar)."""
    capture = copy.deepcopy(json.loads(CAPTURE.read_text()))
    for index in held_by_vllm:
        gpu = capture["gpus"][index]
        gpu["mem_free"] = int(gpu["mem_total"] * (1 - utilization))
    return detect([NvmlProbe(FakeNvml(capture))], env={}).hardware


def test_the_capture_is_read_as_two_free_h200s():
    hw = probed()
    assert [(g.index, g.uuid) for g in hw.gpus] == list(enumerate(UUIDS))
    placement = bluegreen.place_gpus(hw, held=(), need=2, utilization=0.9)
    assert placement.fits and placement.chosen == (0, 1) and placement.busy == ()


def test_a_tp1_server_on_gpu0_leaves_gpu1_for_the_new_one():
    hw = probed(held_by_vllm=(0,))
    held = bluegreen.held_gpus(hw, (UUIDS[0],), count=1)  # a container's device request, by UUID
    assert held == (0,)
    placement = bluegreen.place_gpus(hw, held, need=1, utilization=0.9)
    assert placement.chosen == (1,) and bluegreen.cutover(placement) == bluegreen.Cutover(True, (1,))
    assert bluegreen.selection_of(hw, (1,)).uuids == (UUIDS[1],)


def test_an_unpinned_server_holds_the_first_gpus_by_count():
    """A native server started without a pin, or a request by count, takes the host's first
    GPUs: those are held, whatever their free memory says at this moment."""
    hw = probed()
    assert bluegreen.held_gpus(hw, (), count=1) == (0,)
    assert bluegreen.held_gpus(hw, ("1",), count=1) == (1,)  # a native record's pin, by index


def test_a_gpu_another_process_fills_is_busy_not_free():
    hw = probed(held_by_vllm=(1,))  # GPU 1 full, and not ours
    placement = bluegreen.place_gpus(hw, held=(0,), need=1, utilization=0.9)
    assert placement.busy == (1,) and placement.free == () and not placement.fits
    with pytest.raises(HostPreconditionError) as refused:  # stopping ours frees 1 GPU: enough
        bluegreen.cutover(bluegreen.place_gpus(hw, held=(0,), need=2, utilization=0.9))
    assert refused.value.exit_code == ExitCode.HOST_PRECONDITION
    assert "1 busy (GPU 1)" in refused.value.message and "frees only 1" in refused.value.message
    assert bluegreen.cutover(placement) == bluegreen.Cutover(False, (0,))


def test_a_plan_as_wide_as_the_host_needs_the_live_servers_gpus():
    hw = probed(held_by_vllm=(0,))
    placement = bluegreen.place_gpus(hw, held=(0,), need=2, utilization=0.9)
    assert not placement.fits
    assert placement.why_not() == (
        "the plan needs 2 GPUs free beside the live server; 1 free (1 held by the live server)"
    )
    assert bluegreen.cutover(placement) == bluegreen.Cutover(False, (0, 1))


def test_a_simulated_host_is_counted():
    hw = simulated("h200x8")
    placement = bluegreen.place_gpus(hw, bluegreen.held_gpus(hw, (), count=4), need=4, utilization=0.9)
    assert placement.chosen == (4, 5, 6, 7)
    assert bluegreen.place_gpus(simulated("cpu"), (), need=0, utilization=0.9).fits


def test_the_port_is_the_plans_unless_taken():
    free = {8000, 8002}.__contains__
    assert bluegreen.choose_port(8000, set(), free) == 8000
    assert bluegreen.choose_port(8001, {8000}, free) == 8002
    with pytest.raises(ConflictError) as refused:
        bluegreen.choose_port(8001, set(), lambda port: False)
    assert "no free port in 8001..8100" in refused.value.message


def test_slots_and_the_live_one():
    assert bluegreen.slots("m31") == ("m31", "m31-green")
    assert bluegreen.other_slot("m31", "m31") == "m31-green"
    assert bluegreen.other_slot("m31", "m31-green") == "m31"
    blue = Live("m31", "native", "http://127.0.0.1:8000", "a", None, ())
    green = blue._replace(name="m31-green")
    assert bluegreen.live_slot("m31", {"m31": blue, "other": green}) == blue
    assert bluegreen.live_slot("m31", {}) is None
    with pytest.raises(ConflictError) as both:
        bluegreen.live_slot("m31", {"m31": blue, "m31-green": green})
    assert "both m31 and m31-green run" in both.value.message


def test_one_plan_in_either_slot_is_the_same_plan():
    asked = derive(resolve(PlanRequest(simulated("cpu"), sets=("runtime.container_name=m31",))))
    placed = derive(
        resolve(PlanRequest(simulated("cpu"), sets=("runtime.container_name=m31-green", "runtime.port=8001")))
    )
    changed = derive(resolve(PlanRequest(simulated("cpu"), sets=("serving.max_model_len=1024",))))
    live = Live("m31-green", "native", "http://127.0.0.1:8001", placed.plan.hash, record_of(placed, "/"), ())
    assert placed.plan.hash != asked.plan.hash
    assert bluegreen.serves(live, record_of(asked, "/"))
    assert not bluegreen.serves(live, record_of(changed, "/"))
    assert not bluegreen.serves(live._replace(record=None), record_of(asked, "/"))


# deploy.blue_green where the GPUs are not free beside the live server: said, asked, refused
# unattended, and with --accept-downtime the live server stopped before the new one starts.


class Acts:
    """The runtime's acts as deploy asks for them, in order, instead of done."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, live: Live) -> None:
        self.done: list[tuple[str, str]] = []
        self.launched: list[deploy.Deployment] = []
        monkeypatch.setattr(deploy, "_live", lambda runtime, base: live)
        monkeypatch.setattr(deploy, "launch", self.launch)
        monkeypatch.setattr(deploy, "get_runtime", lambda name: self)
        monkeypatch.setattr(deploy.previous, "remember", lambda kept: self.done.append(("kept", kept.server)))

    def launch(self, d, runtime, options, deep, fetch):  # type: ignore[no-untyped-def]
        self.done.append(("launched", d.name))
        self.launched.append(d)
        return LaunchResult("created", d.name, runtime, d.network.local_url, d.plan.hash, True)

    def stop(self, name, timeout, keep, report):  # type: ignore[no-untyped-def]
        self.done.append(("stopped", name))

    def servers(self):  # type: ignore[no-untyped-def]
        return []


def _host_wide(hw: Hardware, *sets: str):  # type: ignore[no-untyped-def]
    return derive(
        resolve(PlanRequest(hw, sets=("parallelism.tensor=2", "runtime.container_name=m31", *sets)))
    )


def _switch(accept: bool) -> deploy.Switch:
    return deploy.Switch(
        lambda d, runtime: GateVerdict(True, ("plan", "chat"), ()),
        accept,
        "m31ctl launch --rollback --name m31",
    )


def _options(lines: list[str], answer: bool = False) -> LaunchOptions:
    return LaunchOptions(report=lines.append, confirm=lambda question: lines.append(question) or answer)


def test_without_free_gpus_the_downtime_is_said_and_refused_unattended(monkeypatch):
    hw = probed(held_by_vllm=(0, 1))
    old = _host_wide(hw)
    live = Live(
        "m31", "native", "http://127.0.0.1:8000", old.plan.hash, record_of(old, "/"), (UUIDS[0], UUIDS[1])
    )
    acts = Acts(monkeypatch, live)
    asked = _host_wide(hw, "serving.max_model_len=8192")
    lines: list[str] = []
    with pytest.raises(ConflictError) as refused:
        deploy.blue_green(asked, "native", _options(lines), _switch(accept=False))
    ready = asked.timeline.ready_s
    assert refused.value.exit_code == ExitCode.CONFLICT and acts.done == []
    assert f"about {ready} s without service" in refused.value.message
    assert "0 free (2 held by the live server)" in refused.value.message
    assert "--accept-downtime" in (refused.value.hint or "")
    assert lines == [
        f"the plan needs 2 GPUs free beside the live server; 0 free (2 held by the live server): replacing m31 "
        f"means about {ready} s without service (the new server's start, plan --explain 'ready'). "
        "Stop it and start the new plan?"
    ]

    result = deploy.blue_green(asked, "native", _options([]), _switch(accept=True))
    assert acts.done == [("kept", "m31"), ("stopped", "m31"), ("launched", "m31")]
    [new] = acts.launched
    assert new.network.port == 8000 and new.gpus.uuids == UUIDS  # its slot: the endpoint stays
    assert result.rollout is not None and result.rollout.downtime_s == ready
    assert result.rollout.rollback == "m31ctl launch --rollback --name m31 --accept-downtime"
    assert result.rollout.to_json()["previous"] == {
        "server": "m31",
        "endpoint": "http://127.0.0.1:8000",
        "plan_hash": old.plan.hash,
    }


def test_a_terminal_answer_yes_accepts_the_downtime(monkeypatch):
    hw = probed(held_by_vllm=(0, 1))
    old = _host_wide(hw)
    live = Live("m31", "native", "http://127.0.0.1:8000", old.plan.hash, record_of(old, "/"), ())
    acts = Acts(monkeypatch, live)
    asked = _host_wide(hw, "serving.max_model_len=8192")
    deploy.blue_green(asked, "native", _options([], answer=True), _switch(accept=False))
    assert acts.done == [("kept", "m31"), ("stopped", "m31"), ("launched", "m31")]


def test_free_gpus_start_the_new_server_beside_on_them(monkeypatch):
    hw = probed(held_by_vllm=(0,))
    old = derive(resolve(PlanRequest(hw, sets=("parallelism.tensor=1", "runtime.container_name=m31"))))
    live = Live("m31", "native", "http://127.0.0.1:8000", old.plan.hash, record_of(old, "/"), ("0",))
    acts = Acts(monkeypatch, live)
    monkeypatch.setattr(deploy, "port_free", lambda bind, port: port != 8000)
    asked = derive(
        resolve(
            PlanRequest(
                hw, sets=("parallelism.tensor=1", "runtime.container_name=m31", "serving.max_model_len=8192")
            )
        )
    )
    result = deploy.blue_green(asked, "native", _options([]), _switch(accept=False))
    assert acts.done == [("launched", "m31-green"), ("kept", "m31"), ("stopped", "m31")]
    [new] = acts.launched
    assert (new.network.port, new.gpus.indices, new.gpus.uuids) == (8001, (1,), (UUIDS[1],))
    assert new.plan.settings.runtime.container_name == "m31-green"
    assert result.endpoint == "http://127.0.0.1:8001" and result.rollout is not None
    assert result.rollout.downtime_s is None and result.rollout.gate == ("plan", "chat")


# How the chosen GPUs reach the new server, and what a runtime reads back of the live one's.


def _on_gpus(hw: Hardware, indices: tuple[int, ...], *sets: str):  # type: ignore[no-untyped-def]
    d = derive(resolve(PlanRequest(hw, sets=("parallelism.tensor=1", *sets))))
    return d._replace(gpus=bluegreen.selection_of(hw, indices))


def test_the_native_runtime_pins_the_chosen_gpus_in_pci_bus_order():
    from m31ctl.runtime.native import pinned_gpus

    hw = probed(held_by_vllm=(0,))
    assert pinned_gpus(_on_gpus(hw, (1,))) == {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert pinned_gpus(_on_gpus(hw, (1,), "runtime.env.CUDA_VISIBLE_DEVICES=0")) == {}  # the user's own
    assert pinned_gpus(derive(resolve(PlanRequest(hw, sets=("parallelism.tensor=1",))))) == {}  # unpinned
    assert pinned_gpus(derive(resolve(PlanRequest(simulated("cpu"))))) == {}


def test_the_docker_runtime_requests_the_chosen_gpus_and_reads_them_back():
    from types import SimpleNamespace

    from m31ctl.runtime.docker_launch import single
    from m31ctl.runtime.docker_servers import device_ids

    assert single(_on_gpus(probed(), (1,))).spec.gpu_device_ids == (UUIDS[1],)
    by_index = derive(resolve(PlanRequest(simulated("h200x8"), sets=("parallelism.tensor=4",))))
    placed = by_index._replace(gpus=bluegreen.selection_of(by_index.plan.hardware, (4, 5, 6, 7)))
    assert single(placed).spec.gpu_device_ids == ("4", "5", "6", "7")
    requested = {"HostConfig": {"DeviceRequests": [{"DeviceIDs": [UUIDS[1]], "Capabilities": [["gpu"]]}]}}
    assert device_ids(SimpleNamespace(attrs=requested)) == (UUIDS[1],)
    by_count = {"HostConfig": {"DeviceRequests": [{"Count": 1, "DeviceIDs": None}]}}
    assert device_ids(SimpleNamespace(attrs=by_count)) == ()
    assert device_ids(SimpleNamespace(attrs={"HostConfig": {"DeviceRequests": "odd"}})) == ()


def test_the_replaced_plan_is_kept_and_read_back(tmp_path, monkeypatch):
    from m31ctl.runtime import previous

    monkeypatch.setenv("M31CTL_STATE_DIR", str(tmp_path))
    d = derive(resolve(PlanRequest(simulated("cpu"), sets=("runtime.container_name=m31",))))
    previous.remember(previous.Previous("m31", "m31-green", "native", record_of(d, "/"), 1.0))
    kept = previous.recall("m31")
    assert kept is not None and kept.server == "m31-green" and kept.record.plan_hash == d.plan.hash
    assert previous.kept() == ["m31"]
    (tmp_path / "rollouts" / "m31.json").write_text("{not json")
    assert previous.recall("m31") is None and previous.kept() == []
