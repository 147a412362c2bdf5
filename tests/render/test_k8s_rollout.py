"""kubernetes.rollout: how a changed plan replaces the serving pods (issue 50). recreate, the
default, stops the old copy first (no spare GPUs needed, a start's downtime); surge starts one
more copy and stops the old only once the new one is ready. Both workload kinds say it, the
Deployment in its strategy and the LeaderWorkerSet in its rolloutStrategy, and the header says
what the choice costs."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from m31ctl.deployment import derive
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.render import get_target
from tests.conftest import PINNED_COMMIT
from tests.support.render import tool


def _k8s(hardware: str, *sets: str) -> tuple[list[dict], str]:  # type: ignore[type-arg]
    deployment = derive(resolve(PlanRequest(hardware=simulated(hardware), sets=sets)), commit=PINNED_COMMIT)
    (artifact,) = get_target("k8s")(deployment)
    return [d for d in yaml.safe_load_all(artifact.content) if d], artifact.content


def _workload(documents: list[dict]) -> dict:  # type: ignore[type-arg]
    (workload,) = [d for d in documents if d["kind"] in ("Deployment", "LeaderWorkerSet")]
    return workload


def test_the_default_recreates_and_says_the_downtime():
    documents, text = _k8s("b300x4")
    assert _workload(documents)["spec"]["strategy"] == {"type": "Recreate"}
    assert "Rollout (kubernetes.rollout=recreate)" in text and "without" in text


def test_surge_keeps_the_old_pod_until_the_new_one_is_ready(tmp_path):
    documents, text = _k8s("b300x4", "kubernetes.rollout=surge")
    strategy = _workload(documents)["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert "Rollout (kubernetes.rollout=surge)" in text
    path = tmp_path / "k8s.yaml"
    path.write_text(text)
    checked = subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(path)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize(("rollout", "unavailable", "surge"), [("recreate", 1, 0), ("surge", 0, 1)])
def test_a_leader_worker_set_rolls_the_same_way(rollout, unavailable, surge):
    documents, _ = _k8s(
        "h100x4",
        "parallelism.nodes=2",
        "kubernetes.hf_cache_storage_class=nfs-rwx",
        f"kubernetes.rollout={rollout}",
    )
    workload = _workload(documents)
    assert workload["kind"] == "LeaderWorkerSet"
    assert workload["spec"]["rolloutStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdateConfiguration": {"maxUnavailable": unavailable, "maxSurge": surge},
    }


def test_an_unknown_rollout_is_refused_with_the_choices(cli):
    done = cli("plan", "--hardware", "b300x4", "--set", "kubernetes.rollout=bluegreen")
    assert done.returncode == 2 and "recreate" in done.stderr and "surge" in done.stderr
    assert "Traceback" not in done.stderr
