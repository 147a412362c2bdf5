"""m31ctl bench, fast: the frontier and the SLO pick on fixed figures, a point from a real
`vllm bench serve` result, speculative decoding from a real /metrics capture (vLLM's ngram
drafter on the CPU build), the workloads, the sweep through fake seams, the profile read back by
`m31ctl plan -f`, and the JSONL reader that stands in for pandas."""

from __future__ import annotations

import importlib.util
import itertools
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from m31ctl.errors import InputError
from m31ctl.served import figures, profile, spec_decode, sweep, workloads
from m31ctl.served.figures import Limit
from tests.conftest import FIXTURES, ROOT, run_cli, run_cli_process
from tests.support import cli_json
from tests.support.bench import point

BENCH = FIXTURES / "bench"


# Per-user speed falls and per-GPU throughput rises with concurrency, until c=64 saturates:
# c=32 beats it on both axes. c=12 is beaten by c=8 (a noisy point).
SWEEP = [
    point(1, 200, 400),
    point(4, 150, 1200),
    point(8, 110, 2000),
    point(12, 100, 1900),
    point(16, 80, 2800),
    point(32, 50, 3600),
    point(64, 40, 3500),
]


def test_frontier_keeps_the_points_no_other_beats_on_both_axes():
    assert figures.frontier(SWEEP) == (1, 4, 8, 16, 32)


def test_frontier_leaves_out_points_whose_requests_failed():
    broken = [*SWEEP, point(128, 300, 9000, completed=500, failed=12)]
    assert figures.frontier(broken) == (1, 4, 8, 16, 32)


def test_frontier_with_equal_points_keeps_both():
    assert figures.frontier([point(1, 100, 100), point(2, 100, 100)]) == (1, 2)


def test_slo_picks_highest_per_gpu_throughput_and_says_why_neighbours_fail():
    slo = figures.parse_slo("ttft_p99_ms=5000,tpot_p99_ms=20")  # 1200/per_user <= 20: per-user >= 60
    choice = figures.pick(SWEEP, slo)
    assert choice.point is not None and choice.point.concurrency == 16
    reasons = dict(choice.neighbours)
    assert reasons[12].startswith("meets the SLO at 1900 tok/s/GPU, below 2800")
    assert reasons[32] == "fails: p99 TPOT 24 ms > 20 ms"
    assert "meets the SLO" in choice.reason


def test_slo_met_by_no_point_names_the_closest():
    slo = figures.parse_slo("ttft_p99_ms=50")  # every point has p99 TTFT >= 100 ms
    choice = figures.pick(SWEEP, slo)
    assert choice.point is None and choice.closest is not None
    assert choice.closest.concurrency == 1
    assert choice.reason == "no point meets the SLO; closest: concurrency 1 (p99 TTFT 100 ms > 50 ms)"


def test_no_slo_picks_the_highest_per_gpu_throughput_of_complete_points():
    broken = [*SWEEP, point(128, 300, 9000, completed=500, failed=12)]
    choice = figures.pick(broken, ())
    assert choice.point is not None and choice.point.concurrency == 32
    assert dict(choice.neighbours) == {16: "2800 tok/s/GPU, below 3600", 64: "3500 tok/s/GPU, below 3600"}
    alone = figures.pick([point(128, 300, 9000, completed=500, failed=12)], ())
    assert alone.point is None and alone.reason.endswith("concurrency 128 (12 of 512 requests failed)")


def test_a_lower_bound_on_per_user_speed():
    choice = figures.pick(SWEEP, figures.parse_slo("min_tok_s_per_user=100"))
    assert choice.point is not None and choice.point.concurrency == 8
    assert dict(choice.neighbours)[12] == "meets the SLO at 1900 tok/s/GPU, below 2000"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("ttft=5", "unknown key 'ttft'"),
        ("ttft_p99_ms=-1", "not a positive number"),
        ("ttft_p99_ms", "not a positive number"),
        ("ttft_p99_ms=nan", "not a positive number"),
        ("ttft_p99_ms=1,ttft_p99_ms=2", "given twice"),
        (" , ", "empty"),
    ],
)
def test_bad_slo_is_bad_input(text, message):
    with pytest.raises(InputError, match=message):
        figures.parse_slo(text)


