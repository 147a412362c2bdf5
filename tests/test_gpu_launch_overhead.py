"""What launch adds to the engine's own start on the H200 (issue 53), replayed from
tests/fixtures/gpu/h200-launch-overhead/ (its README says how it was taken). No GPU here."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

CAPTURE = Path(__file__).parent / "fixtures" / "gpu" / "h200-launch-overhead"


def _rows(run: str) -> list[dict]:
    return [json.loads(line) for line in (CAPTURE / f"overhead-{run}.jsonl").read_text().splitlines()]


def _health(run: str) -> list[float]:
    """Each launch's "/health answers 200 (N s)": the engine's own time since m31ctl created it."""
    text = (CAPTURE / f"overhead-{run}-m31ctl.err").read_text()
    return [float(s) for s in re.findall(r"/health answers 200 \(([\d.]+) s\)", text)]


def _launches(run: str) -> list[dict]:
    return [r for r in _rows(run) if r.get("start") == "m31ctl"]


def test_a_relaunch_on_the_same_plan_engine_and_host_skips_the_deep_checks():
    first, *later = _launches("run1")
    assert first["warmup"] and first["deep"] == "ran" and first["seconds"] > 100  # 120 s: the checks
    assert [r["deep"] for r in later + _launches("run2")] == ["remembered"] * 6  # run 2 warm-up too


def test_m31ctls_own_part_of_a_launch_is_two_seconds_at_most():
    """Exit minus the engine's own /health time: imports, plan, probe, the cheap checks, the
    engine's identity, then /v1/models. 1.4-2.0 s, against engine starts of 40-56 s."""
    own = []
    for run in ("run1", "run2"):
        for launch, health in zip(_launches(run), _health(run), strict=True):
            if launch["deep"] == "remembered":
                own.append(launch["seconds"] - health)
    assert len(own) == 6 and all(1.3 < s <= 2.0 for s in own), own


def test_the_interleaved_medians_are_what_was_measured():
    """The issue's measure, as it came out: the medians differ by 14-16%, more than m31ctl's own
    part explains: the engine's own start, exec to /health, had a median of 49.4 s under launch and
    45.4 s (to /v1/models) raw, varying 40-56 s from start to start. Recorded as measured, not as met (docs/decisions.md)."""
    raw = [r["seconds"] for run in ("run1", "run2") for r in _rows(run) if r.get("start") == "raw"]
    engine = [h for run in ("run1", "run2") for h, r in zip(_health(run), _launches(run), strict=True)
              if r["deep"] == "remembered"]  # fmt: skip
    assert statistics.median(raw) == 45.37 and statistics.median(engine) == 49.4
    summaries = [r for run in ("run1", "run2") for r in _rows(run) if r.get("summary")]
    assert [s["added"] for s in summaries] == [0.1408, 0.1579]


# Runs 3-6: both sides stopped alike, the order alternating (README.md of the capture).
_BEFORE, _AFTER = ("run3", "run4"), ("run5", "run6")


def _timed(runs: tuple[str, ...], start: str) -> list[dict]:
    return [r for run in runs for r in _rows(run) if r.get("start") == start and not r.get("warmup")]


def test_launchs_own_part_fell_from_two_seconds_to_one():
    """The profile of a relaunch (run 4) put launch's own 2 s in the imports (0.57 s of them
    byte-compiling a tree that had no .pyc) and 1.04 s in the engine's identity; with the identity
    read beside the package and m31ctl compiled as installed, every relaunch's own part is
    0.8-1.2 s, about 2% of a 50 s start."""
    profile = (CAPTURE / "launch-profile-run4.txt").read_text()
    identity = re.search(r"\s([\d.]+)\s+[\d.]+\s+m31ctl/runtime/native\.py:\d+\(python_identity\)", profile)
    assert identity and float(identity.group(1)) > 1.0
    assert re.search(r"188\s+5\.294 .*load_verify_locations", profile)  # an SSL context per look
    before = [r["own_s"] for run in _BEFORE for r in _rows(run) if r.get("deep") == "remembered"]
    after = [r["own_s"] for run in _AFTER for r in _rows(run) if r.get("deep") == "remembered"]
    assert len(before) == 5 and all(1.8 <= s <= 2.5 for s in before), before
    assert len(after) == 4 and all(s <= 1.2 for s in after), after


def test_the_engines_own_start_varies_more_than_launch_adds():
    """The issue's measure over runs 3-6, as it came out: seven interleaved pairs, raw 49.9-65.2 s
    (median 51.9), launch 49.9-63.1 s (median 57.3, +10%); the engine's own time to /health under
    launch 47.6-60.6 s (median 55.4). After the fix the raw engine came up in 49.9-50.7 s three
    times and under launch in 49.2-59.6 s: the spread is in the engine's own phases (its API
    server's imports, then the engine core's, 20-30 s each in the launch lines), not in
    launch's own second. Recorded as measured, not as met (docs/decisions.md)."""
    runs = _BEFORE + _AFTER
    raw = [r["seconds"] for r in _timed(runs, "raw")]
    ours = [r["seconds"] for r in _timed(runs, "m31ctl")]
    engine = [r["engine_to_health_s"] for r in _timed(runs, "m31ctl")]
    assert len(raw) == len(ours) == 7
    assert statistics.median(raw) == 51.88 and statistics.median(ours) == 57.26
    assert statistics.median(engine) == 55.4
    assert max(raw) - min(raw) > 15 and max(engine) - min(engine) > 10  # start to start
    assert sorted(r["seconds"] for r in _timed(_AFTER, "raw")) == [49.87, 50.65, 50.66]
