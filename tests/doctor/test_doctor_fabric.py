"""Doctor's KV-transfer fabric check (m31ctl/doctor/checks/fabric.py): a P/D plan's UCX devices and
transports against a host, a fake sysfs tree built in tmp_path for the cases this host lacks
(RDMA ports up and down, verbs device nodes), and this host itself (it has `lo`, no RDMA)."""

from __future__ import annotations

from pathlib import Path

import pytest

from m31ctl.checks import CheckStatus
from m31ctl.deployment import Deployment, derive
from m31ctl.doctor.base import CheckContext, run_checks
from m31ctl.doctor.checks import all_checks, get_check
from m31ctl.doctor.checks.fabric import HostFabric, moves_kv_over_ucx
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.probe import NO_GPU, ProbeReport
from m31ctl.probe.snapshot import CommandResult, ProbeUnavailable
from m31ctl.runtime.gates import CheckId
from tests.support import cli_json


def fake_host(
    root: Path,
    net: tuple[str, ...] = ("lo", "eth0"),
    ports: dict[str, str] | None = None,
    uverbs: bool = True,
) -> Path:
    """A host's /sys/class/net, /sys/class/infiniband/DEV/ports/N/state and /dev/infiniband under
    `root`, as the kernel lays them out. `ports`: {"mlx5_0:1": "4: ACTIVE", ...}."""
    for name in net:
        (root / "sys/class/net" / name).mkdir(parents=True)
    for port, state in (ports or {}).items():
        device, number = port.split(":")
        folder = root / "sys/class/infiniband" / device / "ports" / number
        folder.mkdir(parents=True)
        (folder / "state").write_text(state + "\n")
    if ports and uverbs:
        (root / "dev/infiniband").mkdir(parents=True)
        (root / "dev/infiniband/uverbs0").write_text("")
        (root / "dev/infiniband/rdma_cm").write_text("")
    return root


RDMA_UP = {"mlx5_0:1": "4: ACTIVE", "mlx5_1:1": "1: DOWN"}


def pd_plan(*sets: str, hardware: str = "cpu") -> Deployment:
    if hardware == "cpu":
        request = PlanRequest(hardware=simulated("cpu"), variant="pd", sets=sets)
    else:
        request = PlanRequest(hardware=simulated(hardware), sets=("disaggregation.enabled=true", *sets))
    return derive(resolve(request))


def no_ucx_info(argv):  # type: ignore[no-untyped-def]
    raise ProbeUnavailable(f"{argv[0]} not found on PATH")


def fabric(deployment: Deployment, root: Path | None, run=no_ucx_info):  # type: ignore[no-untyped-def]
    """The fabric check as doctor runs it (the registry's Check, the runner), against `root`."""
    ctx = CheckContext(
        deployment=deployment,
        plan_error=None,
        probe=ProbeReport(NO_GPU, ()),
        env={},
        run=run,
        host_root=root if root is not None else Path("/"),
    )
    (result,) = run_checks([get_check(CheckId.FABRIC)], ctx)
    return result


def test_the_host_is_read_as_the_kernel_lays_it_out(tmp_path):
    host = HostFabric(fake_host(tmp_path, ports=RDMA_UP))
    assert host.net_devices() == ("eth0", "lo")
    assert host.rdma_devices() == ("mlx5_0", "mlx5_1")
    assert host.port_state("mlx5_1", "1") == "1: DOWN" and host.port_state("mlx5_0", "2") is None
    assert host.active_ports() == ("mlx5_0:1",)
    assert host.uverbs() == ("/dev/infiniband/uverbs0",)
    empty = HostFabric(tmp_path / "nothing")
    assert (empty.net_devices(), empty.active_ports(), empty.uverbs()) == ((), (), ())


def test_the_cpu_rehearsal_on_loopback_passes_with_both_roles_said_once(tmp_path):
    result = fabric(pd_plan("disaggregation.ucx_net_devices=lo"), fake_host(tmp_path))
    assert result.status == CheckStatus.OK, result
    assert result.message == (
        "prefill and decode: UCX_TLS=tcp,self,sm (disaggregation.ucx_transports, the cpu default "
        "(m31ctl/plan/disaggregation.py UCX_TRANSPORTS)); UCX_NET_DEVICES=lo "
        "(disaggregation.ucx_net_devices, --set #1) on this host"
    )
    unset = fabric(pd_plan(), fake_host(tmp_path / "b"))
    assert unset.status == CheckStatus.OK and "UCX_NET_DEVICES=(unset): UCX picks" in unset.message


