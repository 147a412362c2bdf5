"""What a new user meets in the first hour (issue 43): each item a test that failed before its fix."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, run_cli, run_cli_process
from tests.support import cli_json

COMMANDS = ("plan", "probe", "capacity", "render", "lock", "validate", "doctor", "launch", "status", "logs",
            "stop", "smoke", "verify", "bench", "pull", "rehearse", "version")  # fmt: skip


def _lines_fit(text: str, width: int = 80) -> list[str]:
    return [line for line in text.splitlines() if len(line) > width]


# --- 11: completion, version, --quiet, -o -------------------------------------------------------


def test_version_command_and_flag():
    from m31ctl import __version__

    assert run_cli("version").stdout == run_cli("--version").stdout == f"m31ctl {__version__}\n"
    assert cli_json.data(run_cli("version", "--json").stdout) == {"version": __version__}


def test_shell_completion_is_on():
    helped = run_cli("--help", env={"COLUMNS": "80"})
    assert "--install-completion" in helped.stdout and "--show-completion" in helped.stdout
    done = run_cli_process(
        env={"_M31CTL_COMPLETE": "complete_bash", "COMP_WORDS": "m31ctl pl", "COMP_CWORD": "1"}
    )
    assert done.returncode == 0 and done.stdout.split() == ["plan"], done.stdout + done.stderr


@pytest.mark.parametrize("word", ["json", "yaml", "wide", "name"])
def test_o_refuses_a_bare_format_word(tmp_path, word):
    """kubectl's `-o json` is a format; here -o is where m31ctl writes: `render -o json` made ./json."""
    result = run_cli("render", "--target", "k8s", "--hardware", "b300x4", "-o", word, cwd=tmp_path)
    assert result.returncode == 2 and "not an output format" in result.stderr and "--json" in result.stderr
    assert not (tmp_path / word).exists()
    assert run_cli("lock", "--hardware", "b300x4", "-o", word, cwd=tmp_path).returncode == 2
    kept = run_cli("render", "--target", "k8s", "--hardware", "b300x4", "-o", str(tmp_path / word))
    assert kept.returncode == 0 and (tmp_path / word).is_dir()  # a path of that name, said as a path


def test_quiet_leaves_out_progress_lines(capsys):
    from m31ctl.cli import launch_views, output

    try:
        assert run_cli("--quiet", "version").returncode == 0
        assert output.QUIET
        launch_views.reporter()("a progress line")
        assert capsys.readouterr().err == ""
        output.QUIET = False
        launch_views.reporter()("a progress line")
        assert capsys.readouterr().err == "m31ctl: a progress line\n"
    finally:
        output.QUIET = False


def test_quiet_dry_run_prints_no_progress(tmp_path):
    done = run_cli("-q", "stop", "--runtime", "native")
    assert done.returncode == 0 and "m31ctl:" not in done.stderr.replace("nothing to stop", "")


# --- 9: stop ----------------------------------------------------------------------------------


def test_bare_stop_refuses_as_docker_and_kubectl_do():
    result = run_cli("stop")
    assert result.returncode == 2 and "stop needs --name NAME, or --all" in result.stderr
    assert run_cli("stop", "--name", "x", "--all").returncode == 2


def test_stop_all_with_nothing_running_says_so():
    result = run_cli("stop", "--all", "--runtime", "native")
    assert result.returncode == 0 and "nothing to stop" in result.stderr


