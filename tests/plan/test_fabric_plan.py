"""fabric.rdma as a plan (issue 49, "No RDMA anywhere"): the one setting, what each engine derives
from it once (Deployment.rdma, a role's KV transfer), the refusals at plan time, and the warnings
where a group crosses nodes without it."""

from __future__ import annotations

import pytest

from m31ctl.container import render_spec
from m31ctl.deployment import derive
from m31ctl.engine.adapter import build_invocation
from m31ctl.errors import ExitCode, InputError
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from tests.conftest import run_cli

PD = "disaggregation.enabled=true"
PRIVILEGED = "kubernetes.pod_security=privileged"
PORTS = 'fabric.rdma.devices=["mlx5_0:1","mlx5_1:1"]'
DEP8 = ("parallelism.nodes=2", "parallelism.data=2")  # DEP8 over two 4-GPU nodes


def plan_for(spec: str, *sets: str, **kw):  # type: ignore[no-untyped-def]
    return resolve(PlanRequest(hardware=simulated(spec), sets=sets, **kw))


def test_unset_it_leaves_the_plan_as_it_was():
    plan = plan_for("b300x4")
    assert plan.settings.fabric.rdma is None
    assert "fabric" not in plan.settings_dict()  # the hash and every rendered label unchanged
    assert derive(plan).rdma is None


def test_a_pair_over_rdma_gets_rc_and_the_ports_and_every_container_what_rdma_needs():
    deployment = derive(plan_for("b300x8", PD, PORTS, PRIVILEGED))
    assert "fabric" in deployment.plan.settings_dict()
    group = deployment.disaggregated
    assert group is not None
    for role in group.roles:
        env = build_invocation(role).env_dict
        assert env["UCX_TLS"] == "rc,cuda_copy,cuda_ipc"  # no tcp: a fabric that fails says so
        assert env["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"
        assert role.rdma is not None and (role.rdma.resource, role.rdma.per_pod) == ("rdma/ib", 1)
        spec = render_spec(role)
        assert "/dev/infiniband" in spec.devices and "IPC_LOCK" in spec.cap_add
        assert ("memlock", -1, -1) in spec.ulimits
        assert "NCCL_IB_HCA" not in dict(spec.env)  # each role on one node: NCCL crosses nothing


def test_rocm_pairs_over_rc_with_its_own_copy_transports():
    group = derive(plan_for("mi355xx8", PD, "fabric.rdma={}", PRIVILEGED)).disaggregated
    assert group is not None
    env = build_invocation(group.decode).env_dict
    assert env["UCX_TLS"] == "rc,rocm_copy,rocm_ipc"
    assert "UCX_NET_DEVICES" not in env  # no ports named: UCX's choice


def test_an_engine_over_nodes_gets_nccls_hcas_exactly():
    deployment = derive(plan_for("b300x4", *DEP8, PORTS, PRIVILEGED))
    assert deployment.rdma is not None and deployment.layout.spans_nodes
    # `=`: exact names (NCCL reads a bare mlx5_1 as a prefix, which mlx5_10 matches too).
    assert dict(render_spec(deployment, in_pod=True).env)["NCCL_IB_HCA"] == "=mlx5_0:1,mlx5_1:1"


def test_the_plans_own_environment_wins_over_the_derived_one():
    plan = plan_for("b300x4", *DEP8, PORTS, PRIVILEGED, "runtime.env.NCCL_IB_HCA=mlx5")
    assert dict(render_spec(derive(plan), in_pod=True).env)["NCCL_IB_HCA"] == "mlx5"


def test_a_single_node_aggregated_server_crosses_nothing_and_gets_nothing():
    plan = plan_for("b300x4", "fabric.rdma={}", PRIVILEGED)
    assert any("fabric.rdma is set, but the plan runs one engine on one node" in w for w in plan.warnings)
    deployment = derive(plan)
    assert deployment.rdma is None
    assert "/dev/infiniband" not in render_spec(deployment).devices


@pytest.mark.parametrize(
    ("sets", "said"),
    [
        (("fabric.rdma.devices=[]",), "names no HCA"),
        (('fabric.rdma.devices=["mlx5_0"]',), "'mlx5_0' is not an HCA port"),
        (('fabric.rdma.devices=["mlx5_0:1","mlx5_0:1"]',), "names a port twice"),
        (("fabric.rdma.resource=rdma",), "not a device plugin's resource"),
        (("fabric.rdma.resource=kubernetes.io/rdma",), "not a device plugin's resource"),
        (("fabric.rdma.count=0",), "greater than or equal to 1"),
        (("fabric.rdma={}",), 'Pod Security "baseline"'),
        ((PD, PORTS, PRIVILEGED, "disaggregation.ucx_net_devices=mlx5_2:1"), "both name UCX's devices"),
    ],
)
def test_bad_input_is_one_line_at_plan_time(sets, said):
    with pytest.raises(InputError) as refused:
        plan_for("b300x4", *sets)
    assert said in refused.value.message and refused.value.exit_code == ExitCode.BAD_INPUT


def test_the_cpu_platform_is_refused_from_the_command_line():
    result = run_cli("plan", "--hardware", "cpu", "--set", "fabric.rdma={}", "--set", PRIVILEGED)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "--set #1: fabric.rdma: the cpu platform moves no GPU memory and runs no NCCL" in line
    assert "unset fabric.rdma" in line


def test_moe_collectives_over_nodes_without_rdma_are_warned_with_the_setting():
    (warned,) = [w for w in plan_for("b300x4", *DEP8).warnings if "MoE collectives span" in w]
    assert "over TCP sockets" in warned and "set fabric.rdma" in warned
    assert not any(
        "MoE collectives span" in w for w in plan_for("b300x4", *DEP8, "fabric.rdma={}", PRIVILEGED).warnings
    )
    # The CPU build has no NCCL to advise about, and refuses fabric.rdma.
    cpu = plan_for("cpu", "parallelism.nodes=2", "parallelism.data=2")
    assert not any("fabric.rdma" in w for w in cpu.warnings)


def test_a_pair_on_different_nodes_without_rdma_is_warned_with_its_cost():
    (warned,) = [w for w in plan_for("b300x4", PD).warnings if "different nodes" in w]
    assert "4 + 4 GPUs, each NVIDIA B300" in warned and "UCX's TCP transport" in warned
    assert "34,560 bytes a token at nvfp4" in warned and "9.1 GB for a 262,144-token prompt" in warned
    assert "set fabric.rdma" in warned
    # A pair that fits one node stays on one (Compose, script, systemd; Kubernetes prefers it).
    assert not any("different nodes" in w for w in plan_for("b300x8", PD).warnings)
    # A role over nodes crosses them too; RDMA set: nothing to warn.
    wide = ("disaggregation.decode.data=2", "disaggregation.decode.nodes=2")
    assert any("a role spans nodes" in w for w in plan_for("b300x8", PD, *wide).warnings)
    rdma = plan_for("b300x4", PD, "fabric.rdma={}", PRIVILEGED)
    assert not any("different nodes" in w for w in rdma.warnings)
    assert any("capability IPC_LOCK (fabric.rdma)" in w for w in rdma.warnings)