def test_an_rdma_port_that_is_up_passes_and_one_that_is_down_fails(tmp_path):
    root = fake_host(tmp_path, ports=RDMA_UP)
    up = fabric(
        pd_plan("disaggregation.ucx_transports=rc,tcp", "disaggregation.ucx_net_devices=mlx5_0:1,lo"), root
    )
    assert up.status == CheckStatus.OK and up.message.endswith("on this host, RDMA over mlx5_0:1"), up
    down = fabric(pd_plan("disaggregation.ucx_net_devices=mlx5_1:1"), root)
    assert down.status == CheckStatus.FAIL
    assert "UCX_NET_DEVICES=mlx5_1:1 (disaggregation.ucx_net_devices, --set #1): mlx5_1:1 is '1: DOWN'" in (
        down.message
    )
    assert "ibstat mlx5_1" in down.remedy


def test_a_device_this_host_lacks_fails_saying_what_it_has(tmp_path):
    root = fake_host(tmp_path, ports=RDMA_UP)
    missing = fabric(pd_plan("disaggregation.ucx_net_devices=eth9"), root)
    assert missing.status == CheckStatus.FAIL
    assert "no network interface eth9 on this host (/sys/class/net: eth0, lo)" in missing.message
    assert missing.remedy == (
        "name devices this host has (`ucx_info -d` lists them): --set disaggregation.ucx_net_devices=..."
    )
    no_port = fabric(pd_plan("disaggregation.ucx_net_devices=mlx5_0:2"), root)
    assert "mlx5_0 has no port 2 (its ports: 1)" in no_port.message
    bare = fabric(pd_plan("disaggregation.ucx_net_devices=mlx5_0"), root)
    assert "mlx5_0 is an RDMA device, which UCX names with its port" in bare.message
    assert bare.remedy == "--set disaggregation.ucx_net_devices=mlx5_0:1"


def test_rdma_transports_need_an_active_port_and_the_verbs_devices(tmp_path):
    rc = "disaggregation.ucx_transports=rc_x,ud:aux,tcp"
    none = fabric(pd_plan(rc), fake_host(tmp_path / "none"))
    assert none.status == CheckStatus.FAIL
    assert "RDMA transports rc_x, ud need an ACTIVE RDMA port, and this host has none" in none.message
    assert "need /dev/infiniband/uverbs*, absent here" in none.message
    no_verbs = fabric(pd_plan(rc), fake_host(tmp_path / "noverbs", ports=RDMA_UP, uverbs=False))
    assert no_verbs.status == CheckStatus.FAIL and "ACTIVE RDMA port" not in no_verbs.message
    assert "modprobe ib_uverbs" in no_verbs.remedy and "--device /dev/infiniband" in no_verbs.remedy
    # UCX may use only the devices UCX_NET_DEVICES names: none of them an RDMA port here.
    tcp_only = fabric(
        pd_plan(rc, "disaggregation.ucx_net_devices=eth0"), fake_host(tmp_path / "up", ports=RDMA_UP)
    )
    assert "and UCX_NET_DEVICES names none (ACTIVE: mlx5_0:1)" in tcp_only.message
    # A deny list names no transport the host must have.
    deny = fabric(pd_plan("disaggregation.ucx_transports=^rc,ud"), fake_host(tmp_path / "deny"))
    assert deny.status == CheckStatus.OK, deny