def test_stop_prints_what_it_stopped(tmp_path):
    """As `docker stop` names what it stopped: "stopped NAME" on stdout, one line a server (the
    native stand-in engine: no Docker)."""
    from tests.support.native import Native

    servers = []
    for tag in ("one", "two"):
        (tmp_path / tag).mkdir()
        servers.append(Native(tmp_path / tag))
    first, second = servers
    second.state = first.state  # one state directory: `--all` finds both
    second.env = {**first.env}
    try:
        for server in servers:
            launched = run_cli(*server.args(), env=server.env)
            assert launched.returncode == 0, launched.stderr
        one = run_cli("stop", "--runtime", "native", "--name", first.name, env=first.env)
        assert one.returncode == 0 and one.stdout == f"stopped {first.name}\n", one.stdout + one.stderr
        assert f"stopping {first.name} (pid" in one.stderr  # progress on stderr, the result on stdout
        every = run_cli("stop", "--all", "--runtime", "native", env=first.env)
        assert every.returncode == 0 and every.stdout == f"stopped {second.name}\n", (
            every.stdout + every.stderr
        )
        assert first.engines() == second.engines() == []
    finally:
        run_cli("stop", "--all", "--runtime", "native", env=first.env)


# --- 6: help ----------------------------------------------------------------------------------


def test_top_level_help_fits_80_columns_and_cuts_nothing():
    helped = run_cli("--help", env={"COLUMNS": "80"}).stdout
    assert "..." not in helped.split("Commands:")[1] and not _lines_fit(helped)
    listed = re.findall(r"^  (\w+)  ", helped.split("Commands:")[1], re.M)
    assert set(COMMANDS) <= set(listed)


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "version"])
def test_command_help_has_readable_placeholders(command):
    helped = run_cli(command, "--help", env={"COLUMNS": "80"}).stdout
    assert "<list[" not in helped and "{name}" not in helped, helped


def test_doctor_help_does_not_advertise_update_lock():
    helped = run_cli("doctor", "--help", env={"COLUMNS": "80"}).stdout
    assert "--update-lock" not in helped and "--locked" in helped


# --- 4: launch --json --------------------------------------------------------------------------


def test_launch_json_failure_is_one_object_a_line(tmp_path):
    result = run_cli(
        "launch", "--hardware", "cpu", "--set", f"model.path={tmp_path}", "--port", "99999", "--json"
    )
    assert result.returncode == 2
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and cli_json.error(lines[0])["exit_code"] == 2


# --- 3: phases ----------------------------------------------------------------------------------

STARTUP_LOG = FIXTURES / "vllm-logs" / "cpu-0.32.0-native-startup.log"


def _phases_as_the_log_grows(text: str) -> list[str]:
    from m31ctl.runtime.phases import latest_phase

    seen: list[str] = []
    lines = text.splitlines()
    for end in range(1, len(lines) + 1):
        phase = latest_phase("\n".join(lines[:end]))
        if phase is not None and (not seen or seen[-1] != phase.value):
            seen.append(phase.value)
    return seen


def test_phases_of_a_real_vllm_start_up_in_order():
    """vLLM 0.32's CPU start-up (captured from `m31ctl launch --runtime native` of the rehearsal
    model): "Enforce eager set, disabling torch.compile" is no compile phase, and "Initializing
    model took" (printed while loading) does not send it back to starting."""
    assert _phases_as_the_log_grows(STARTUP_LOG.read_text()) == [
        "starting the engine",
        "loading weights",
        "serving",
    ]


def test_compile_lines_vllm_prints_when_it_compiles():
    from m31ctl.runtime.phases import Phase, latest_phase

    # vllm/compilation/monitor.py and backends.py, as 0.32 logs them
    for line in (
        "(EngineCore pid=1) INFO [monitor.py:40] Starting torch.compile",
        "(EngineCore pid=1) INFO [backends.py:1167] Dynamo bytecode transform time: 7.12 s",
        "(EngineCore pid=1) INFO [backends.py:399] Compiling a graph for compile range (1, 8192) takes 15.82 s",
        "(EngineCore pid=1) INFO [monitor.py:20] torch.compile took 15.82 s in total",
        "(EngineCore pid=1) INFO [decorators.py:706] torch.compile and initial profiling/warmup run together "
        "took 20.1 s in total",
    ):
        assert latest_phase(line) is Phase.COMPILING, line
    assert latest_phase("Graph capturing finished in 1 secs, took 0.07 GiB") is Phase.CUDA_GRAPHS


