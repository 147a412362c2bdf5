"""The second day rehearsed on real vLLM (the CPU build) in Docker: an image change rolled out
by the rendered strategy under a steady load through the Service, the old pod deleted as the
kubelet deletes it with a stream in flight on it (m31ctl/rehearsal/rollout_proof.py). One
session a strategy: the old pod's start, the new pod's start, then the negative (the new pod
deleted without its preStop hook) on the pod already running. Both in `scripts/test --heavy`
for now: the last surge run here (engine-core pacing) never saw the new pod pass its startup
probe beside the loaded old one within 13 minutes, so neither is in the test command until a
run proves it there (docs/decisions.md, "Drain and rollout rehearsed")."""

from __future__ import annotations

import pytest

from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.rehearsal.rollout_proof import summary_lines
from m31ctl.rehearsal.runner import rehearse
from m31ctl.rehearsal.session import Options


def _rehearse_rollout(rollout: str, image: str):
    plan = resolve(PlanRequest(hardware=simulated("cpu"), sets=(f"kubernetes.rollout={rollout}",)))
    result = rehearse(plan, Options(rollout=True, base_image=image))
    outcome = result.rollout
    assert outcome is not None, result.failure
    print("\n".join(summary_lines(outcome)))
    assert result.served and outcome.ok, outcome.failure
    assert result.cleaned, result.leftovers
    drain = outcome.drain
    assert drain is not None and drain.stream is not None
    # The stream ran on through the preStop wait and SIGTERM, and ended whole.
    assert drain.in_flight_at_sigterm and drain.stream.whole and drain.stream.finish_reason == "length"
    term = drain.termination
    assert term.pre_stop == ("sleep", "10") and term.pre_stop_exit == 0
    assert term.drained and not term.killed and term.ended_s is not None and term.ended_s < term.grace_s
    assert outcome.to_old_after_deletion == 0
    # The negative: without its preStop hook the same stream is cut.
    assert outcome.cut is not None and outcome.cut.stream is not None and not outcome.cut.stream.whole
    return outcome


@pytest.mark.docker
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.heavy
def test_a_surge_rollout_fails_no_request_and_drains_the_old_pods_stream(rehearsal_image):
    outcome = _rehearse_rollout("surge", rehearsal_image)
    assert outcome.strategy == "RollingUpdate"
    assert outcome.requests > 0 and outcome.failed == 0
    assert outcome.gap_s is None  # a Ready pod was listed all along


@pytest.mark.docker
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.heavy
def test_a_recreate_rollout_is_down_no_longer_than_stated(rehearsal_image):
    outcome = _rehearse_rollout("recreate", rehearsal_image)
    assert outcome.strategy == "Recreate"
    assert outcome.gap_s is not None and outcome.gap_s <= outcome.stated_downtime_s
    assert outcome.failed_with_endpoints == 0
