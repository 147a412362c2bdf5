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
from m31ctl.plan.recipes import builtin_recipes
from tests.conftest import ROOT

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
    inv = build_invocation(derive(plan))
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
    assert ok.returncode == 0 and json.loads(ok.stdout)["ok"] is True
    bad = cli(
        "validate", "--hardware", "b300x4", "--set", 'engine.extra_args=["--max-num-seq","8"]', "--json"
    )
    assert bad.returncode == 2 and json.loads(bad.stdout)["findings"][0]["token"] == "--max-num-seq"
    for command in ("plan", "render", "launch"):
        extra = ["--target", "k8s"] if command == "render" else (["--dry-run"] if command == "launch" else [])
        result = cli(
            command, "--hardware", "b300x4", *extra, "--set", 'engine.extra_args=["--max-num-seq","8"]'
        )
        assert result.returncode == 2 and "abbreviated flag" in result.stderr and "--set #1" in result.stderr
        skipped = cli(
            command,
            "--hardware",
            "b300x4",
            *extra,
            "--set",
            'engine.extra_args=["--max-num-seq","8"]',
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
