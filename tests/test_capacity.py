"""The memory model reproduces the published comparison from one set of assumptions."""

from __future__ import annotations

import pytest

from m31ctl.capacity.fit import memory_inputs, plan_fit
from m31ctl.capacity.model import Layout, parse_context, resident_sequences
from m31ctl.errors import InputError
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.plan.recipes import get_model

CTX_256K = 262144


def plan_for(hw: str, **kw):  # type: ignore[no-untyped-def]
    return resolve(PlanRequest(hardware=simulated(hw), **kw))


def test_published_figures_on_4x_b300_dep4():
    plan = plan_for("b300x4", profile="throughput")
    assert plan_fit(plan, CTX_256K).sequences == 76
    m3 = memory_inputs(plan, get_model("minimax-m3-mxfp8"), "fp8")
    assert resident_sequences(m3, Layout(tensor=1, data=4, expert=True), CTX_256K).sequences == 28


@pytest.mark.parametrize("reserve", [8, 10, 14])
def test_published_figures_hold_across_the_documented_reserve_band(reserve):
    plan = plan_for("b300x4", profile="throughput", sets=(f"capacity.runtime_reserve_gib={reserve}",))
    assert plan_fit(plan, CTX_256K).sequences == 76
    m3 = memory_inputs(plan, get_model("minimax-m3-mxfp8"), "fp8")
    assert resident_sequences(m3, Layout(tensor=1, data=4, expert=True), CTX_256K).sequences == 28


def test_kv_bytes():
    facts = get_model("minimax-m3.1-flash")
    assert facts.kv_bytes_per_token == {"nvfp4": 34560, "fp8": 61440}
    assert pytest.approx(1 - 0.4375) == 34560 / 61440


def test_more_memory_never_fits_fewer():
    last = -1
    for hw in ["h100x8", "h200x8"]:
        seqs = plan_fit(plan_for(hw), CTX_256K).sequences
        assert seqs >= last
        last = seqs
    assert (
        plan_fit(plan_for("b300x4"), CTX_256K).sequences >= plan_fit(plan_for("b200x4"), CTX_256K).sequences
    )


def test_monotonic_in_context_and_utilization():
    plan = plan_for("b300x4")
    counts = [plan_fit(plan, c).sequences for c in (32768, 65536, 131072, 262144, 524288, 1048576)]
    assert counts == sorted(counts, reverse=True)
    low = plan_for("b300x4", sets=("serving.gpu_memory_utilization=0.8",))
    assert plan_fit(low, CTX_256K).sequences <= plan_fit(plan, CTX_256K).sequences


def test_impossible_layout_does_not_fit():
    plan = plan_for("h100x8", recipe="blackwell", sets=("parallelism.tensor=1",))
    fit = plan_fit(plan, CTX_256K)
    assert not fit.fits and fit.sequences == 0


def test_parse_context():
    assert parse_context("256k") == 262144
    assert parse_context("1M") == 1048576
    assert parse_context("8192") == 8192
    with pytest.raises(InputError):
        parse_context("lots")


def test_longest_context_inverts_resident_sequences():
    from m31ctl.capacity.fit import plan_longest_context

    plan = plan_for("b300x4", profile="throughput")
    longest = plan_longest_context(plan, 76)
    assert longest >= CTX_256K
    assert plan_fit(plan, longest).sequences >= 76
    assert plan_fit(plan, longest + 4096).sequences < 76


def test_comparison_respects_recipe_rules_and_lists_m3():
    from m31ctl.capacity.fit import comparison
    from m31ctl.capacity.fit import profile_layouts as _layouts

    hopper = plan_for("h200x8")
    rows = comparison(hopper, CTX_256K, _layouts(hopper))
    assert {r.kv_dtype for r in rows} == {"fp8"}  # the Hopper recipe forbids an NVFP4 cache
    assert {r.model for r in rows} == {"MiniMax-M3.1-Flash", "MiniMax-M3 (MXFP8)"}


def test_capacity_cli_and_plot(cli, tmp_path):
    import json

    result = cli(
        "capacity",
        "--hardware",
        "b300x4",
        "--profile",
        "throughput",
        "--context",
        "256k",
        "--sequences",
        "76",
        "--json",
        "--plot",
        str(tmp_path / "cap.png"),
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["fit"]["sequences"] == 76 and data["layout"] == "DEP4"
    pairs = {(r["model"], r["layout"]): r["sequences"] for r in data["comparison"]}
    assert pairs[("MiniMax-M3 (MXFP8)", "throughput (DEP4)")] == 28
    assert (tmp_path / "cap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_draws_only_what_the_recipe_allows(tmp_path):
    """The plot draws the comparison's own rows: Hopper's FP8-only rule leaves no NVFP4 line."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from m31ctl.capacity.fit import profile_layouts
    from m31ctl.cli.plot import draw

    plan = resolve(PlanRequest(hardware=simulated("h200x8")))
    labels: list[str] = []
    original = plt.close

    def capture(fig):  # type: ignore[no-untyped-def]
        labels.extend(line.get_label() for ax in fig.axes for line in ax.get_lines())
        original(fig)

    plt.close = capture
    try:
        draw(plan, profile_layouts(plan), tmp_path / "h200.png")
    finally:
        plt.close = original
    assert labels and all("fp8 KV" in label for label in labels)
    assert not any("nvfp4" in label for label in labels)
