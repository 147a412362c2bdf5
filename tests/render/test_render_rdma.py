"""fabric.rdma rendered (issue 49): what each target writes for an engine that crosses nodes or a
P/D pair's containers over RDMA, each checked by the runtime's own validator (Kubernetes'
schemas, docker-compose config and the compose-spec schema), and a golden for an expert-parallel
layout over two nodes. The P/D pair over RDMA has goldens of its own (tests/support/render.py
PLANS, pd-b300x8-rdma)."""

from __future__ import annotations

import os
import subprocess

import yaml

from m31ctl.deployment import derive
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.render import get_target
from tests.conftest import PINNED_COMMIT
from tests.support.render import RDMA, REFERENCE, pd_deployment, tool

# DEP8 over two 4-GPU nodes (a LeaderWorkerSet), its pods on two named HCA ports.
WIDE = ("parallelism.nodes=2", "parallelism.data=2", "kubernetes.hf_cache_storage_class=nfs-rwx", *RDMA)
GOLDEN = REFERENCE / "b300x4-dep8-rdma" / "k8s.yaml"


def _wide_k8s() -> str:
    plan = resolve(PlanRequest(hardware=simulated("b300x4"), sets=WIDE))
    (artifact,) = get_target("k8s")(derive(plan, commit=PINNED_COMMIT))
    return artifact.content


def _validate(text: str, tmp_path, name: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / name
    path.write_text(text)
    done = subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(path)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_golden(monkeypatch):
    monkeypatch.setenv("HOME", "/home/operator")
    content = _wide_k8s()
    if os.environ.get("M31CTL_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(content)
    assert content == GOLDEN.read_text(), f"re-run with M31CTL_UPDATE_GOLDEN=1 if {GOLDEN} should change"


def test_every_pod_of_a_group_over_nodes_asks_rdma_and_names_its_hcas(tmp_path):
    content = _wide_k8s()
    lws = next(d for d in yaml.safe_load_all(content) if d["kind"] == "LeaderWorkerSet")
    template = lws["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        pod = template[role]["spec"]
        (engine,) = pod["containers"]
        for side in ("limits", "requests"):
            assert engine["resources"][side]["rdma/ib"] == 1
        assert engine["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
        assert {"name": "NCCL_IB_HCA", "value": "=mlx5_0:1,mlx5_1:1"} in engine["env"]
        # The pod templates are plain pods: Kubernetes' own schemas (the LWS CRD is not in them).
        document = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"x-{role.lower()}"}, "spec": pod}
        _validate(yaml.safe_dump(document), tmp_path, f"{role}.yaml")
    assert "RDMA (fabric.rdma): each pod asks 1 rdma/ib" in content
    assert "NCCL_IB_HCA==mlx5_0:1,mlx5_1:1" in content


def test_the_pairs_k8s_roles_ask_rdma_and_the_router_does_not(tmp_path):
    (artifact,) = get_target("k8s")(pd_deployment("pd-b300x8-rdma"))
    _validate(artifact.content, tmp_path, "k8s.yaml")
    workloads = {
        d["metadata"]["name"].rsplit("-", 1)[-1]: d
        for d in yaml.safe_load_all(artifact.content)
        if d["kind"] == "Deployment"
    }
    for name in ("prefill", "decode"):
        (engine,) = workloads[name]["spec"]["template"]["spec"]["containers"]
        assert engine["resources"]["limits"]["rdma/ib"] == 1
        env = {e["name"]: e.get("value") for e in engine["env"]}
        assert env["UCX_TLS"] == "rc,cuda_copy,cuda_ipc" and env["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"
    for router in workloads["router"]["spec"]["template"]["spec"]["containers"]:  # the front, the router
        assert "rdma/ib" not in router.get("resources", {}).get("limits", {})


def test_a_pair_wider_than_a_node_says_its_kv_crosses_over_rdma():
    (artifact,) = get_target("k8s")(
        pd_deployment(
            "pd-b300x8-rdma",
            (
                "disaggregation.decode.nodes=2",
                "disaggregation.decode.data=2",
                "kubernetes.hf_cache_storage_class=nfs",
            ),
        )
    )
    assert "crosses the network between nodes, over RDMA (fabric.rdma)." in " ".join(
        line.removeprefix("# ") for line in artifact.content.splitlines() if line.startswith("#")
    )


def test_docker_targets_hand_the_roles_the_verbs_devices_and_ipc_lock():
    deployment = pd_deployment("pd-b300x8-rdma")
    (compose,) = get_target("compose")(deployment)
    services = yaml.safe_load(compose.content)["services"]
    for name in ("prefill", "decode"):
        assert services[name]["devices"] == ["/dev/infiniband"]
        assert services[name]["cap_add"] == ["IPC_LOCK"]
        assert services[name]["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
    assert "devices" not in services["router"] and "cap_add" not in services["router"]
    (script,) = get_target("script")(deployment)
    assert (
        script.content.count("--device /dev/infiniband") == 2
        and script.content.count("--cap-add IPC_LOCK") == 2
    )
    units = {a.name: a.content for a in get_target("systemd")(deployment)}
    for name, unit in units.items():
        role = "-router" not in name
        assert ("--device /dev/infiniband" in unit) is role and ("--cap-add IPC_LOCK" in unit) is role
