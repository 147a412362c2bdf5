"""kubernetes.rollout from the GPUs a cluster declares spare (issue 50, "A surge with no spare
GPUs: one clear line and a documented exit code at plan time"): kubernetes.spare_gpus decides an
unasked rollout, refuses an asked surge it cannot hold, and unset leaves every plan as it was."""

from __future__ import annotations

import pytest

from m31ctl.deployment import derive
from m31ctl.errors import ExitCode, InputError
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.render.k8s_copies import rollout_of
from tests.conftest import run_cli

PD = "disaggregation.enabled=true"


def plan_for(spec: str, *sets: str):  # type: ignore[no-untyped-def]
    return resolve(PlanRequest(hardware=simulated(spec), sets=sets))


def test_unset_it_leaves_the_plan_as_it_was():
    plan = plan_for("b300x4")
    assert plan.settings.kubernetes.spare_gpus is None and plan.settings.kubernetes.rollout == "recreate"
    assert "spare_gpus" not in plan.settings_dict()["kubernetes"]  # the hash and labels unchanged
    assert "kubernetes.rollout" not in plan.provenance  # the setting's own default, unasked


@pytest.mark.parametrize(("spare", "rollout"), [(4, "surge"), (8, "surge"), (3, "recreate"), (0, "recreate")])
def test_an_unasked_rollout_is_what_the_spare_gpus_hold(spare, rollout):
    plan = plan_for("b300x4", f"kubernetes.spare_gpus={spare}")  # one copy: TP4
    assert plan.settings.kubernetes.rollout == rollout
    source = str(plan.provenance["kubernetes.rollout"])
    assert f"kubernetes.spare_gpus={spare}" in source and "a second copy's 4 GPUs" in source
    assert "spare_gpus" in plan.settings_dict()["kubernetes"]
    wanted = {"surge": {"maxSurge": 1, "maxUnavailable": 0}, "recreate": None}[rollout]
    strategy = rollout_of(derive(plan)).deployment
    assert strategy.get("rollingUpdate") == wanted and strategy["type"] == (
        "RollingUpdate" if wanted else "Recreate"
    )


def test_an_asked_rollout_is_kept_where_it_fits():
    assert (
        plan_for(
            "b300x4", "kubernetes.spare_gpus=8", "kubernetes.rollout=recreate"
        ).settings.kubernetes.rollout
        == "recreate"
    )
    assert (
        plan_for("b300x4", "kubernetes.spare_gpus=4", "kubernetes.rollout=surge").settings.kubernetes.rollout
        == "surge"
    )


def test_a_surge_the_spare_gpus_cannot_hold_is_refused_at_plan_time():
    with pytest.raises(InputError) as caught:
        plan_for("b300x4", "kubernetes.spare_gpus=2", "kubernetes.rollout=surge")
    line = caught.value.one_line()
    assert "starts a second copy on 4 more GPUs, and kubernetes.spare_gpus=2 declares 2 free" in line
    assert "kubernetes.rollout=recreate" in line and "--set #2" in line


def test_a_pairs_second_copy_is_both_roles():
    """Both roles' Deployments roll out at once: a surge needs prefill's and decode's GPUs."""
    assert plan_for("b300x8", PD, "kubernetes.spare_gpus=4").settings.kubernetes.rollout == "recreate"
    assert plan_for("b300x8", PD, "kubernetes.spare_gpus=8").settings.kubernetes.rollout == "surge"


def test_the_cli_refuses_it_in_one_line_with_exit_2():
    done = run_cli(
        "plan",
        "--hardware",
        "b300x4",
        "--set",
        "kubernetes.spare_gpus=2",
        "--set",
        "kubernetes.rollout=surge",
    )
    assert done.returncode == ExitCode.BAD_INPUT == 2
    assert done.stdout == "" and len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