def test_preflight_is_not_shown_as_starting():
    from m31ctl.cli import launch_views

    source = Path(launch_views.__file__).read_text()
    assert 'status("starting"' not in source and "preflight: checking the host" in source


# --- 5: provenance of flags ---------------------------------------------------------------------


def test_a_flag_is_its_own_source(tmp_path):
    port = run_cli(
        "launch", "--hardware", "cpu", "--set", f"model.path={tmp_path}", "--port", "99999", "--dry-run"
    )
    assert (
        port.returncode == 2 and "--port: runtime.port=99999" in port.stderr and "--set #" not in port.stderr
    )
    name = run_cli(
        "launch", "--hardware", "cpu", "--set", f"model.path={tmp_path}", "--name", "ux 5", "--dry-run"
    )
    assert (
        name.returncode == 2
        and "--name: runtime.container_name" in name.stderr
        and "--set #" not in name.stderr
    )
    # A user's own --set keeps its number, the flags after it notwithstanding.
    both = run_cli(
        "launch", "--hardware", "cpu", "--set", f"model.path={tmp_path}", "--set", "runtime.port=0",
        "--name", "ok-name", "--dry-run",
    )  # fmt: skip
    assert "--set #2: runtime.port=0" in both.stderr


# --- 7: capacity within the positions the engine accepts ----------------------------------------


def test_capacity_refuses_a_context_the_engine_refuses():
    result = run_cli("capacity", "--hardware", "b300x4", "--context", "2m")
    assert (
        result.returncode == 2 and "524,288 positions" in result.stderr and "--context 512k" in result.stderr
    )
    assert "2097152 tokens stay resident" not in result.stdout


def test_capacity_longest_context_is_capped_at_the_positions():
    data = cli_json.data(run_cli("capacity", "--hardware", "b300x4", "--sequences", "1", "--json").stdout)
    longest = data["longest_context"]
    assert longest["tokens"] == longest["limit_tokens"] == 524288 < longest["memory_tokens"]
    text = run_cli("capacity", "--hardware", "b300x4", "--sequences", "1").stdout
    assert "longest context for 1 sequence: 524,288 tokens (memory would hold" in text


