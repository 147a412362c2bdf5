"""Engine argv and environment against vLLM's own schema."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from m31ctl.deployment import derive
from m31ctl.engine.adapter import EngineInvocation, build_invocation
from m31ctl.engine.validate import schema_for, validate
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.plan.catalog import builtin_recipes
from tests.conftest import ROOT
from tests.support import cli_json

SCHEMA = ROOT / "m31ctl" / "engine" / "schemas" / "vllm-0.32.0.json"
HOST_FOR = {"blackwell": "b300x4", "rubin": "rubinx4", "hopper": "h200x8", "mi355x": "mi355xx8", "cpu": "cpu"}
SUPPORTED = [
    (r.recipe, v, p)
    for r in builtin_recipes().values()
    for v in r.variants
    for p, o in r.profiles.items()
    if not o.unsupported
]


@pytest.mark.vllm
def test_committed_schema_equals_a_fresh_extraction(vllm_py):
    fresh = subprocess.run(
        [vllm_py, str(ROOT / "m31ctl" / "engine" / "extract_schema.py")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    assert json.loads(fresh.stdout)["version"] == "0.32.0"
    assert fresh.stdout == SCHEMA.read_text(), "regenerate: python m31ctl/engine/extract_schema.py > " + str(
        SCHEMA
    )


@pytest.mark.parametrize(("recipe", "variant", "profile"), SUPPORTED)
def test_every_builtin_plan_validates_clean(recipe, variant, profile):
    plan = resolve(
        PlanRequest(hardware=simulated(HOST_FOR[recipe]), recipe=recipe, variant=variant, profile=profile)
    )
    for engine in derive(plan).engines:  # a P/D plan: each role's engine
        inv = build_invocation(engine)
        assert validate(inv, schema_for(inv.image, plan.settings.engine.schema_version)) == []


SPEC = '{"method":"dspark","num_speculative_tokens":7}'
WRONG = [
    (["--tensor-paralel-size", "4"], "unknown flag", "--tensor-parallel-size"),
    (["--kv-cache-dtype", "nvfp5"], "not a choice", "nvfp4"),
    (
        ["--speculative-config", '{"method":"dspark","num_speculative_tokens":7,"draft_sampler":"greedy"}'],
        "unknown key 'draft_sampler'",
        "draft_sample_method",
    ),
    (["--speculative-config", '{"method":"dpsark","num_speculative_tokens":7}'], "method='dpsark'", "dspark"),
    (
        [
            "--speculative-config",
            '{"method":"dspark","num_speculative_tokens":7,"draft_sample_method":"random"}',
        ],
        "draft_sample_method='random'",
        "",
    ),
    (["--attention-config", '{"indexer_kv_dtype":"fp4"}'], "indexer_kv_dtype='fp4'", ""),
    (["--max-num-seq", "8"], "abbreviated flag", "--max-num-seqs"),
    (["--enable-expert"], "abbreviated flag", "--enable-expert-parallel"),
    (["--attention-backend", "FLASH_ATTENTION"], "unknown to vLLM", "did you mean"),
    (["--tool-call-parser", "minimax"], "unknown to vLLM", "minimax_m"),
    (["--reasoning-parser", "deepseek"], "unknown to vLLM", ""),
    (["--quantization", "nvfp4"], "unknown to vLLM", ""),
    (["--max-model-len", "lots"], "not a token count", ""),
    (["--block-size", "big"], "not an integer", ""),
    (["--speculative-config", "{method: dspark}"], "not valid JSON", ""),
    (["--gpu-memory-utilization", "most"], "not a number", ""),
]


@pytest.mark.parametrize(("extra", "message", "hint"), WRONG)
def test_wrong_argv_is_caught(extra, message, hint):
    inv = EngineInvocation("vllm/vllm-openai:minimax-m31-flash", ("MiniMaxAI/MiniMax-M3.1-Flash", *extra), ())
    findings = validate(inv, schema_for(inv.image, "0.32.0"))
    assert len(findings) == 1, [f.line() for f in findings]
    assert message in findings[0].line() and hint in findings[0].line()


def test_removed_and_unknown_environment_variables():
    inv = EngineInvocation(
        "x",
        ("m",),
        (
            ("VLLM_ATTENTION_BACKEND", "FLASHINFER"),
            ("VLLM_ROCM_USE_AITERR", "1"),
            ("VLLM_ROCM_USE_AITER", "1"),
            ("HF_HOME", "/x"),
        ),
    )
    lines = [f.line() for f in validate(inv, schema_for("x", "0.32.0"))]
    assert len(lines) == 2
    assert "VLLM_ATTENTION_BACKEND: removed" in lines[0] and "--attention-backend" in lines[0]
    assert "VLLM_ROCM_USE_AITERR" in lines[1] and "VLLM_ROCM_USE_AITER" in lines[1]


def test_flashinfer_ts_is_an_image_extension_only():
    args = (
        "m",
        "--speculative-config",
        '{"method":"dspark","num_speculative_tokens":7,"attention_backend":"FLASHINFER_TS"}',
    )
    day_zero = EngineInvocation("vllm/vllm-openai:minimax-m31-flash", args, ())
    public = EngineInvocation("vllm/vllm-openai:v0.32.0", args, ())
    assert validate(day_zero, schema_for(day_zero.image, "0.32.0")) == []
    (finding,) = validate(public, schema_for(public.image, "0.32.0"))
    assert "FLASHINFER_TS" in finding.line()


def test_cli_validate_and_default_validation(cli):
    ok = cli("validate", "--hardware", "mi355xx8", "--variant", "aiter", "--json")
    assert ok.returncode == 0 and cli_json.data(ok.stdout)["ok"] is True
    bad = cli(
        "validate",
        "--hardware",
        "b300x4",
        "--set",
        'engine.extra_args=["--max-num-batched-tok","8"]',
        "--json",
    )
    assert (
        bad.returncode == 2 and cli_json.data(bad.stdout)["findings"][0]["token"] == "--max-num-batched-tok"
    )
    for command in ("plan", "render", "launch"):
        extra = ["--target", "k8s"] if command == "render" else (["--dry-run"] if command == "launch" else [])
        result = cli(
            command,
            "--hardware",
            "b300x4",
            *extra,
            "--set",
            'engine.extra_args=["--max-num-batched-tok","8"]',
        )
        assert result.returncode == 2 and "abbreviated flag" in result.stderr and "--set #1" in result.stderr
        skipped = cli(
            command,
            "--hardware",
            "b300x4",
            *extra,
            "--set",
            'engine.extra_args=["--max-num-batched-tok","8"]',
            "--no-validate",
        )
        assert skipped.returncode == 0, skipped.stderr


def test_unknown_schema_version():
    from m31ctl.errors import InputError

    with pytest.raises(InputError, match=r"0\.32\.0"):
        schema_for("x", "0.99.0")


def test_schema_file_is_committed_and_sane():
    data = json.loads(Path(SCHEMA).read_text())
    assert data["version"] == "0.32.0" and len(data["flags"]) > 300
    assert "dspark" in data["speculative_methods"] and "FLASHINFER_TS" not in data["attention_backends"]
    assert "VLLM_ATTENTION_BACKEND" not in data["environment_variables"]


# --- one argv grammar: owned flags in every spelling vLLM reads ---------------------------------


@pytest.mark.parametrize(
    ("args", "setting"),
    [
        (["--max-num-seqs", "2048"], "serving.max_num_seqs"),
        (["--max_num_seqs=2048"], "serving.max_num_seqs"),
        (["--max-num-se", "2048"], "serving.max_num_seqs"),  # an unambiguous prefix
        (["--max-model-len", "1m"], "serving.max_model_len"),
        (["--gpu-memory-utilization=0.99"], "serving.gpu_memory_utilization"),
        (["--shutdown-timeout", "0"], "serving.shutdown_timeout"),
        (["--speculative-config", '{"method":"ngram"}'], "speculative"),
        (["--speculative-config.num_speculative_tokens", "12"], "speculative"),
        (["-sc.method", "ngram"], "speculative"),
        (["--spec-tokens", "12"], "speculative.tokens"),
        (["--attention-config", '{"indexer_kv_dtype":"fp8"}'], "cache.indexer_dtype"),
        (["-ac.indexer_kv_dtype", "fp8"], "cache.indexer_dtype"),
        (["--distributed-executor-backend", "mp"], "parallelism.nodes"),
        (["--config", "serve.yaml"], "the plan itself"),
        (["--ssl-keyfile", "k.pem"], "plain HTTP"),
        (["--no-enable-expert-parallel"], "parallelism.expert"),
        (["-ep"], "parallelism.expert"),
        (["--Port", "9000"], "runtime.port"),  # vLLM rejects the case; refusing it is the safe side
    ],
)
def test_every_owned_flag_is_refused_in_any_spelling(args, setting):
    from m31ctl.commands import deployment
    from m31ctl.errors import InputError
    from m31ctl.hardware import simulated
    from m31ctl.plan import PlanRequest

    request = PlanRequest(hardware=simulated("b300x4"), sets=(f"engine.extra_args={json.dumps(args)}",))
    with pytest.raises(InputError) as caught:
        deployment(request, validate=False)
    line = caught.value.one_line()
    assert setting in line and "engine.extra_args sets" in line and "--set #1" in line


@pytest.mark.parametrize(
    "command",
    [("plan",), ("plan", "--no-validate"), ("plan", "--brief"), ("capacity",), ("validate",), ("lock", "-o")],
)
def test_every_command_refuses_an_owned_flag_before_it_shows_anything(command, cli, tmp_path):
    """The refusal is decided once, for the plan a command acts on (commands.deployment): plan
    (with or without --no-validate) says it in one line and exit 2 before printing any of the
    plan, as render and launch do, and a plan no target could run is neither sized nor locked."""
    args = (*command, str(tmp_path / "m31ctl.lock")) if command[-1] == "-o" else command
    sets = 'engine.extra_args=["--port","9000"]'
    result = cli(*args, "--hardware", "b300x4", "--set", sets)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == "" and not (tmp_path / "m31ctl.lock").exists()
    assert result.stderr.splitlines() == [
        "m31ctl: error: --set #1: engine.extra_args sets --port, which m31ctl sets from runtime.port: the "
        "container, probes, rendered files and capacity would describe another server than vLLM runs "
        "(remove it from engine.extra_args and set runtime.port)"
    ]


def _every_flag_m31ctl_writes() -> list[str]:
    """What the adapter emits and what it owns beside (issue 49: --kv-transfer-config, which the
    adapter writes for each P/D role, passed on an aggregated plan)."""
    from m31ctl.engine.adapter import owned_settings

    return sorted(owned_settings("0.32.0"))


@pytest.mark.parametrize("flag", _every_flag_m31ctl_writes())
@pytest.mark.parametrize("spelling", ["apart", "joined"])
def test_every_flag_m31ctl_writes_is_refused_in_both_spellings_exit_2_one_line(flag, spelling):
    """`--flag value` and `--flag=value`, on an aggregated plan and a P/D one, in-process (the
    exit code and the one line are InputError's; the CLI case below runs the command)."""
    from m31ctl.commands import deployment
    from m31ctl.errors import InputError
    from m31ctl.hardware import simulated
    from m31ctl.plan import PlanRequest

    args = [flag, "1"] if spelling == "apart" else [f"{flag}=1"]
    for pd in ((), ("disaggregation.enabled=true",)):
        sets = (*pd, f"engine.extra_args={json.dumps(args)}")
        with pytest.raises(InputError) as caught:
            deployment(PlanRequest(hardware=simulated("b300x8"), sets=sets), validate=False)
        assert caught.value.exit_code == 2
        line = caught.value.one_line()
        # a P/D plan's --kv-transfer-config is refused at plan time (plan/disaggregation.py)
        assert "\n" not in line and flag in line and "engine.extra_args" in line and " sets " in line, line


@pytest.mark.parametrize(
    "args",
    [
        ["--kv-transfer-config", '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'],
        ["--kv-transfer-config={}"],
        ["--hf-overrides", '{"num_hidden_layers":2}'],
        ['--hf-overrides={"text_config":{"num_local_experts":8}}'],
        ["--hf_overrides.quantization_config", "{}"],
        ["--hf-overrides", '{"architectures":["LlamaForCausalLM"]}'],
    ],
)
def test_cli_refuses_what_rewrites_the_plan_exit_2_one_line(args, cli):
    """issue 49: both were accepted on an aggregated plan."""
    result = cli("plan", "--hardware", "b300x8", "--set", f"engine.extra_args={json.dumps(args)}")
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stdout == "" and len(result.stderr.splitlines()) == 1, result.stderr
    assert "engine.extra_args sets" in result.stderr and "--set #1" in result.stderr


def test_hf_overrides_may_carry_rope_scaling_alone():
    """--hf-overrides is no setting's (m31ctl writes none): it rewrites the checkpoint's config
    (vLLM 0.32 config/model.py), so only the RoPE scaling the engine rules read is let through,
    at the top level or under text_config, in every spelling vLLM merges."""
    from m31ctl.engine.owned import overridden_key

    rope = '{"rope_type":"yarn","factor":2.0,"original_max_position_embeddings":524288}'
    for args in (
        ["--hf-overrides", "{}"],
        ["--hf-overrides", f'{{"text_config":{{"rope_scaling":{rope}}}}}'],
        [f'--hf-overrides={{"rope_parameters":{rope}}}'],
        ["--hf-overrides.text_config.rope_scaling", rope],
        ["--enforce-eager"],
    ):
        assert overridden_key(args) is None, args
    assert overridden_key(
        ["--hf-overrides", '{"text_config":{"rope_scaling":{},"num_hidden_layers":1}}']
    ) == ("text_config.num_hidden_layers")
    assert overridden_key(["--hf-overrides.text_config.head_dim", "64"]) == "text_config.head_dim"
    assert overridden_key(["--hf-over", '{"max_position_embeddings":1048576}']) == "max_position_embeddings"


def test_rope_scaling_on_nvidia_still_meets_the_rule_that_the_model_ignores_it():
    """On NVIDIA a RoPE override changes nothing in MiniMax-M3's model (it reads rope_theta and
    partial_rotary_factor alone), and a factor that raises vLLM's derived length cannot carry a
    context past the native positions: the engine rule refuses it whatever the override says."""
    from m31ctl.errors import InputError
    from m31ctl.hardware import simulated
    from m31ctl.plan import PlanRequest, resolve

    linear = '{"text_config":{"rope_scaling":{"rope_type":"linear","factor":2.0}}}'
    sets = ("serving.max_model_len=1048576", f"engine.extra_args={json.dumps(['--hf-overrides', linear])}")
    with pytest.raises(InputError) as caught:
        resolve(PlanRequest(hardware=simulated("b300x8"), sets=sets))
    assert "vllm-nvidia-m3-no-rope-scaling" in caught.value.one_line()


def test_flags_that_are_not_owned_pass_and_ambiguous_ones_go_to_the_validator():
    from m31ctl.engine.adapter import owned_flag

    # --hf-overrides is no setting's: its keys are checked apart (test_hf_overrides_may_carry_rope_scaling_alone)
    for arg in ("--enforce-eager", "-O0", "--hf-overrides", "--max-num-batched-tokens", "--monokernel"):
        assert owned_flag(arg) is None, arg
    assert owned_flag("--max-num") is None  # ambiguous: vLLM refuses it, validate names both


def test_the_owned_set_is_what_the_adapter_emits():
    """Every flag of every built-in plan's argv (all targets' roles) is owned, and every owned
    flag the adapter emits names its setting; the vLLM option table knows every owned flag."""
    from m31ctl import vllm_argv as argv
    from m31ctl.deployment import derive
    from m31ctl.engine.adapter import NodeRole, build_invocation, emitted_flags, owned_settings
    from m31ctl.engine.owned import ALSO_OWNED, SETTING_FOR
    from m31ctl.hardware import simulated
    from m31ctl.plan import PlanRequest, resolve
    from m31ctl.plan.catalog import builtin_recipes

    hosts = {
        "blackwell": "b300x4",
        "rubin": "rubinx4",
        "hopper": "h200x8",
        "mi355x": "mi355xx8",
        "cpu": "cpu",
    }
    seen: set[str] = set()
    for recipe in builtin_recipes().values():
        for name, option in recipe.profiles.items():
            if option.unsupported:
                continue
            hw = simulated(hosts[recipe.recipe]) if recipe.recipe != "cpu" else None
            if hw is None:
                from m31ctl.hardware import cpu_host

                hw = cpu_host()
            p = resolve(PlanRequest(hardware=hw, recipe=recipe.recipe, profile=name))
            deployment = derive(p)
            args = build_invocation(deployment).args
            seen.update(a for a in args if a.startswith("--") and a not in p.settings.engine.extra_args)
    wide = resolve(
        PlanRequest(
            hardware=simulated("b300x4"),
            sets=("parallelism.nodes=2", "parallelism.data=2", "kubernetes.hf_cache_storage_class=nfs"),
        )
    )
    for leader in (True, False):
        inv = build_invocation(derive(wide), node=NodeRole(leader, "$A", "$R"))
        seen.update(a for a in inv.args if a.startswith("--"))
    seen.discard("--revision")  # the lead's pinned commit: owned by ALSO_OWNED
    assert seen <= emitted_flags(), seen - emitted_flags()
    assert emitted_flags() <= set(SETTING_FOR), emitted_flags() - set(SETTING_FOR)
    groups = set(argv.option_groups("0.32.0").values())
    assert set(owned_settings("0.32.0")) - {"--revision"} <= groups, set(owned_settings("0.32.0")) - groups
    assert set(ALSO_OWNED) - {"--revision"} <= groups, set(ALSO_OWNED) - groups


def test_one_grammar_for_validate_redact_and_rules():
    from m31ctl import vllm_argv as argv
    from m31ctl.redact import redact, secret_flag

    assert argv.spell("--Tensor_Parallel_Size=4") == argv.Spelled(
        "--Tensor_Parallel_Size=4", "--Tensor-Parallel-Size", None, "4"
    )
    assert argv.spell("-ac.indexer_kv_dtype") == argv.Spelled(
        "-ac.indexer_kv_dtype", "-ac", "indexer_kv_dtype", None
    )
    assert argv.spell("-5") is None and argv.spell("value") is None
    assert argv.canonical("-tp", "0.32.0").flag == "--tensor-parallel-size"
    assert argv.canonical("--enable-exp", "0.32.0").flag == "--enable-expert-parallel"
    assert argv.canonical("--max-num", "0.32.0").flag is None
    assert argv.json_config(
        ("--hf-overrides", '{"a": 1}', "--hf_overrides.b", "2", "--hf-overrides.c=x"), "--hf-overrides"
    ) == {"a": 1, "b": 2, "c": "x"}
    assert secret_flag("--API_Key=x") == "--api-key" and secret_flag("--api-key.x") == "--api-key"
    assert "s3cretvalue" not in redact("vllm serve m --api_k s3cretvalue")


def test_validate_checks_each_role_of_a_pd_group():
    """validate of a P/D plan validated nothing: it ended in "its engines are its roles". Each
    role's argv and environment now meet vLLM's schema, and a finding names its role."""
    from tests.conftest import run_cli

    good = run_cli("validate", "--hardware", "cpu", "--variant", "pd", "--json")
    assert good.returncode == 0, good.stderr
    assert sorted(cli_json.data(good.stdout)["roles"]) == ["decode", "prefill"]
    bad = run_cli(
        "validate",
        "--hardware",
        "cpu",
        "--variant",
        "pd",
        "--set",
        'disaggregation.decode.env.VLLM_NOT_A_VARIABLE="1"',
    )
    assert bad.returncode == 2, bad.stderr
    assert "prefill: ok" in bad.stdout and "m31ctl: decode: VLLM_NOT_A_VARIABLE" in bad.stderr
