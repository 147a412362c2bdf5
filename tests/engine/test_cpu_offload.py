"""cache.cpu_offload_gib (issue 50): the prefix cache's CPU tier as vLLM's native KV offloading.
The adapter alone spells its flags, extra_args may not set them again, and a prefill/decode plan
is refused: vLLM 0.32 makes the offloading the KV connector, over the role's NixlConnector.
(Real vLLM builds it from this argv: tests/engine/test_engine_truth.py.)"""

from __future__ import annotations

import pytest

from m31ctl.engine.adapter import build_invocation
from m31ctl.errors import InputError
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve


def _plan(hardware: str, *sets: str):  # type: ignore[no-untyped-def]
    return resolve(PlanRequest(hardware=simulated(hardware), sets=sets))


def test_the_cpu_tier_is_two_flags_of_the_adapter():
    from m31ctl.deployment import derive

    args = list(build_invocation(derive(_plan("b300x4", "cache.cpu_offload_gib=512"))).args)
    at = args.index("--kv-offloading-size")
    assert args[at + 1] == "512" and args[args.index("--kv-offloading-backend") + 1] == "native"
    assert "--kv-offloading-size" not in build_invocation(derive(_plan("b300x4"))).args


def test_extra_args_may_not_set_the_tier_again():
    from m31ctl.commands import deployment

    sets = ('engine.extra_args=["--kv-offloading-size=9"]',)
    with pytest.raises(InputError, match=r"cache\.cpu_offload_gib"):
        deployment(PlanRequest(hardware=simulated("b300x4"), sets=sets), validate=False)


def test_a_prefill_decode_plan_with_a_cpu_tier_is_refused_naming_both_settings():
    with pytest.raises(InputError) as refused:
        _plan("b300x8", "disaggregation.enabled=true", "cache.cpu_offload_gib=64")
    assert "cache.cpu_offload_gib" in str(refused.value) and "disaggregation.enabled" in str(refused.value)


def test_the_cpu_build_refuses_the_tier_at_plan_time_not_at_worker_init():
    """vLLM's CPU build starts the OffloadingConnector and its worker dies at init ("CPU
    Offloading is currently only supported on CUDA-alike and XPU GPUs", vllm/v1/kv_offload/cpu/
    spec.py; seen starting the CPU rehearsal engine here): the plan refuses it instead, naming the
    rule and the setting; GPU plans of both vendors keep the tier."""
    from m31ctl.errors import RuleViolation

    with pytest.raises(RuleViolation) as refused:
        _plan("cpu", "cache.cpu_offload_gib=1")
    line = refused.value.one_line()
    assert "vllm-cpu-offload-platform" in line and "cache.cpu_offload_gib" in line
    for hw in ("b300x4", "mi355xx8", "h200x8"):
        assert _plan(hw, "cache.cpu_offload_gib=64").settings.cache.cpu_offload_gib == 64
