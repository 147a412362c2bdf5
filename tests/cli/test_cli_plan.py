"""`plan` and `recipes` as users run them: golden plans, precedence, bad input, the installed wheel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from m31ctl.cli.options import PlanOptions
from m31ctl.cli.views import plan_json
from m31ctl.deployment import derive
from m31ctl.errors import InputError
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.plan.catalog import builtin_recipes
from tests.conftest import ROOT
from tests.support import cli_json

PLANS = Path(__file__).parent.parent / "reference_files" / "plans"
HOST_FOR = {"blackwell": "b300x4", "rubin": "rubinx4", "hopper": "h200x8", "mi355x": "mi355xx8", "cpu": "cpu"}
COMBINATIONS = [(r.recipe, v, p) for r in builtin_recipes().values() for v in r.variants for p in r.profiles]


@pytest.mark.parametrize(("recipe", "variant", "profile"), COMBINATIONS)
def test_golden_plan(recipe, variant, profile):
    request = PlanRequest(
        hardware=simulated(HOST_FOR[recipe]), recipe=recipe, variant=variant, profile=profile
    )
    try:
        data = plan_json(derive(resolve(request)), None)
        # The host is not part of the recipe's answer (the CPU host differs per machine).
        golden_data = {k: v for k, v in data.items() if k not in ("hardware", "capacity", "warnings")}
    except InputError as exc:
        golden_data = {"error": exc.one_line()}
    text = json.dumps(golden_data, indent=2, sort_keys=True) + "\n"
    golden = PLANS / f"{recipe}__{variant}__{profile}.json"
    if os.environ.get("M31CTL_UPDATE_GOLDEN"):
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert text == golden.read_text(), f"re-run with M31CTL_UPDATE_GOLDEN=1 if {golden.name} should change"


def test_plan_json_contract(cli):
    result = cli("plan", "--hardware", "b300x4", "--json")
    assert result.returncode == 0
    data = cli_json.data(result.stdout)
    for key in ("recipe", "variant", "profile", "hardware", "image", "argv", "env", "provenance"):
        assert key in data
    assert data["argv"][0] == "MiniMaxAI/MiniMax-M3.1-Flash"
    spec = data["argv"][data["argv"].index("--speculative-config") + 1]
    assert json.loads(spec)["num_speculative_tokens"] == 7  # one argv element holds the whole JSON
    lines = (ROOT / "recipes" / "blackwell.yaml").read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.strip() == "block_size: 128")
    assert data["provenance"]["cache.block_size"] == f"recipe (recipes/blackwell.yaml:{line})"
    assert cli("plan", "--hardware", "b300x4", "--json").stdout == result.stdout  # byte-identical


def test_every_moe_plan_states_its_moe_layout(cli):
    """The MoE layer vLLM builds (FusedMoEParallelConfig.make) is in the plan for every layout, a
    TP-only one included: its expert and tensor groups, experts per GPU, and why EP is on or off."""
    data = cli_json.data(cli("plan", "--hardware", "b300x4", "--json").stdout)
    assert data["moe_layout"] == {
        "ranks": 4,
        "expert_parallel": False,
        "expert_parallel_size": 1,
        "tensor_parallel_size": 4,
        "experts_per_gpu": "every expert, a 1/4 slice of each",
        "pipeline_stages": 1,
        "nodes": 1,
        "description": "every expert's tensor parallelism flattened over DP x TP = 4 ranks (TP4: 1/4 of each "
        "expert per GPU; no --enable-expert-parallel)",
        "source": "vLLM 0.32/0.33 vllm/model_executor/layers/fused_moe/config.py FusedMoEParallelConfig.make",
        "expert_parallel_source": "schema default",
    }
    text = cli("plan", "--hardware", "b300x4", "--brief", env={"COLUMNS": "400"}).stdout
    assert "MoE layout: every expert's tensor parallelism flattened over DP x TP = 4 ranks" in text
    assert cli_json.data(cli("plan", "--hardware", "cpu", "--json").stdout)["moe_layout"] is None  # dense


# Which layer wins serving.max_model_len, lowest first: defaults, recipe, variant, profile, file, --set.
PRECEDENCE = [
    ({}, 262144, "defaults"),
    ({"profile": "long-context"}, 524288, "profile long-context"),
    ({"profile": "long-context", "file": 131072}, 131072, "file"),
    ({"profile": "long-context", "file": 131072, "set": 65536}, 65536, "--set #1"),
    ({"file": 131072, "set": 65536}, 65536, "--set #1"),
    ({"set": 65536}, 65536, "--set #1"),
]


@pytest.mark.parametrize(("layers", "value", "winner"), PRECEDENCE)
def test_precedence_table(layers, value, winner, tmp_path):
    files = ()
    if "file" in layers:
        f = tmp_path / "override.yaml"
        f.write_text(f"serving:\n  max_model_len: {layers['file']}\n")
        files = (f,)
    sets = (f"serving.max_model_len={layers['set']}",) if "set" in layers else ()
    plan = resolve(
        PlanRequest(
            hardware=simulated("b300x4"), profile=layers.get("profile", "latency"), files=files, sets=sets
        )
    )
    assert plan.settings.serving.max_model_len == value
    source = plan.provenance["serving.max_model_len"]
    assert (source.file if winner == "file" else str(source).split(" (")[0]) == (
        str(files[0]) if winner == "file" else winner
    )


def test_later_files_and_sets_win(tmp_path):
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    a.write_text("serving:\n  max_num_seqs: 8\n")
    b.write_text("serving:\n  max_num_seqs: 16\n")
    plan = resolve(
        PlanRequest(
            hardware=simulated("b300x4"),
            files=(a, b),
            sets=("serving.max_num_seqs=32", "serving.max_num_seqs=64"),
        )
    )
    assert (
        plan.settings.serving.max_num_seqs == 64
        and str(plan.provenance["serving.max_num_seqs"]) == "--set #2"
    )


BAD_FILES = {
    "malformed": ("serving:\n  max_model_len: [1,\n", "invalid YAML", ":3"),
    "python-tag": ("serving: !!python/object/apply:os.system [id]\n", "unsupported YAML", ":1"),
    "alias-bomb": ("a: &a [x, x]\nb: &b [*a, *a]\nc: [*b, *b]\n", "aliases", ":1"),
    "duplicate": (
        "serving:\n  max_model_len: 1\n  max_model_len: 2\n",
        "duplicate key 'max_model_len'",
        ":3",
    ),
    "misspelt": ("serving:\n  max_modle_len: 1024\n", "did you mean 'serving.max_model_len'", ":2"),
    "unknown-top": ("tensor_parallel: 3\n", "unknown setting 'tensor_parallel'", ":1"),
    "range": ("serving:\n  gpu_memory_utilization: 1.5\n", "less than or equal to 1", ":2"),
    "type": ("serving:\n  max_model_len: lots\n", "serving.max_model_len", ":2"),
    "tensor-3": ("parallelism:\n  tensor: 3\n", "power of two", ":2"),
    "not-mapping": ("- a\n- b\n", "expected a mapping", ":1"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_one_line_exit_2(case, tmp_path, cli):
    content, message, line = BAD_FILES[case]
    path = tmp_path / f"{case}.yaml"
    path.write_text(content)
    result = cli("plan", "--hardware", "b300x4", "-f", str(path))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert message in result.stderr and f"{path}{line}" in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "serving.max_model_len"], "key.path=value"),
        (["--set", 'engine.extra_args=["--x",'], "broken JSON"),
        (["--set", "cache.block_size=64"], "blackwell-block-size"),
        (["--hardware", "b300x0"], "from 1 to 64"),
        (["--hardware", "b30x4"], "did you mean b300x4"),
        (["--recipe", "blackwel"], "did you mean 'blackwell'"),
        (["--hardware", "mi300xx8"], "not supported by any recipe"),
        (["--profile", "fast"], "no profile 'fast'"),
        (["--variant", "aiter"], "no variant 'aiter'"),
        (["-f", "/nonexistent/x.yaml"], "not found"),
    ],
)
def test_bad_flags_one_line(args, message, cli):
    full = args if "--hardware" in args else ["--hardware", "b300x4", *args]
    result = cli("plan", *full)
    assert result.returncode in (2, 6), result.stderr
    assert message in result.stderr and result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_unsupported_hardware_exit_code_is_host_precondition(cli):
    assert cli("plan", "--hardware", "mi300xx8").returncode == 6


def test_json_errors_are_json(cli):
    result = cli("plan", "--hardware", "b300x4", "--set", "cache.block_size=64", "--json")
    assert result.returncode == 2
    assert cli_json.error(result.stdout)["type"] == "RuleViolation"


def test_recipes_commands(cli, tmp_path):
    listing = cli_json.data(cli("recipes", "list", "--json").stdout)
    assert [r["name"] for r in listing["recipes"]] == ["blackwell", "cpu", "hopper", "mi355x", "rubin"]
    show = cli_json.data(cli("recipes", "show", "hopper", "--json").stdout)
    assert {r["id"] for r in show["rules"]} >= {"hopper-no-dspark", "hopper-no-video", "hopper-marlin-moe"}
    for path in sorted((ROOT / "recipes").glob("*.yaml")):
        if path.stem not in ("models", "defaults"):
            assert cli("recipes", "validate", str(path)).returncode == 0, path
    broken = tmp_path / "broken.yaml"
    broken.write_text((ROOT / "recipes" / "blackwell.yaml").read_text().replace("tokens: 7", "tokens: 99"))
    result = cli("recipes", "validate", str(broken))
    assert result.returncode == 2 and "speculative.tokens" in result.stderr and f"{broken}:" in result.stderr
    assert cli("recipes", "show", "hoper").returncode == 2


@pytest.mark.slow
def test_installed_wheel_finds_its_recipes_outside_the_repo(tmp_path):
    wheel_dir = tmp_path / "wheel"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheel_dir),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheel_dir.glob("m31ctl-*.whl")
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
    )
    assert (target / "m31ctl" / "_data" / "recipes" / "blackwell.yaml").is_file()
    assert (target / "m31ctl" / "_data" / "templates" / "systemd.service.j2").is_file()
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {**os.environ, "PYTHONPATH": str(target)}
    where = subprocess.run(
        [sys.executable, "-c", "import m31ctl; print(m31ctl.__file__)"],
        cwd=outside,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert where.startswith(str(target))
    listing = subprocess.run(
        [sys.executable, "-m", "m31ctl", "recipes", "list", "--json"],
        cwd=outside,
        env=env,
        capture_output=True,
        text=True,
    )
    assert listing.returncode == 0, listing.stderr
    assert "m31ctl/_data/recipes/blackwell.yaml" not in listing.stdout  # paths shown relative to the data dir
    assert len(cli_json.data(listing.stdout)["recipes"]) == 5
    rendered = subprocess.run(
        [sys.executable, "-m", "m31ctl", "render", "--target", "k8s", "--hardware", "b300x4"],
        cwd=outside,
        env=env,
        capture_output=True,
        text=True,
    )
    assert rendered.returncode == 0 and "kind: Deployment" in rendered.stdout


@pytest.mark.parametrize(
    ("content", "what"),
    [
        ("serving:\n  max_model_len: 1024  # caf\xe9\n".encode("latin-1"), "not UTF-8"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "not UTF-8"),
    ],
    ids=["latin-1", "binary"],
)
def test_non_utf8_override_file_is_bad_input_naming_it(content, what, tmp_path, cli):
    path = tmp_path / "site.yaml"
    path.write_bytes(content)
    result = cli("plan", "--hardware", "b300x4", "-f", str(path))
    assert result.returncode == 2 and what in result.stderr and str(path) in result.stderr
    assert result.stderr.count("\n") == 1 and result.stdout == ""
    recipe = cli("recipes", "validate", str(path))
    assert recipe.returncode == 2 and what in recipe.stderr


@pytest.mark.parametrize("size", ["64x", "lots", "-1g", "1.5.2g", ""])
def test_bad_sizes_are_refused_at_plan_time(size, cli):
    result = cli("plan", "--hardware", "b300x4", "--set", f"runtime.shm_size={size}")
    assert result.returncode == 2 and "runtime.shm_size" in result.stderr and "64g" in result.stderr
    rendered = cli("render", "--target", "k8s", "--hardware", "b300x4", "--set", f"runtime.shm_size={size}")
    assert rendered.returncode == 2 and rendered.stdout == ""


def test_one_size_parser_serves_docker_and_kubernetes():
    from m31ctl.units import k8s_quantity, parse_size

    assert (
        parse_size("64g") == 64 * 2**30 and parse_size("512m") == 512 * 2**20 and parse_size("1GiB") == 2**30
    )
    assert k8s_quantity("64g") == "64Gi" and k8s_quantity("1024") == "1024"


def test_empty_hardware_is_refused_not_probed(cli):
    result = cli("plan", "--hardware", "")
    assert result.returncode == 2 and "unknown --hardware ''" in result.stderr


def test_launch_name_is_a_value_not_json(cli):
    result = cli("launch", "--hardware", "cpu", "--name", "true", "--dry-run", "--json")
    assert result.returncode == 0, result.stderr
    assert cli_json.data(result.stdout)["container"]["name"] == "true"


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-5"])
def test_launch_timeout_must_be_finite_and_positive(value, cli):
    result = cli("launch", "--hardware", "cpu", "--timeout", value, "--dry-run")
    assert result.returncode == 2 and "--timeout" in result.stderr


def test_quick_commands_skip_teardown_and_lose_nothing(tmp_path):
    """Quick commands leave without the interpreter's teardown (m31ctl.cli._leave_now): what they
    print to a file or a pipe and the files they write are complete, and their exit codes hold;
    commands that wait on servers still exit the normal way."""
    from tests.conftest import run_cli

    marker = "import atexit, sys; atexit.register(lambda: sys.stderr.write('torn-down\\n'))"

    def process(*args: str, stdout: int | object = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
        code = f"{marker}; sys.argv[0] = 'm31ctl'; from m31ctl.cli import run; run()"
        return subprocess.run(
            [sys.executable, "-c", code, *args], stdout=stdout, stderr=subprocess.PIPE, text=True, cwd=ROOT
        )

    expected = run_cli("render", "--target", "k8s", "--hardware", "b300x4").stdout
    with (tmp_path / "out.yaml").open("w") as sink:  # a file: block-buffered, flushed only at exit
        to_file = process("render", "--target", "k8s", "--hardware", "b300x4", stdout=sink)
    assert to_file.returncode == 0 and "torn-down" not in to_file.stderr
    assert (tmp_path / "out.yaml").read_text() == expected
    piped = process("capacity", "--hardware", "b300x4", "--json")
    assert piped.returncode == 0
    assert cli_json.data(piped.stdout) == cli_json.data(
        run_cli("capacity", "--hardware", "b300x4", "--json").stdout
    )
    written = process("render", "--target", "compose", "--hardware", "b300x4", "-o", str(tmp_path / "c"))
    assert written.returncode == 0 and (tmp_path / "c" / "compose.yaml").read_text().startswith("#")
    refused = process("plan", "--hardware", "nope")
    assert refused.returncode == 2 and "unknown --hardware" in refused.stderr
    assert "torn-down" not in refused.stderr
    waits = process("status", "--runtime", "native", "--json")  # not quick: normal exit
    assert "torn-down" in waits.stderr


def test_the_console_script_loads_no_pydantic_plugins():
    """The m31ctl process answers pydantic's plugin loader itself (m31ctl.cli._without_pydantic_plugins):
    a plan builds its models without importing importlib.metadata or scanning every installed
    package's entry points, and anything else asked of the loader is the real one's."""
    code = (
        "import sys; from m31ctl import cli; cli._without_pydantic_plugins()\n"
        "from m31ctl.hardware import simulated; simulated('b300x4').model_dump()\n"
        "from pydantic.plugin._loader import get_plugins; assert tuple(get_plugins()) == ()\n"
        "print('importlib.metadata' in sys.modules)\n"
        "from pydantic.plugin._loader import PYDANTIC_ENTRY_POINT_GROUP as group; print(group)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "pydantic"]


def test_plan_group_is_one_parameter_and_six_options():
    """A command takes the plan group as one PlanOptions; typer sees the six options in its place."""
    import inspect

    from m31ctl.cli.options import plan_group

    seen: list[object] = []

    def command(target: str, plan_options: PlanOptions, json: bool = False) -> int:
        seen.append((target, plan_options, json))
        return 0

    spread = plan_group(command)
    names = list(inspect.signature(spread).parameters)
    assert names == ["target", "hardware", "recipe", "variant", "profile", "file", "set_", "json"]
    spread(target="k8s", hardware="b300x4", recipe=None, variant=None, profile="latency",
           file=[Path("a.yaml")], set_=None, json=True)  # fmt: skip
    options = PlanOptions("b300x4", None, None, "latency", (Path("a.yaml"),), ())
    assert seen == [("k8s", options, True)] and options.given
    assert not PlanOptions(None, None, None, None, (), ()).given
    assert plan_group(plan_json) is plan_json  # no group: registered as it is
