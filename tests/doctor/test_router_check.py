"""doctor's router check (issue 49): a prefill/decode plan's router image must run vllm-router.
Asked of the real Docker Engine: the rehearsal image installs the router and answers with its
version; the busybox stand-in engine image, like vLLM's own images, has none, and the check
fails with the setting to change. An aggregated plan has no router to check."""

from __future__ import annotations

import pytest

from m31ctl.checks import CheckStatus
from m31ctl.deployment import derive
from m31ctl.doctor.base import CheckContext, run_checks
from m31ctl.doctor.checks import all_checks, get_check
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.probe import ProbeReport
from m31ctl.runtime.gates import CheckId
from tests.conftest import PINNED_COMMIT

NO_GPU = simulated("cpu")


def _router_check(*sets: str):  # type: ignore[no-untyped-def]
    plan = resolve(PlanRequest(hardware=simulated("cpu"), variant="pd", sets=sets))
    ctx = CheckContext(
        deployment=derive(plan, commit=PINNED_COMMIT), plan_error=None, probe=ProbeReport(NO_GPU, ()), env={}
    )
    (result,) = run_checks([get_check(CheckId.ROUTER)], ctx)
    return result


def test_an_aggregated_plan_has_no_router_check():
    plan = resolve(PlanRequest(hardware=simulated("cpu")))
    assert CheckId.ROUTER not in {check.id for check in all_checks(derive(plan, commit=PINNED_COMMIT))}


@pytest.mark.docker
def test_the_rehearsal_image_runs_vllm_router(rehearsal_image):
    result = _router_check()
    assert result.status is CheckStatus.OK, result.message
    assert result.message == f"{rehearsal_image} runs vllm-router"


@pytest.mark.docker
def test_an_image_without_the_router_fails_naming_the_setting():
    from m31ctl.runtime.engine_api import connect
    from tests.dockerlib import build_engine_images

    image = build_engine_images(connect())["ready"]
    result = _router_check(f"disaggregation.router.image={image}")
    assert result.status is CheckStatus.FAIL, result.message
    assert "has no vllm-router" in result.message and "disaggregation.router.image" in (result.remedy)