def test_gpu_transports_must_match_the_plans_gpus(tmp_path):
    root = fake_host(tmp_path)
    cuda_on_cpu = fabric(pd_plan("disaggregation.ucx_transports=cuda_ipc,tcp"), root)
    assert cuda_on_cpu.status == CheckStatus.FAIL
    assert "cuda_ipc moves NVIDIA GPU memory, but the plan runs on cpu" in cuda_on_cpu.message
    assert cuda_on_cpu.remedy == "--set disaggregation.ucx_transports=tcp,self,sm (the cpu default)"
    # A B300 pair: its default (cuda_copy, cuda_ipc, tcp) passes; ROCm's copies do not.
    assert fabric(pd_plan(hardware="b300x8"), root).status == CheckStatus.OK
    rocm = fabric(pd_plan("disaggregation.ucx_transports=rocm_copy,tcp", hardware="b300x8"), root)
    assert "rocm_copy moves AMD GPU memory, but the plan runs on cuda" in rocm.message
    assert rocm.remedy == "--set disaggregation.ucx_transports=cuda_copy,cuda_ipc,tcp (the cuda default)"


def test_roles_that_differ_are_said_apart_with_the_setting_that_moves_each(tmp_path):
    deployment = pd_plan("disaggregation.decode.env.UCX_NET_DEVICES=eth7")
    result = fabric(deployment, fake_host(tmp_path))
    assert result.status == CheckStatus.FAIL
    prefill, decode = result.message.split("; decode: ")
    assert prefill.startswith("prefill: ") and "UCX_NET_DEVICES=(unset)" in prefill
    assert decode.startswith("UCX_NET_DEVICES=eth7 (disaggregation.decode.env.UCX_NET_DEVICES, --set #1): ")
    assert result.remedy.endswith("--set disaggregation.decode.env.UCX_NET_DEVICES=...")
    # The setting wins over a role's env (the adapter writes it last): both roles get lo, said once.
    both = pd_plan("disaggregation.ucx_net_devices=lo", "disaggregation.decode.env.UCX_NET_DEVICES=eth7")
    result = fabric(both, fake_host(tmp_path / "b"))
    assert result.status == CheckStatus.OK and result.message.startswith("prefill and decode: "), result


def test_ucx_info_adds_the_version_where_the_host_has_it(tmp_path):
    def ucx_info(argv):  # type: ignore[no-untyped-def]
        assert list(argv) == ["ucx_info", "-v"]
        return CommandResult(0, "# Library version: 1.18.0\n# Library path: /usr/lib/libucs.so.0\n", "")

    root = fake_host(tmp_path)
    result = fabric(pd_plan("disaggregation.ucx_net_devices=lo"), root, ucx_info)
    assert result.status == CheckStatus.OK and result.message.endswith(
        "; this host's ucx_info reports UCX 1.18.0"
    )
    broken = fabric(pd_plan(), root, lambda argv: CommandResult(1, "", "libucs.so.0: cannot open"))
    assert broken.status == CheckStatus.OK and "ucx_info" not in broken.message


def test_the_check_runs_only_where_kv_moves_over_ucx():
    aggregated = derive(resolve(PlanRequest(hardware=simulated("cpu"))))
    # Mooncake moves KV with its own transfer engine, not UCX (MoRIIO, RDMA without UCX too, is
    # refused at plan time: vllm-router pairs it only in discovery mode, issue 49).
    mooncake = pd_plan("disaggregation.connector=mooncake", hardware="mi355xx8")
    for deployment in (None, aggregated, mooncake):
        assert not moves_kv_over_ucx(deployment)
        assert CheckId.FABRIC not in [c.id for c in all_checks(deployment)]
    assert CheckId.FABRIC in [c.id for c in all_checks(pd_plan())]


