"""bench's cost figures: the stated formula checked by hand against a real report's own numbers
(a sweep on the CPU rehearsal, scripts/bench_compare_example.py, priced at 2.50 USD per
GPU-hour), node-hour pricing, the price's refusals, the pick by cost, and the price and date the
profile records."""

from __future__ import annotations

import json
from datetime import datetime

import pytest

from m31ctl.errors import InputError
from m31ctl.served import cost, figures, profile
from m31ctl.served.cost import Costing, Price
from tests.conftest import FIXTURES, run_cli
from tests.support import cli_json
from tests.support.bench import point

REPORT = FIXTURES / "bench" / "report-max-num-seqs-1.json"


def test_report_cost_follows_from_its_own_throughput_by_the_formula():
    """Per point: price x GPUs an hour, over the tokens that hour processes at the measured rate."""
    report = json.loads(REPORT.read_text())
    priced = report["cost"]
    assert (priced["price"], priced["unit"], priced["currency"], priced["gpus"]) == (2.5, "gpu", "USD", 1)
    hourly = 2.5 * report["gpus"]
    assert priced["per_hour"] == hourly
    assert len(report["points"]) == 3
    for p in report["points"]:
        by_hand = {
            "per_million_output": hourly / (p["output_tok_s"] * 3600) * 1_000_000,
            "per_million_total": hourly / (p["total_tok_s"] * 3600) * 1_000_000,
            "tokens_per_unit": p["total_tok_s"] * 3600 / hourly,
        }
        for key, expected in by_hand.items():
            assert p["cost"][key] == pytest.approx(expected, rel=1e-5), (p["concurrency"], key)
            assert priced["points"][str(p["concurrency"])][key] == p["cost"][key]
    assert "excludes idle time, power, networking" in priced["formula"]
    assert priced["assumed_at"] == report["measured_at"][:10]


def test_cost_per_million_is_the_gpu_hour_over_per_gpu_throughput():
    """The same figure read per GPU: one GPU-hour over the tokens one GPU processes in it."""
    p = point(4, 100, 2000)._replace(total_tok_s=8000.0, tok_s_per_gpu=2000.0, output_tok_s=1000.0)
    priced = Costing(Price(3.0, "gpu", "EUR"), gpus=4, nodes=1)
    assert priced.per_hour == 12.0
    assert priced.per_million_total(p) == pytest.approx(3.0 / (2000 * 3600) * 1e6)
    assert priced.per_million_output(p) == pytest.approx(12.0 / (1000 * 3600) * 1e6)
    assert priced.tokens_per_unit(p) == pytest.approx(8000 * 3600 / 12.0)


def test_node_hour_prices_the_nodes_the_layout_spans():
    p = point(4, 100, 2000)._replace(output_tok_s=1000.0)
    priced = Costing(Price(40.0, "node", "USD"), gpus=16, nodes=2)
    assert priced.per_hour == 80.0
    assert priced.per_million_output(p) == pytest.approx(80.0 / 3.6)


def test_a_pd_deployment_is_priced_on_both_roles_gpus():
    """A P/D pair on b300x8 serves on prefill's 4 GPUs and decode's 4: the plan's own layout
    (gpus_needed) counts one role's; cost and per-GPU throughput divide by all eight."""
    from m31ctl.deployment import derive
    from m31ctl.hardware import simulated
    from m31ctl.plan import PlanRequest, resolve

    pair = derive(resolve(PlanRequest(simulated("b300x8"), sets=("disaggregation.enabled=true",))))
    assert pair.plan.gpus_needed == 4 and pair.serving_gpus == 8 and pair.serving_nodes == 1
    priced = cost.deployment_costing(pair, Price(2.0, "gpu", "USD"))
    assert priced is not None and (priced.gpus, priced.nodes, priced.per_hour) == (8, 1, 16.0)
    alone = derive(resolve(PlanRequest(simulated("b300x8"))))
    assert (alone.serving_gpus, alone.serving_nodes) == (alone.plan.gpus_needed, 1)


def test_nothing_measured_costs_nothing_known():
    failed = figures.failed_point(4, 16, "vllm bench serve did not run: x")
    priced = Costing(Price(2.0, "gpu", "USD"), 1, 1)
    assert priced.figures(failed) == {
        "per_million_output": None,
        "per_million_total": None,
        "tokens_per_unit": None,
    }