def test_goodput_gets_the_tightest_limit_per_metric():
    slo = figures.parse_slo("ttft_p50_ms=100,ttft_p99_ms=400,tpot_p99_ms=30,min_tok_s_per_user=10")
    assert figures.goodput_args(slo) == ["ttft:100", "tpot:30"]


def test_regressions_against_a_baseline_point_by_point():
    before = [p.to_json() for p in SWEEP]
    now = [SWEEP[0], SWEEP[1]._replace(tok_s_per_gpu=600.0), SWEEP[2]._replace(ttft_p99_ms=2000.0)]
    worse, compared = figures.regressions(now, before, 0.25)
    assert compared == 3
    assert worse == (
        "concurrency 4: tok_s_per_gpu 1200 -> 600 (-50%)",
        "concurrency 8: ttft_p99_ms 800 -> 2000 (+150%)",
    )


# --- real captures --------------------------------------------------------------------------
def test_spec_decode_from_metrics_matches_vllm_own_report():
    """The per-point delta of the counters gives what `vllm bench serve` printed for that run."""
    before = spec_decode.spec_counters((BENCH / "metrics-ngram-before.txt").read_text())
    after = spec_decode.spec_counters((BENCH / "metrics-ngram-after.txt").read_text())
    spec = spec_decode.spec_figures(before, after)
    vllm_says = json.loads((BENCH / "vllm-bench-result-ngram.json").read_text())
    assert spec is not None
    assert spec.drafts == vllm_says["spec_decode_num_drafts"] == 141
    assert spec.draft_tokens == vllm_says["spec_decode_draft_tokens"]
    assert spec.accepted_tokens == vllm_says["spec_decode_accepted_tokens"]
    assert spec.acceptance_length == pytest.approx(vllm_says["spec_decode_acceptance_length"], abs=1e-4)
    assert spec.per_position == pytest.approx(
        vllm_says["spec_decode_per_position_acceptance_rates"], abs=1e-4
    )


def test_no_spec_counters_without_speculative_decoding():
    assert spec_decode.spec_counters('vllm:num_requests_running{engine="0"} 0.0\n') is None
    assert spec_decode.spec_figures(None, None) is None
    same = spec_decode.spec_counters((BENCH / "metrics-ngram-after.txt").read_text())
    assert spec_decode.spec_figures(same, same) is None  # no draft in between


def test_point_from_a_real_vllm_bench_result():
    result = json.loads((BENCH / "vllm-bench-result-ngram.json").read_text())
    p = figures.point_from_result(2, 8, result, gpus=4, spec=None)
    assert p.complete and p.completed == 8
    assert p.tok_s_per_user == pytest.approx(1000 / result["mean_tpot_ms"], rel=1e-3)
    assert p.tok_s_per_gpu == pytest.approx(result["total_token_throughput"] / 4, rel=1e-3)
    assert p.ttft_p99_ms == result["p99_ttft_ms"] and p.tpot_p50_ms == result["median_tpot_ms"]
    assert p.mean_output_tokens == 64
    assert p.goodput_share == pytest.approx(
        result["request_goodput"] / result["request_throughput"], abs=1e-3
    )


