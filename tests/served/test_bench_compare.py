"""`m31ctl bench compare` on two real reports (the CPU rehearsal at serving.max_num_seqs=1 and 4,
scripts/bench_compare_example.py): point by point changes checked by hand, the verdict at an SLO,
refusals of unlike reports (workload, model) unless --force, reports of the format before cost
and model were recorded, and the CLI's text, JSON and plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from m31ctl.errors import InputError
from m31ctl.served import compare, figures
from m31ctl.served.cost import Price
from tests.conftest import FIXTURES, run_cli

ONE = FIXTURES / "bench" / "report-max-num-seqs-1.json"
FOUR = FIXTURES / "bench" / "report-max-num-seqs-4.json"


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def reports(*data: dict[str, Any]) -> list[compare.Report]:
    return [compare.read_report(f"r{i}.json", d) for i, d in enumerate(data)]


def test_point_by_point_changes_are_against_the_first_report():
    a, b = load(ONE), load(FOUR)
    found = compare.compare(reports(a, b), None)
    assert [row.concurrency for row in found.rows] == [p["concurrency"] for p in a["points"]]
    for row, pa, pb in zip(found.rows, a["points"], b["points"], strict=True):
        before, after = row.values
        assert before is not None and after is not None and row.changes[0] is not None
        for key in (
            "tok_s_per_user",
            "tok_s_per_gpu",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "tpot_p50_ms",
            "tpot_p99_ms",
        ):
            assert before[key] == pa[key] and after[key] == pb[key]
            assert row.changes[0][key] == pytest.approx((pb[key] - pa[key]) / pa[key], abs=1e-4)
        # Each report's own price: cost per million output tokens from its own throughput.
        assert after[compare.COST_KEY] == pytest.approx(2.5 / (pb["output_tok_s"] * 3600) * 1e6)


def test_the_verdict_names_the_better_best_point_and_by_how_much():
    a, b = load(ONE), load(FOUR)
    found = compare.compare(reports(a, b), None)
    best = {r.label: r.choice.point for r in found.reports}
    assert best["r0.json"] is not None and best["r1.json"] is not None
    ours = [max(d["points"], key=lambda p: p["tok_s_per_gpu"]) for d in (a, b)]
    assert [best[f"r{i}.json"].concurrency for i in (0, 1)] == [p["concurrency"] for p in ours]  # type: ignore[union-attr]
    winner = 1 if ours[1]["tok_s_per_gpu"] > ours[0]["tok_s_per_gpu"] else 0
    assert found.verdict.best == f"r{winner}.json"
    if winner == 1:
        margin = (ours[1]["tok_s_per_gpu"] - ours[0]["tok_s_per_gpu"]) / ours[0]["tok_s_per_gpu"]
        assert found.verdict.margin == pytest.approx(margin, abs=1e-4)
        assert f"by {margin:.1%} (higher throughput)" in found.verdict.text


def test_an_slo_only_one_run_meets():
    a, b = load(ONE), load(FOUR)
    # A p99 TTFT limit between the two runs' best values: only the better one qualifies.
    ttft = sorted(min(p["ttft_p99_ms"] for p in d["points"]) for d in (a, b))
    limit = (ttft[0] + ttft[1]) / 2
    found = compare.compare(reports(a, b), figures.parse_slo(f"ttft_p99_ms={limit}"))
    meets = [r.label for r in found.reports if r.choice.point is not None]
    assert len(meets) == 1 and found.verdict.best == meets[0]
    assert found.verdict.slo_from == "given"


def test_pick_by_cost_with_one_price_for_both():
    a, b = load(ONE), load(FOUR)
    found = compare.compare(reports(a, b), None, pick="cost", price=Price(10.0, "gpu", "EUR"))
    assert all(r.costing is not None and r.costing.price.currency == "EUR" for r in found.reports)
    costs = {
        r.label: 10.0 / (r.choice.point.output_tok_s * 3600) * 1e6  # type: ignore[union-attr]
        for r in found.reports
    }
    cheapest = min(costs, key=costs.__getitem__)
    assert found.verdict.best == cheapest and "cheaper" in found.verdict.text
    assert "EUR per million output tokens" in found.verdict.text


def test_reports_of_different_workloads_or_models_are_refused_unless_forced():
    a, b = load(ONE), load(FOUR)
    with pytest.raises(InputError, match=r"different workloads: r0.json 'chat', r1.json 'agentic'"):
        compare.compare(reports(a, {**b, "workload": "agentic"}), None)
    other = {**b, "model": {"path": "/models/other", "served_name": "x"}}
    with pytest.raises(
        InputError, match=r"different models: r0\.json .*, r1\.json '/models/other'"
    ) as refused:
        compare.compare(reports(a, other), None)
    assert "--force" in (refused.value.hint or "")
    forced = compare.compare(reports(a, other), None, force=True)
    assert forced.forced and forced.forced[0].startswith("different models")


def test_a_report_of_the_format_before_cost_and_model_were_recorded():
    """What bench -o wrote before this change: no model, image, nodes or cost, points without cost."""
    old = load(ONE)
    for key in ("model", "image", "nodes", "cost", "pick"):
        old.pop(key)
    for p in old["points"]:
        p.pop("cost")
    found = compare.compare(reports(old, load(FOUR)), None)
    base = found.reports[0]
    assert base.model is None and base.image is None and base.costing is None
    assert found.rows[0].values[0] is not None and found.rows[0].values[0][compare.COST_KEY] is None
    assert found.verdict.best is not None
    with pytest.raises(InputError, match=r"--pick cost needs a price for r0\.json"):
        compare.compare(reports(old, load(FOUR)), None, pick="cost")


def test_cli_compares_prints_what_each_run_was_measured_on_and_plots(tmp_path):
    png, saved = tmp_path / "compare.png", tmp_path / "compare.json"
    done = run_cli(
        "bench", "compare", str(ONE), str(FOUR), "--plot", str(png), "-o", str(saved), env={"COLUMNS": "250"}
    )
    assert done.returncode == 0, done.stderr
    for expected in (
        "measured on",
        "report-max-num-seqs-1.json",
        "m31ctl/vllm-cpu:0.32.0",
        "verdict: at no SLO",
    ):
        assert expected in done.stdout
    a = load(ONE)
    assert a["plan_hash"] in done.stdout and a["measured_at"] in done.stdout
    assert png.stat().st_size > 10_000
    data = json.loads(saved.read_text())
    assert [r["report"] for r in data["reports"]] == [
        "report-max-num-seqs-1.json",
        "report-max-num-seqs-4.json",
    ]
    assert data["verdict"]["best"] in ("report-max-num-seqs-1.json", "report-max-num-seqs-4.json")
    assert data["points"][0]["change_vs"] == "report-max-num-seqs-1.json"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"checks": []}, "not a bench report"),
        ({"workload": "chat", "points": [{"concurrency": 1}]}, "a point of this bench report cannot be read"),
        ("[[[", "bench report"),
    ],
)
def test_cli_refuses_what_is_not_a_bench_report(tmp_path, content, message):
    bad = tmp_path / "bad.json"
    bad.write_text(content if isinstance(content, str) else json.dumps(content))
    done = run_cli("bench", "compare", str(ONE), str(bad))
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_cli_needs_two_reports_and_a_same_workload(tmp_path):
    done = run_cli("bench", "compare", str(ONE))
    assert done.returncode == 2 and "at least two reports" in done.stderr
    agentic = tmp_path / "agentic.json"
    agentic.write_text(json.dumps({**load(FOUR), "workload": "agentic"}))
    done = run_cli("bench", "compare", str(ONE), str(agentic))
    assert done.returncode == 2 and "different workloads" in done.stderr and "--force" in done.stderr
    assert run_cli("bench", "compare", str(ONE), str(agentic), "--force").returncode == 0


def test_a_pd_groups_report_compares_with_an_aggregated_one():
    """A bench report of a P/D group carries each point's kv_transfer (decode's counters): it
    compares with an aggregated server's report like any other, its figures kept."""
    pd = load(FOUR)
    moved = {"nixl_exported": True, "transfers": 32, "bytes_transferred": 6.0e6, "failed_transfers": 0,
             "external_prompt_tokens": 2623, "local_prompt_tokens": 0, "cached_prompt_tokens": 128}  # fmt: skip
    for p in pd["points"]:
        p["kv_transfer"] = moved
    found = compare.compare(reports(load(ONE), pd), None)
    assert found.verdict.best is not None and len(found.reports) == 2
    (point, *_) = figures_of(pd)
    assert point.kv_transfer is not None and point.kv_transfer.external_prompt_tokens == 2623


def figures_of(report):  # type: ignore[no-untyped-def]
    from m31ctl.served.figures import point_from_json

    return [point_from_json(p) for p in report["points"]]