@pytest.mark.parametrize(
    ("gpu", "node", "currency", "message"),
    [
        (2.0, 20.0, "USD", "--gpu-hour and --node-hour are both given"),
        (0.0, None, "USD", "--gpu-hour 0 is not a positive price"),
        (None, -1.0, "USD", "--node-hour -1 is not a positive price"),
        (float("nan"), None, "USD", "is not a positive price"),
        (2.0, None, "US D", "is not a currency code"),
        (2.0, None, "", "is not a currency code"),
    ],
)
def test_bad_prices_are_bad_input(gpu, node, currency, message):
    with pytest.raises(InputError, match=message):
        cost.parse_price(gpu, node, currency)


def test_no_price_no_cost():
    assert cost.parse_price(None, None, "USD") is None


def test_pick_by_cost_takes_the_cheapest_output_tokens_meeting_the_slo():
    """c=8 processes more tokens per GPU (long inputs), c=4 more output: by cost c=4 wins."""
    points = [
        point(4, 100, 2000)._replace(output_tok_s=900.0),
        point(8, 90, 2400)._replace(output_tok_s=600.0),
        point(16, 20, 3000)._replace(output_tok_s=1200.0),  # fails the SLO
    ]
    slo = figures.parse_slo("min_tok_s_per_user=50")
    priced = Costing(Price(2.0, "gpu", "USD"), 1, 1)
    assert figures.pick(points, slo).point.concurrency == 8  # type: ignore[union-attr]
    by_cost = figures.pick(points, slo, priced.objective())
    assert by_cost.point is not None and by_cost.point.concurrency == 4
    assert by_cost.reason.startswith("lowest cost per million output tokens (0.6173 USD per million output")
    assert dict(by_cost.neighbours)[8] == (
        "meets the SLO at 0.9259 USD per million output tokens, above 0.6173"
    )


def test_profile_records_the_price_and_the_date(tmp_path):
    chosen = point(4, 100, 2000)._replace(output_tok_s=900.0)
    notes = ("cost: assumed 2.5 USD per GPU-hour on 2026-12-01, 2.5 USD/hour for the plan;",)
    origin = profile.provenance("host-a", datetime(2026, 12, 1, 20, 0))
    path = tmp_path / "measured.yaml"
    path.write_text(profile.profile_yaml(chosen, "chat", (), origin, notes=notes))
    assert "# cost: assumed 2.5 USD per GPU-hour on 2026-12-01" in path.read_text()
    shown = run_cli("plan", "--hardware", "cpu", "-f", str(path), "--json")
    assert shown.returncode == 0, shown.stderr  # still a plain layer file
    assert cli_json.data(shown.stdout)["settings"]["serving"]["max_num_seqs"] == 4


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pick", "cost"], "--pick cost needs a price"),
        (["--pick", "cheap"], "unknown --pick 'cheap'"),
        (["--gpu-hour", "-2"], "--gpu-hour -2 is not a positive price"),
        (["--gpu-hour", "2", "--node-hour", "9"], "both given"),
    ],
)
def test_bad_cost_options_exit_2(args, message):
    done = run_cli("bench", "--hardware", "cpu", "--url", "http://127.0.0.1:9", *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_plot_labels_carry_the_cost():
    from m31ctl.cli.bench_plot import point_label

    p = point(4, 100, 2000)._replace(output_tok_s=900.0)
    assert point_label(p, None) == "c=4"
    assert point_label(p, Costing(Price(2.0, "gpu", "USD"), 1, 1)) == "c=4, 0.617 USD/M"


def test_the_readmes_worked_example_follows_from_the_capture():
    """The guide's cost example (docs/guide.md, README's until issue 51): the H200 capture's
    concurrency-4 point at 2.50 USD per GPU-hour."""
    report = json.loads((FIXTURES / "gpu" / "h200-vllm026" / "bench-fp8graphs-u0.1.json").read_text())
    (p,) = [point for point in report["points"] if point["concurrency"] == 4]
    priced = Costing(Price(2.5, "gpu", "USD"), gpus=report["gpus"], nodes=1)
    measured = figures.Point(**{k: v for k, v in p.items() if k in figures.Point._fields and k != "spec"})
    readme = " ".join((FIXTURES.parent.parent / "docs" / "guide.md").read_text().split())
    assert f"**{priced.per_million_output(measured):.4g} USD per million output tokens**" in readme
    assert f"**{priced.per_million_total(measured):.4g} per million total**" in readme
    assert f"**{priced.tokens_per_unit(measured) / 1e6:.4g} million tokens per USD**" in readme