def test_this_host_passes_on_loopback_and_fails_an_rdma_device_it_lacks():
    """The real /sys of this machine (lo, no RDMA), through `m31ctl doctor --json`."""
    from tests.conftest import run_cli

    if Path("/sys/class/infiniband/mlx5_0").exists():
        pytest.skip("this host has mlx5_0")
    base = ("doctor", "--hardware", "cpu", "--variant", "pd", "--runtime", "native", "--json")
    lo = run_cli(*base, "--set", "disaggregation.ucx_net_devices=lo")
    checks = {c["id"]: c for c in cli_json.data(lo.stdout)["checks"]}
    assert checks["fabric"]["status"] == "ok", checks["fabric"]
    assert checks["fabric"]["title"] == "Fabric: KV transfer (UCX), RDMA"
    assert (
        "UCX_NET_DEVICES=lo (disaggregation.ucx_net_devices, --set #1) on this host"
        in checks["fabric"]["message"]
    )
    rdma = run_cli(*base, "--set", "disaggregation.ucx_net_devices=mlx5_0:1")
    data = cli_json.data(rdma.stdout)
    check = next(c for c in data["checks"] if c["id"] == "fabric")
    assert rdma.returncode == 1 and not data["ok"]
    assert check["status"] == "fail" and check["message"] == (
        "prefill and decode: UCX_NET_DEVICES=mlx5_0:1 (disaggregation.ucx_net_devices, --set #1): "
        "no RDMA device mlx5_0 on this host (/sys/class/infiniband: none)"
    )
    assert check["remedy"].endswith("--set disaggregation.ucx_net_devices=...")
    aggregated = cli_json.data(run_cli("doctor", "--hardware", "cpu", "--runtime", "native", "--json").stdout)
    assert "fabric" not in [c["id"] for c in aggregated["checks"]]


# --- fabric.rdma (issue 49) --------------------------------------------------------------------

PRIVILEGED = "kubernetes.pod_security=privileged"
PORTS = 'fabric.rdma.devices=["mlx5_0:1","mlx5_1:1"]'


def dep8_over_nodes(*sets: str) -> Deployment:
    request = PlanRequest(
        hardware=simulated("b300x4"), sets=("parallelism.nodes=2", "parallelism.data=2", PRIVILEGED, *sets)
    )
    return derive(resolve(request))


def test_a_pair_over_rdma_needs_each_port_it_names_active(tmp_path):
    pair = pd_plan(PORTS, PRIVILEGED, hardware="b300x8")
    up = fabric(pair, fake_host(tmp_path / "up", ports={"mlx5_0:1": "4: ACTIVE", "mlx5_1:1": "4: ACTIVE"}))
    assert up.status == CheckStatus.OK, up.message
    assert up.message.startswith("prefill and decode: UCX_TLS=rc,cuda_copy,cuda_ipc (fabric.rdma, --set #2)")
    assert "UCX_NET_DEVICES=mlx5_0:1,mlx5_1:1 (fabric.rdma.devices, --set #2) on this host" in up.message
    down = fabric(pair, fake_host(tmp_path / "down", ports=RDMA_UP))
    assert down.status == CheckStatus.FAIL and "mlx5_1:1 is '1: DOWN', not ACTIVE" in down.message
    assert down.message.count("DOWN") == 1  # judged once, with the role's UCX devices


def test_an_engine_over_nodes_needs_its_hcas_active_and_the_verbs_devices(tmp_path):
    deployment = dep8_over_nodes(PORTS)
    assert CheckId.FABRIC in [c.id for c in all_checks(deployment)]  # no KV moves, NCCL does
    both = {"mlx5_0:1": "4: ACTIVE", "mlx5_1:1": "4: ACTIVE"}
    ok = fabric(deployment, fake_host(tmp_path / "ok", ports=both))
    assert ok.status == CheckStatus.OK
    assert (
        ok.message
        == "the engine over RDMA: fabric.rdma (--set #4): mlx5_0:1, mlx5_1:1 ACTIVE, verbs devices present"
    )
    down = fabric(deployment, fake_host(tmp_path / "down", ports=RDMA_UP))
    assert down.status == CheckStatus.FAIL and "mlx5_1:1 is '1: DOWN', not ACTIVE" in down.message
    bare = fabric(deployment, fake_host(tmp_path / "bare", ports=both, uverbs=False))
    assert bare.status == CheckStatus.FAIL and "/dev/infiniband/uverbs* is absent here" in bare.message
    # No ports named: any ACTIVE one will do, and none is a failure.
    anyport = dep8_over_nodes("fabric.rdma={}")
    assert fabric(anyport, fake_host(tmp_path / "any", ports=RDMA_UP)).status == CheckStatus.OK
    none = fabric(anyport, fake_host(tmp_path / "none"))
    assert none.status == CheckStatus.FAIL and "no ACTIVE RDMA port" in none.message
    # Without fabric.rdma an aggregated plan has no fabric to check.
    assert CheckId.FABRIC not in [c.id for c in all_checks(dep8_over_nodes())]
