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
