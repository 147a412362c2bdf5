"""The second day rehearsed on real vLLM (the CPU build) in Docker: an image change rolled out
by the rendered strategy under a steady load through the Service, the old pod deleted as the
kubelet deletes it with a stream in flight on it (m31ctl/rehearsal/rollout_proof.py). One
session a strategy: the old pod's start, the new pod's start, then the negative (the new pod
deleted without its preStop hook) on the pod already running. Each costs two vLLM starts and
about a minute of streams and waits (about 3 minutes here with the machine to itself), so both
are in `scripts/test --heavy`; the test command replays each one's capture
(tests/fixtures/rehearsal/rollout-surge/, rollout-recreate/: the outcome as measured and the
clocks it was judged by) through the same verdict and assertions; `M31CTL_UPDATE_CAPTURES=1
scripts/test --heavy` writes them again (docs/decisions.md, "Drain and rollout rehearsed")."""

from __future__ import annotations

import json
import os

import pytest

from m31ctl.hardware import simulated
from m31ctl.plan import Plan, PlanRequest, resolve
from m31ctl.rehearsal.prepared import RolloutRun, prepare
from m31ctl.rehearsal.rollout_proof import RolloutOutcome, from_record, record, summary_lines, verdict
from m31ctl.rehearsal.runner import rehearse
from m31ctl.rehearsal.session import Options
from tests.conftest import ROOT

CAPTURES = ROOT / "tests" / "fixtures" / "rehearsal"


def _plan(rollout: str) -> Plan:
    return resolve(PlanRequest(hardware=simulated("cpu"), sets=(f"kubernetes.rollout={rollout}",)))


def _judge(outcome: RolloutOutcome, spec: RolloutRun) -> None:
    """What a real run must show, judged again on a capture: the verdict, and each part of it."""
    assert verdict(outcome, spec) is None, verdict(outcome, spec)
    drain = outcome.drain
    assert drain is not None and drain.stream is not None
    # The stream ran on through the preStop wait and SIGTERM, and ended whole.
    assert drain.in_flight_at_sigterm and drain.stream.whole and drain.stream.finish_reason == "length"
    term = drain.termination
    assert term.pre_stop == ("sleep", str(spec.pre_stop_s)) and term.pre_stop_exit == 0
    assert term.drained and not term.killed and term.ended_s is not None and term.ended_s < term.grace_s
    assert term.grace_s == spec.grace_s
    assert outcome.to_old_after_deletion == 0
    # The negative: without its preStop hook the same stream is cut.
    assert outcome.cut is not None and outcome.cut.stream is not None and not outcome.cut.stream.whole
    if spec.strategy.kind == "RollingUpdate":
        assert outcome.requests > 0 and outcome.failed == 0
        assert outcome.gap_s is None  # a Ready pod was listed all along
    else:
        assert spec.strategy.kind == "Recreate"
        assert outcome.gap_s is not None and outcome.gap_s <= outcome.stated_downtime_s == spec.start_s
        assert outcome.failed_with_endpoints == 0


def _rehearse_rollout(rollout: str, image: str) -> None:
    plan = _plan(rollout)
    spec = prepare(plan, Options(rollout=True, base_image=image)).rollout
    assert spec is not None
    result = rehearse(plan, Options(rollout=True, base_image=image))
    outcome = result.rollout
    assert outcome is not None, result.failure
    lines = summary_lines(outcome)
    print("\n".join(lines), f"\ntimings: {result.timings_s}")
    assert result.served and outcome.ok, outcome.failure
    assert result.cleaned, result.leftovers
    _judge(outcome, spec)
    if os.environ.get("M31CTL_UPDATE_CAPTURES") == "1":
        folder = CAPTURES / f"rollout-{rollout}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "outcome.json").write_text(json.dumps(record(outcome, spec), indent=1) + "\n")
        (folder / "summary.txt").write_text("\n".join([*lines, f"timings: {result.timings_s}"]) + "\n")


def _replay(rollout: str) -> None:
    """The real run's capture judged again, by the clocks the plan has now (a plan whose clocks
    moved since the capture fails here: the capture is then written again)."""
    outcome, spec = from_record(json.loads((CAPTURES / f"rollout-{rollout}" / "outcome.json").read_text()))
    assert spec == prepare(_plan(rollout), Options(rollout=True)).rollout, (
        "capture older than the plan's clocks"
    )
    assert outcome.ok and outcome.strategy == spec.strategy.kind
    _judge(outcome, spec)


@pytest.mark.docker
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.heavy  # scripts/test --heavy: two vLLM starts and a minute of waits; replayed below
def test_a_surge_rollout_fails_no_request_and_drains_the_old_pods_stream(rehearsal_image):
    _rehearse_rollout("surge", rehearsal_image)


@pytest.mark.docker
@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.heavy  # as the surge's
def test_a_recreate_rollout_is_down_no_longer_than_stated(rehearsal_image):
    _rehearse_rollout("recreate", rehearsal_image)


def test_a_surge_rollout_fails_no_request_and_drains_the_old_pods_stream_replayed():
    _replay("surge")


def test_a_recreate_rollout_is_down_no_longer_than_stated_replayed():
    _replay("recreate")


def test_the_replayed_verdict_still_fails_a_bad_rollout():
    """The replay judges the capture's measurements, not its recorded verdict: one failed request
    of the surge, or the drained stream cut, fails it."""
    outcome, spec = from_record(json.loads((CAPTURES / "rollout-surge" / "outcome.json").read_text()))
    assert (
        verdict(outcome._replace(failed=1), spec)
        == f"1 of {outcome.requests} requests failed during the surge"
    )
    drain = outcome.drain
    assert drain is not None and drain.stream is not None
    cut = drain._replace(stream=drain.stream._replace(tokens=drain.stream.tokens - 1))
    assert (verdict(outcome._replace(drain=cut), spec) or "").startswith(
        "the stream on the deleted pod was cut"
    )