# --- workloads ------------------------------------------------------------------------------
def fake_meter() -> workloads.Meter:
    """An exact counter that behaves like a tokenizer: 4 characters a token, 7 of template."""
    return workloads.calibrate(lambda text: 7 + len(text) // 4)


SIZING = workloads.Sizing(input_len=256, output_len=32, max_model_len=4096)


@pytest.mark.parametrize("name", workloads.WORKLOADS)
def test_workloads_are_seeded_and_fit_the_context(name):
    meter = fake_meter()
    made = workloads.build(name, 12, 4, SIZING, meter, seed=7)
    again = workloads.build(name, 12, 4, SIZING, meter, seed=7)
    other = workloads.build(name, 12, 4, SIZING, meter, seed=8)
    assert made == again and made != other
    assert len(made.requests) == 12
    for request in made.requests:
        assert meter.measure(request.prompt) + request.output_tokens <= SIZING.max_model_len
    lines = [json.loads(line) for line in made.jsonl().splitlines()]
    assert [set(line) for line in lines] == [{"prompt", "output_tokens"}] * 12


def test_chat_prompts_are_natural_language_around_the_input_length():
    made = workloads.build("chat", 40, 4, SIZING, fake_meter(), seed=0)
    lengths = [fake_meter().measure(r.prompt) for r in made.requests]
    assert min(lengths) >= 20 and 150 <= sum(lengths) / len(lengths) <= 450
    assert len({r.prompt for r in made.requests}) > 30
    assert all(r.output_tokens == 32 for r in made.requests)
    words = " ".join(r.prompt for r in made.requests).split()
    assert sum(w.isalpha() for w in words) / len(words) > 0.8  # words, not token ids


def test_agentic_sessions_share_a_long_prefix_that_grows_each_turn():
    made = workloads.build("agentic", 12, 3, SIZING, fake_meter(), seed=0)
    assert made.sessions == 3
    prompts = [r.prompt for r in made.requests]
    system = prompts[0].split("\n\nSession 1,")[0]
    assert len(system) > 2000 and all(p.startswith(system) for p in prompts)
    # Round-robin: session s's turn t is request t * 3 + s, and extends its turn t - 1.
    for s in range(3):
        turns = prompts[s::3]
        assert all(
            later.startswith(earlier.rsplit("\nUser: Carry on", 1)[0])
            for earlier, later in itertools.pairwise(turns)
        )
        assert [len(t) for t in turns] == sorted(len(t) for t in turns)


def test_long_context_fills_the_max_length_with_short_outputs():
    meter = fake_meter()
    made = workloads.build("long-context", 3, 1, SIZING, meter, seed=0)
    budget = SIZING.budget(made.requests[0].output_tokens)
    for request in made.requests:
        used = meter.measure(request.prompt)
        assert budget * 0.9 <= used <= budget
        assert request.output_tokens <= 64 and request.prompt.rstrip().endswith("say why.")
    assert len({r.prompt[:2000] for r in made.requests}) == 3  # no shared prefix beyond the intro


def test_smaller_points_reuse_the_first_requests():
    meter = fake_meter()
    small = workloads.build("chat", 4, 1, SIZING, meter, seed=0)
    large = workloads.build("chat", 16, 4, SIZING, meter, seed=0)
    assert large.requests[:4] == small.requests


def test_without_a_server_count_estimates_stay_inside():
    meter = workloads.calibrate(None)
    assert not meter.exact
    made = workloads.build("long-context", 1, 1, workloads.Sizing(32, 8, 2048), meter, seed=0)
    assert meter.measure(made.requests[0].prompt) <= 2048 - 8


# --- the sweep through fake seams -----------------------------------------------------------
class FakeServer:
    def __init__(self) -> None:
        self.scrapes = [(BENCH / f"metrics-ngram-{w}.txt").read_text() for w in ("before", "after")]

    def tokens(self, text: str) -> int | None:
        return 7 + len(text) // 4

    def metrics(self) -> str:
        return self.scrapes.pop(0) if self.scrapes else ""


def test_sweep_runs_one_benchmark_per_point_and_picks(tmp_path):
    from m31ctl.hardware import simulated
    from m31ctl.plan import PlanRequest, resolve

    plan = resolve(PlanRequest(simulated("cpu"), sets=("model.path=/models/tiny",)))
    result = json.loads((BENCH / "vllm-bench-result-ngram.json").read_text())
    seen: list[list[str]] = []

    def runner(args: list[str]) -> dict[str, Any]:
        seen.append(args)
        dataset = Path(args[args.index("--dataset-path") + 1])
        assert len(dataset.read_text().splitlines()) == int(args[args.index("--num-prompts") + 1])
        if args[args.index("--max-concurrency") + 1] == "4":
            raise RuntimeError("server went away")
        return result

    events: list[sweep.Event] = []
    request = sweep.SweepRequest(
        "http://h:1", "agentic", (1, 2, 4), 8, 16, figures.parse_slo("tpot_p99_ms=1000"), plan.gpus_needed
    )
    found = sweep.run(plan, request, FakeServer(), runner, tmp_path, events.append)
    assert [(e.kind, e.concurrency) for e in events] == [
        ("start", 1), ("point", 1), ("start", 2), ("point", 2), ("start", 4), ("point", 4),
    ]  # fmt: skip
    assert (
        len(seen) == 3 and "--goodput" in seen[0] and seen[0][seen[0].index("--goodput") + 1] == "tpot:1000"
    )
    assert found.points[0].spec is not None and found.points[0].spec.drafts == 141  # counters moved
    assert found.points[1].spec is None  # no scrape moved for the second point
    assert (
        found.points[2].error == "vllm bench serve did not run: server went away"
        and not found.points[2].complete
    )
    assert found.choice.point is not None and found.choice.point.concurrency in (1, 2)
    assert found.token_counts == "server"
    assert json.loads(json.dumps(found.to_json()))["points"][2]["frontier"] is False


# --- the profile ----------------------------------------------------------------------------
def test_profile_is_a_layer_file_whose_provenance_plan_explain_shows(tmp_path):
    chosen = point(16, 80, 2800)._replace(ttft_p99_ms=1600.0, output_tok_s=700.0)
    slo = figures.parse_slo("tpot_p99_ms=20")
    origin = profile.provenance("host-a (machine 1234abcd, 4x B300)", datetime(2026, 1, 2, 3, 4))
    path = tmp_path / "measured.yaml"
    path.write_text(profile.profile_yaml(chosen, "chat", slo, origin))
    shown = run_cli("plan", "--hardware", "cpu", "-f", str(path), "--json")
    assert shown.returncode == 0, shown.stderr
    plan = cli_json.data(shown.stdout)
    assert plan["settings"]["serving"]["max_num_seqs"] == 16
    verify = plan["settings"]["verify"]
    assert verify["concurrency"] == 16 and verify["tpot_p99_ms"] == 20  # the SLO's own limit
    assert verify["ttft_p99_ms"] == 2000.0  # measured, with 25% headroom
    assert verify["min_output_throughput"] == 525.0
    source = plan["provenance"]["serving.max_num_seqs"]
    assert (
        source
        == f"measured by m31ctl bench on host-a (machine 1234abcd, 4x B300), 2026-01-02 03:04 ({path}:6)"
    )
    explained = run_cli("plan", "--hardware", "cpu", "-f", str(path), "--explain", env={"COLUMNS": "400"})
    assert "measured by m31ctl bench on host-a" in explained.stdout


def test_provenance_must_be_text(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("provenance: [1, 2]\nserving:\n  max_num_seqs: 4\n")
    shown = run_cli("plan", "--hardware", "cpu", "-f", str(path))
    assert shown.returncode == 2 and "provenance must be a line of text" in shown.stderr


def test_host_fingerprint_names_host_machine_and_devices(tmp_path):
    from m31ctl.hardware import simulated

    machine_id = tmp_path / "machine-id"
    machine_id.write_text("0123456789abcdef\n")
    found = profile.host_fingerprint(simulated("b300x4"), machine_id)
    assert "(machine " in found and "4x " in found and "B300" in found


def test_max_num_seqs_is_per_data_parallel_rank():
    text = profile.profile_yaml(
        point(64, 40, 3500), "chat", (), "measured by m31ctl bench on h, d", data_parallel=4
    )
    assert "  max_num_seqs: 16\n" in text and "  concurrency: 64\n" in text


def test_pass_marks_carry_acceptance_length_when_speculating():
    spec = spec_decode.SpecFigures(10, 30, 20, 3.0, (1.0, 0.6, 0.4))
    marks = profile.pass_marks(point(4, 100, 1000, spec=spec), ())
    assert marks["min_acceptance_length"] == 2.25


# --- the CLI's refusals -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "1,x"], "--concurrency 'x'"),
        (["--concurrency", "0"], "--concurrency '0'"),
        (["--workload", "batch"], "unknown --workload 'batch'"),
        (["--slo", "speed=3"], "unknown key 'speed'"),
        (["--plot", "frontier"], "--plot frontier"),
        (["--requests", "0"], "--requests 0"),
        ([], "--url needs --bench-python"),
    ],
)
def test_bad_bench_options_exit_2(args, message):
    done = run_cli("bench", "--hardware", "cpu", "--url", "http://127.0.0.1:9", *args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_baseline_must_be_a_bench_report_of_the_same_workload(tmp_path):
    path = tmp_path / "verify.json"
    path.write_text(json.dumps({"checks": []}))
    done = run_cli("bench", "--hardware", "cpu", "--url", "http://127.0.0.1:9", "--baseline", str(path))
    assert done.returncode == 2 and "not a bench report" in done.stderr
    path.write_text(json.dumps({"workload": "chat", "points": []}))
    done = run_cli(
        "bench", "--hardware", "cpu", "--url", "http://h:9", "--baseline", str(path), "--workload", "agentic"
    )
    assert done.returncode == 2 and "the baseline measured workload 'chat'" in done.stderr


# --- the JSONL reader that stands in for pandas -----------------------------------------------
def test_jsonl_reader_gives_what_vllm_custom_dataset_asks_of_pandas(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "bench_jsonl", ROOT / "m31ctl" / "engine" / "bench_jsonl.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    made = workloads.build("chat", 3, 1, SIZING, fake_meter(), seed=0)
    path = tmp_path / "d.jsonl"
    path.write_text(made.jsonl())
    frame = module.read_json(path_or_buf=str(path), lines=True)
    assert "prompt" in frame.columns and "output_tokens" in frame.columns
    rows = [row.to_dict() for _, row in frame.iterrows()]
    assert rows == [{"prompt": r.prompt, "output_tokens": r.output_tokens} for r in made.requests]
    with pytest.raises(NotImplementedError):
        module.read_json(str(path))


def test_limit_descriptions():
    p = point(4, 50, 1000)
    assert Limit("tpot_p99_ms", 20).describe(p) == "p99 TPOT 24 ms > 20 ms"
    assert Limit("min_tok_s_per_user", 40).describe(p) == "per-user speed 50 tok/s >= 40 tok/s"
    assert (
        Limit("e2el_p99_ms", 10).describe(p._replace(e2el_p99_ms=None))
        == "p99 end-to-end latency not measured"
    )


# --- a benchmark that cannot run (issue 43, item 8) -------------------------------------------
def test_a_benchmark_that_cannot_run_says_why_and_writes_no_plot(tmp_path):
    """A Python without vLLM as the benchmark's: every point fails for one reason, which the text
    output names (it was only in --json), with no raw matplotlib warning and no empty plot."""
    import sys

    png = tmp_path / "b.png"
    done = run_cli_process(
        "bench", "--hardware", "cpu", "--url", "http://127.0.0.1:9", "--bench-python", sys.executable,
        "--concurrency", "1,2", "--requests", "4", "--plot", str(png),
    )  # fmt: skip
    text = done.stdout + done.stderr
    assert done.returncode == 1, text
    assert (
        "error: concurrency 1, 2 not measured: vllm bench serve did not run: ModuleNotFoundError"
        in done.stdout
    )
    assert "concurrency 1: not measured: vllm bench serve did not run: ModuleNotFoundError" in done.stderr
    assert "No module named 'vllm'" in done.stdout and "['" not in done.stdout  # one line, not a list
    assert "Warning" not in text and "Traceback" not in text
    assert not png.exists() and f"plot: {png} not written: no point was measured" in done.stdout


def test_plots_draw_without_warnings_and_a_burst_gets_a_log_axis(tmp_path):
    """A CPU stream whose tokens arrive in one burst reads ~1e5 tok/s/user: the per-user axis turns
    logarithmic so that the other points are not crowded against zero. No matplotlib warning."""
    import warnings

    pytest.importorskip("matplotlib")
    from m31ctl.cli import bench_plot
    from m31ctl.served.cost import Costing, Price

    points = (point(1, 150_000, 800), point(2, 400, 1600), point(4, 250, 2400))
    slo = figures.parse_slo("tpot_p99_ms=10")
    found = sweep.Sweep(
        "http://h:1", "abc", "chat", 1, 0, slo, points, figures.frontier(points), figures.pick(points, slo),
        (), "server", 1.0,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bench_plot.draw(found, "t", tmp_path / "one.png", Costing(Price(2.0, "gpu", "USD"), 1, 1))
    assert (tmp_path / "one.png").stat().st_size > 10_000
    plt = bench_plot.pyplot()
    fig, ax = plt.subplots()
    axis = bench_plot._speed_axis(ax, [p.tok_s_per_user for p in points])
    assert axis.log and ax.get_xscale() == "log" and 0 < axis.share(400) < axis.share(150_000) < 1
    plt.close(fig)
    fig, ax = plt.subplots()
    assert not bench_plot._speed_axis(ax, [100.0, 400.0]).log
    plt.close(fig)


# --- verify's load is one point of the sweep's benchmark ----------------------------------------
def test_verify_load_runs_the_sweeps_benchmark_with_verify_settings():
    """verify's `vllm bench serve` comes from bench's builder: vLLM's random prompts of the plan's
    verify lengths, its request count and concurrency, the pass marks as --goodput; and its pass
    marks read vLLM's result through the same figure names as bench's points."""
    from m31ctl.hardware import simulated
    from m31ctl.plan import PlanRequest, resolve
    from m31ctl.served import verify_load
    from m31ctl.served.verified import VerifyReport

    sets = ("model.path=/models/tiny", "verify.ttft_p99_ms=500", "verify.min_output_throughput=1")
    plan = resolve(PlanRequest(simulated("cpu"), sets=sets))
    v = plan.settings.verify
    result = json.loads((BENCH / "vllm-bench-result-ngram.json").read_text())
    seen: list[list[str]] = []

    def runner(args: list[str]) -> dict[str, Any]:
        seen.append(args)
        return {**result, "completed": v.requests, "failed": 0}

    report = VerifyReport("http://h:1", plan.hash)
    verify_load.check_load(plan, "http://h:1", runner, report)
    (args,) = seen
    flag = {a: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    assert flag["--dataset-name"] == "random" and flag["--random-input-len"] == str(v.input_len)
    assert flag["--random-output-len"] == str(v.output_len) and flag["--num-prompts"] == str(v.requests)
    assert flag["--max-concurrency"] == str(v.concurrency) and flag["--goodput"] == "ttft:500"
    assert flag["--seed"] == "0"  # vLLM's default: the run verify made before it shared the builder
    checks = {c.id: c for c in report.checks}
    point = figures.point_from_result(v.concurrency, v.requests, result, 1, None)
    assert checks["ttft-p99"].status == ("ok" if point.ttft_p99_ms <= 500 else "fail")
    assert checks["ttft-p99"].message.startswith(f"p99_ttft_ms {point.ttft_p99_ms:.4g}")
    assert checks["output-throughput"].status == "ok" and checks["tpot-p99"].status == "skip"
    assert report.bench is not None and report.bench["p99_ttft_ms"] == result["p99_ttft_ms"]


def test_verify_reads_every_vllm_key_through_the_one_map():
    """verify's check ids and the keys its report keeps come from figures.VLLM_KEY, and are the
    ones saved reports and CI read (tests/fixtures/gpu/*/verify-*.json)."""
    from m31ctl.served import verify_load

    assert [figures.check_id(f) for f, _ in verify_load.PASS_MARKS] == [
        "ttft-p99",
        "tpot-p99",
        "output-throughput",
    ]
    assert [figures.VLLM_KEY[f] for f in verify_load.BENCH_FIGURES] == [
        "completed", "failed", "duration", "request_throughput", "request_goodput", "output_throughput",
        "mean_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "p99_itl_ms", "p99_e2el_ms",
    ]  # fmt: skip


def test_one_comparator_for_verify_and_bench_regressions():
    before = {"p99_ttft_ms": 100.0, "output_throughput": 50.0, "p99_tpot_ms": None}
    now = {"p99_ttft_ms": 140.0, "output_throughput": 30.0, "p99_tpot_ms": 5.0}

    def key(figure: str) -> str:
        return figures.VLLM_KEY[figure]

    worse, compared = figures.worse(
        lambda f: before.get(key(f)), lambda f: now.get(key(f)), figures.VERIFY_REGRESSION, 0.25, key
    )
    assert compared == ["ttft_p99_ms", "output_tok_s"]  # p99_tpot_ms was not measured before
    assert worse == ["p99_ttft_ms 100 -> 140 (+40%)", "output_throughput 50 -> 30 (-40%)"]


def test_the_engines_metrics_of_a_pd_group_m31ctl_runs_are_decodes():
    """verify and bench read the engine's /metrics from a P/D group's decode role, behind the
    router; a server named by --url alone (no recorded hash) is read where it answers."""
    from m31ctl.deployment import derive
    from m31ctl.hardware import simulated
    from m31ctl.plan import PlanRequest, resolve
    from m31ctl.served.target import Target

    pair = derive(resolve(PlanRequest(simulated("cpu"), variant="pd")))
    assert pair.disaggregated is not None
    runs = Target(pair, "http://127.0.0.1:8000", pair.plan.hash, None, None)
    assert runs.engine_base == pair.disaggregated.decode.network.local_url != runs.base
    assert Target(pair, "http://far:8000", None, None, None).engine_base == "http://far:8000"
    alone = derive(resolve(PlanRequest(simulated("cpu"))))
    assert (
        Target(alone, "http://127.0.0.1:8000", alone.plan.hash, None, None).engine_base
        == "http://127.0.0.1:8000"
    )