def test_capacity_plot_stops_at_the_positions(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from m31ctl.cli import plot

    drawn: list[list[int]] = []
    original = plot.comparison

    def spy(deployment, context, layouts):  # type: ignore[no-untyped-def]
        drawn.append([context])
        return original(deployment, context, layouts)

    monkeypatch.setattr(plot, "comparison", spy)
    result = run_cli("capacity", "--hardware", "b300x4", "--plot", str(tmp_path / "c.png"))
    assert result.returncode == 0, result.stderr
    assert max(c for (c,) in drawn) == 524288


# --- 9: lock's words, cheap conflicts first ------------------------------------------------------


def test_lock_says_which_reason_the_image_is_unpinned(tmp_path):
    gone = run_cli("lock", "--hardware", "b300x4", "-o", str(tmp_path / "a.lock"),
                   env={"DOCKER_HOST": f"unix://{tmp_path}/none.sock"})  # fmt: skip
    assert gone.returncode == 0 and "the Docker Engine is not reachable" in gone.stderr
    assert "(no Docker Engine, or the image is not here)" not in gone.stderr


@pytest.mark.docker
def test_lock_with_the_engine_running_names_the_missing_image(tmp_path):
    from m31ctl.errors import DockerUnreachable
    from m31ctl.runtime.engine_api import connect

    try:
        connect().ping()
    except DockerUnreachable:
        pytest.skip("needs the Docker Engine")
    result = run_cli("lock", "--hardware", "b300x4", "--set", "engine.image=m31ctl-test/absent:1", "-o",
                     str(tmp_path / "a.lock"))  # fmt: skip
    assert "m31ctl-test/absent:1 is not in the local Docker Engine (docker pull" in result.stderr


def test_a_busy_port_is_refused_before_the_preflight(tmp_path, monkeypatch):
    import socket

    from m31ctl import deploy

    def no_preflight(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the preflight ran before the cheap conflict check")

    monkeypatch.setattr(deploy, "preflight", no_preflight)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli("launch", "--hardware", "cpu", "--runtime", "native", "--set", f"model.path={tmp_path}",
                         "--port", str(port), "--name", "busy-port-test")  # fmt: skip
    assert result.returncode == 4 and f"port 127.0.0.1:{port} is in use" in result.stderr


# --- 2: 80 columns --------------------------------------------------------------------------------


def _one_argument(line: str) -> bool:
    """A command is broken between its arguments, a backslash ending each line that goes on (issue
    51); one argument wider than the screen (a JSON --speculative-config) has a line of its own."""
    try:
        words = shlex.split(line.strip().removesuffix(" \\"))
    except ValueError:
        return False
    return len(words) == 1 or (len(words) == 2 and words[0].startswith("-"))


@pytest.mark.parametrize(
    "argv",
    [
        ("plan", "--hardware", "b300x4"),
        ("plan", "--hardware", "h200x8", "--explain"),
        ("doctor", "--hardware", "cpu"),
        ("capacity", "--hardware", "b300x4"),
        ("recipes", "list"),
        ("status",),
    ],
    ids=lambda argv: "-".join(argv),
)
def test_views_fit_80_columns(argv):
    result = run_cli(*argv, env={"COLUMNS": "80"})
    text = result.stdout + result.stderr
    long = [line for line in _lines_fit(text) if not _one_argument(line)]
    assert long == [], "\n".join(long)


# verify's and bench's tables need a server; their typed results, built from what they measured on
# the lent H200 (tests/fixtures/gpu/h200-vllm026/) and from what a stand-in server made them say,
# go through the same text views (output.emit) at 80 columns.
H200 = FIXTURES / "gpu" / "h200-vllm026"


def _verify_report(failing: bool):  # type: ignore[no-untyped-def]
    from m31ctl.checks import CheckResult, CheckStatus
    from m31ctl.served.verified import VerifyReport

    captured = json.loads((H200 / "verify-fp8graphs-u0.1.json").read_text())
    # The capture predates one check shape (issue 38): {"check", "status": pass|fail|skip, "detail"}.
    spelt = {"pass": CheckStatus.OK, "fail": CheckStatus.FAIL, "skip": CheckStatus.SKIP}
    checks = [
        CheckResult(c["check"], c["check"], spelt[c["status"]], c["detail"]) for c in captured["checks"]
    ]
    if failing:  # what verify said of the stand-in engine (tests/standin_vllm): long, quoting the server
        checks += [
            CheckResult("max-model-len", "max-model-len", CheckStatus.FAIL, "the engine serves 'None' tokens; "
                        "the plan says 2048; sent '{\"object\": \"list\", \"data\": [{\"id\": "
                        "\"m31ctl-rehearsal\", \"object\": \"model\"}]}'"),
            CheckResult("kv-cache", "kv-cache", CheckStatus.FAIL, "/metrics has no vllm:cache_config_info; "
                        "/metrics answered HTTP 404; sent '{\"error\": \"not found\"}'"),
        ]  # fmt: skip
    return VerifyReport(captured["endpoint"], captured["plan_hash"], checks, bench=captured["bench"])


def _bench_shown(failed: bool):  # type: ignore[no-untyped-def]
    from m31ctl.hardware import simulated
    from m31ctl.plan import PlanRequest, resolve
    from m31ctl.served import figures, sweep
    from m31ctl.served.bench_run import BenchResult
    from m31ctl.served.cost import Costing, Price
    from m31ctl.served.figures import Point

    report = json.loads((H200 / "bench-fp8graphs-u0.1.json").read_text())
    points = tuple(
        Point(**{k: v for k, v in p.items() if k in Point._fields and k != "spec"}) for p in report["points"]
    )
    if failed:  # bench without vLLM in the benchmark's Python (issue 43, item 8)
        cause = "vllm bench serve did not run: ModuleNotFoundError: No module named 'vllm'"
        points = tuple(figures.failed_point(p.concurrency, p.requests, cause) for p in points)
    found = sweep.Sweep(
        report["endpoint"], report["plan_hash"], report["workload"], report["gpus"], report["seed"], (),
        points, figures.frontier(points), figures.pick(points, ()), (), "server", report["wall_s"],
    )  # fmt: skip
    plan = resolve(PlanRequest(simulated("cpu"), sets=("model.path=/tmp/m31ctl-gpu/model",)))
    costing = Costing(Price(2.5, "gpu", "USD"), report["gpus"], 1)
    return BenchResult(plan, found, report, None, False, costing)


@pytest.mark.parametrize(
    "build",
    [
        lambda: _verify_report(failing=False),
        lambda: _verify_report(failing=True),
        lambda: _bench_shown(failed=False),
        lambda: _bench_shown(failed=True),
    ],
    ids=["verify", "verify-failing", "bench", "bench-not-measured"],
)
def test_verify_and_bench_views_fit_80_columns(build, monkeypatch, capsys):
    from m31ctl.cli import bench, verifying  # noqa: F401  (register the text views)
    from m31ctl.cli.output import emit

    monkeypatch.setenv("COLUMNS", "80")
    emit(build(), False)
    text = capsys.readouterr().out
    assert text.count("\n") > 5, text  # the view printed its table
    long = [line for line in _lines_fit(text) if not _one_argument(line)]
    assert long == [], "\n".join(long)


def test_bench_table_keeps_each_figure_whole_at_80_columns(monkeypatch, capsys):
    from m31ctl.cli.bench import _cell
    from m31ctl.cli.output import emit

    monkeypatch.setenv("COLUMNS", "80")
    shown = _bench_shown(failed=False)
    emit(shown, False)
    text = capsys.readouterr().out
    for p in shown.found.points:
        for figure in (p.tok_s_per_user, p.tok_s_per_gpu, p.output_tok_s, p.ttft_p99_ms, p.tpot_p99_ms):
            assert _cell(figure) in text, (_cell(figure), text)


# --- issue 51: messages -------------------------------------------------------------------------


def _paragraphs(text: str) -> list[str]:
    """Wrapped lines joined back into the paragraphs they were (continuations are indented)."""
    joined: list[str] = []
    for line in text.splitlines():
        if line.startswith("  ") and joined:
            joined[-1] += " " + line.strip()
        else:
            joined.append(line)
    return joined


def test_capacity_geometry_line_says_what_is_published_not_a_dangling_word():
    text = run_cli("capacity", "--hardware", "b300x4", env={"COLUMNS": "80"}).stdout
    said = [p for p in _paragraphs(text) if p.startswith("geometry of ")]
    assert len(said) == 2 and not any(p.endswith("; published") for p in said), said
    assert said[0].endswith("unpublished: sparse_layers=60, indexer_dim=128")
    assert said[1].endswith("from recipes/models.yaml; every value published")


# --- 6: hints that help ---------------------------------------------------------------------------


def test_a_product_without_a_count_suggests_a_host_its_plan_fits():
    result = run_cli("plan", "--hardware", "h200")
    assert result.returncode == 2 and "did you mean h200x8" in result.stderr  # Hopper's TP8, not h200x4
    assert run_cli("plan", "--hardware", "h200x8").returncode == 0


def test_render_conflict_hint_is_a_command_that_runs(tmp_path):
    base = ("render", "--target", "k8s", "--hardware", "cpu", "--set", f"model.path={tmp_path}")
    assert run_cli(*base, "-o", str(tmp_path / "out")).returncode == 0
    changed = run_cli(*base, "--set", "serving.max_num_seqs=8", "-o", str(tmp_path / "out"))
    assert changed.returncode == 4
    hinted = re.search(r"`(m31ctl render [^`]*--check [^`]*)`", changed.stderr)
    assert hinted and "--target k8s" in hinted.group(1), changed.stderr
    import shlex

    check = run_cli(*shlex.split(hinted.group(1))[1:])
    assert check.returncode == 1 and "max-num-seqs" in check.stdout  # it runs, and shows the drift


def test_a_native_preflight_failure_names_the_python_setting_and_carries_the_plan(tmp_path):
    from m31ctl.cli.options import PlanOptions
    from m31ctl.deploy import preflight_hint
    from m31ctl.deployment import derive
    from m31ctl.errors import HostPreconditionError
    from m31ctl.plan import resolve

    options = PlanOptions(
        "cpu", None, None, None, (), (f"model.path={tmp_path}", "runtime.native_python=/usr/bin/python3")
    )
    d = derive(resolve(options.request()))
    failed = HostPreconditionError(
        "preflight check engine-image failed: this Python has no PyTorch: it cannot run vLLM (runtime.native_python)",
        hint="run `m31ctl doctor --deep --json` for its stderr",
    )
    hint = preflight_hint(failed, d, "native", options.argv()) or ""
    assert "--set runtime.native_python=PATH" in hint and "/usr/bin/python3" in hint
    assert "m31ctl doctor --deep --runtime native --hardware cpu" in hint and f"model.path={tmp_path}" in hint


# --- 10: the rehearse report ------------------------------------------------------------------


def test_rank_lines_say_which_process_of_which_node():
    from m31ctl.rehearsal.logs import read_log

    worker = read_log(
        "2026-12-01T14:50:00Z (EngineCore_DP1 pid=33) INFO 12-01 14:50:00 [parallel_state.py:2350] rank 0 in "
        "world size 1 is assigned as DP rank 1, PP rank 0, TP rank 0\n"
        "2026-12-01T14:50:00Z (EngineCore_DP0 pid=32) INFO 12-01 14:50:00 [parallel_state.py:2350] rank 0 in "
        "world size 1 is assigned as DP rank 0, PP rank 0, TP rank 0"
    )
    assert worker.ranks == (
        "rank 0 in world size 1 is assigned as DP rank 1, PP rank 0, TP rank 0 [EngineCore_DP1]",
        "rank 0 in world size 1 is assigned as DP rank 0, PP rank 0, TP rank 0 [EngineCore_DP0]",
    )


def _result(changes):  # type: ignore[no-untyped-def]
    from m31ctl.rehearsal.result import RehearsalResult

    return RehearsalResult(
        served=True, plan_hash="p", twin_hash="t", layout="DP2", changes=tuple(changes), nodes=(), probes=(),
        endpoint="http://127.0.0.1:1", completions=4, smoke=None, failure=None, failing_node=None,
        error_line=None, cause=None, not_emulated=(), timings_s={"total_s": 1.0}, cleaned=True, leftovers=(),
        kept=False,
    )  # fmt: skip


def test_rehearse_summary_prints_values_as_json_and_each_reason_once():
    from m31ctl.cli.rehearsing import summary
    from m31ctl.rehearsal.twin import Change

    layout = "DP8 over 2 nodes becomes DP2: one rank a node"
    text = summary(
        _result(
            [
                Change("parallelism.data", 8, 2, layout),
                Change("parallelism.tensor", 4, 1, layout),
                Change("speculative.method", "dspark", None, "no DSpark draft in the tiny model"),
                Change("runtime.env", {}, {"VLLM_CPU_KVCACHE_SPACE": "1"}, "the CPU backend's KV space"),
            ]
        )
    )
    assert "None" not in text and "{'" not in text
    assert 'speculative.method: "dspark" -> null' in text
    assert 'runtime.env: {} -> {"VLLM_CPU_KVCACHE_SPACE": "1"}' in text
    assert text.count(layout) == 1  # said once, above both parallelism settings
    at = text.index(layout)
    assert at < text.index("parallelism.data: 8 -> 2") < text.index("speculative.method")


def test_the_readme_quotes_the_rank_line_vllm_prints():
    """README's proof of a rehearsal quoted "rank 1 in world size 2 ... DP rank 1", which no node
    prints: vLLM 0.32 runs the DP ranks of a model without experts (the example's
    expert=false) as independent engines of one rank (ParallelConfig.
    reconfigure_for_independent_dp_rank), each logging the rank line of a world of one, the very
    line vLLM 0.32's CPU build logged when m31ctl launched it (the capture below). What README
    quotes is in that capture, and is a rank line the rehearsal report keeps."""
    from m31ctl.rehearsal.logs import read_log
    from tests.conftest import ROOT

    guide = " ".join((ROOT / "docs" / "guide.md").read_text().split())  # README's, until issue 51
    section = guide[guide.index("### `m31ctl rehearse`") : guide.index("## Prefill/decode")]
    quoted = re.findall(r"`(rank \d+ in world size \d+ is assigned as [^`]*)`", section)
    assert quoted and "rank 1 in world size 2" not in section, quoted
    ranks = read_log(STARTUP_LOG.read_text()).ranks
    for line in quoted:
        assert line in STARTUP_LOG.read_text(), line
        assert any(rank.startswith(line) for rank in ranks), (line, ranks)


# --- 11: scripts/demo -----------------------------------------------------------------------------


def test_demo_has_headings_one_profile_no_settings_table_and_next_steps():
    import subprocess

    from tests.conftest import ROOT

    done = subprocess.run(
        [str(ROOT / "scripts" / "demo")], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "== 1. The plan" in out and "== 2. What that plan holds" in out and "== Next" in out
    assert "cache.block_size" not in out  # the 72-row settings table is --explain's
    first, second = (" ".join(part.split()) for part in out.split("== 2."))
    assert "profile latency" in first and "profile latency" in second  # the plan shown is the one measured
    assert "m31ctl render --target k8s" in out.split("== Next")[1]


def test_demo_titles_and_next_steps_follow_the_host_it_was_given():
    import subprocess

    from tests.conftest import ROOT

    done = subprocess.run(
        [str(ROOT / "scripts" / "demo"), "--hardware", "h200x8"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "== 1. The plan: MiniMax-M3.1-Flash on a simulated 8x H200 host ==" in out
    assert "B300" not in out and "b300x4" not in out, out
    after = out.split("== Next")[1]
    assert "m31ctl render --target k8s --hardware h200x8 -o deploy/" in after
    assert "m31ctl capacity --hardware h200x8 --profile throughput" in after
    assert all(len(line) <= 80 for line in after.splitlines()) and all(
        len(h) <= 80 for h in out.splitlines() if h.startswith("==")
    )


def test_demo_says_what_it_sets_up_before_the_quiet_set_up(tmp_path):
    """The first run's set-up (scripts/bootstrap: pip, about 40 s) prints nothing: the demo says
    what it is doing first. Run on a copy whose bootstrap and m31ctl only say they ran."""
    import shutil
    import subprocess

    from tests.conftest import ROOT

    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "demo", tmp_path / "scripts" / "demo")
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    for path, body in (
        (tmp_path / "scripts" / "bootstrap", 'echo "BOOTSTRAP RAN"\ntouch .venv/.m31ctl-installed\n'),
        (tmp_path / ".venv" / "bin" / "m31ctl", 'echo "m31ctl $*"\n'),
    ):
        path.write_text("#!/usr/bin/env bash\n" + body)
        path.chmod(0o755)
    demo = [str(tmp_path / "scripts" / "demo"), "--hardware", "mi355xx8"]
    first = subprocess.run(demo, capture_output=True, text=True, timeout=60, check=True).stdout
    lines = first.splitlines()
    assert lines[0].startswith("== Setting up .venv") and "about a minute" in lines[0], first
    assert lines[1] == "BOOTSTRAP RAN"
    assert "m31ctl plan --brief --hardware mi355xx8" in first  # the host given once, not b300x4 too
    assert "simulated 8x MI355X host" in first
    again = subprocess.run(demo, capture_output=True, text=True, timeout=60, check=True).stdout
    assert "Setting up" not in again and again.startswith("BOOTSTRAP RAN")  # set up: nothing to say


def test_plan_brief_leaves_out_the_settings_table():
    brief = run_cli("plan", "--hardware", "b300x4", "--brief").stdout
    assert "cache.block_size" not in brief and "--explain" in brief and "vllm serve" in brief
    assert "cache.block_size" in run_cli("plan", "--hardware", "b300x4").stdout


@pytest.mark.docker
def test_a_server_running_another_plan_is_refused_before_the_preflight_with_what_differs(
    tmp_path, monkeypatch
):
    import contextlib
    import socket
    import uuid

    from m31ctl import deploy
    from m31ctl.runtime.engine_api import connect
    from tests.dockerlib import build_engine_images

    client = connect()
    image = build_engine_images(client)["ready"]
    name = f"m31ctl-test-{uuid.uuid4().hex[:8]}"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = ("launch", "--hardware", "cpu", "--name", name, "--port", str(port), "--set", f"engine.image={image}",
            "--set", f"model.path={tmp_path}")  # fmt: skip
    try:
        assert run_cli(*base, "--detach").returncode == 0
        monkeypatch.setattr(deploy, "preflight", lambda *a, **k: pytest.fail("the preflight ran first"))
        refused = run_cli(*base, "--set", "serving.max_model_len=1024")
        assert refused.returncode == 4 and "not replaced" in refused.stderr
        assert "serving.max_model_len: 2048 -> 1024" in refused.stderr and "--yes" in refused.stderr
    finally:
        with contextlib.suppress(Exception):
            client.containers.get(name).remove(force=True)


# --- 1: the layout that does not fit says why in numbers -------------------------------------------


def test_a_layout_too_wide_for_its_nodes_names_the_product_and_the_settings_to_lower():
    result = run_cli("plan", "--hardware", "b300x4", "--set", "parallelism.nodes=2", "--set", "parallelism.data=8",
                     "--set", "kubernetes.hf_cache_storage_class=nfs")  # fmt: skip
    assert result.returncode == 6 and "TP4 x PP1 x DP8 = 32 GPUs" in result.stderr
    assert "parallelism.nodes=2 now" in result.stderr and "--set parallelism.nodes=N" not in result.stderr


def test_status_with_servers_keeps_names_urls_and_hashes_whole_at_80_columns(monkeypatch, capsys):
    """A status row's name, endpoint and plan hash are words rich folded mid-way in 80 columns
    ("m31ctl- try3", "restart s"); there each server is a record of its own, whole, and a wide
    terminal keeps the table."""
    from m31ctl.cli.launch_views import StatusShown
    from m31ctl.cli.output import emit
    from m31ctl.runtime import Survey
    from m31ctl.runtime.protocol import ServerStatus

    rows = (
        ServerStatus("m31ctl-try3", "docker", "running", "9b3eb4042fe4", "cpu", "rehearsal", "latency",
                     "http://127.0.0.1:8000", 200, restart_count=2),
        ServerStatus("m31ctl-pd-abc123-decode", "native", "running", "1b3eb4042fe4", "cpu", "pd", "latency",
                     "http://127.0.0.1:28200", None, group="m31ctl-pd-abc123"),
    )  # fmt: skip
    for width in ("80", "160"):
        monkeypatch.setenv("COLUMNS", width)
        emit(StatusShown(Survey(rows, {})), False)
        text = capsys.readouterr().out
        assert all(len(line) <= int(width) for line in text.splitlines()), text
        for word in (
            "m31ctl-pd-abc123-decode",
            "http://127.0.0.1:28200",
            "9b3eb4042fe4",
            "cpu/rehearsal/latency",
        ):
            assert word in text, (width, word, text)
