"""Resolution: layers, provenance, rules, profiles, variants, and the engine adapter's argv."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from m31ctl.deployment import derive, require_fit
from m31ctl.engine.adapter import build_invocation
from m31ctl.errors import HostPreconditionError, InputError, RuleViolation, UnsupportedHardware
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.plan.catalog import builtin_recipes, select_recipe
from tests.conftest import ROOT
from tests.support import cli_json


def plan_for(hw: str, **kw):  # type: ignore[no-untyped-def]
    return resolve(PlanRequest(hardware=simulated(hw), **kw))


def flag(args: tuple[str, ...], name: str) -> str:
    return args[args.index(name) + 1]


def test_blackwell_quickstart_values():
    plan = plan_for("b300x4")
    assert plan.recipe.recipe == "blackwell" and plan.variant == "quickstart" and plan.profile == "latency"
    args = build_invocation(derive(plan)).args
    assert args[0] == "MiniMaxAI/MiniMax-M3.1-Flash"
    assert flag(args, "--tensor-parallel-size") == "4"
    assert flag(args, "--block-size") == "128"
    assert flag(args, "--kv-cache-dtype") == "nvfp4"
    assert json.loads(flag(args, "--attention-config")) == {"indexer_kv_dtype": "nvfp4"}
    assert json.loads(flag(args, "--speculative-config")) == {
        "method": "dspark",
        "num_speculative_tokens": 7,
        "attention_backend": "FLASHINFER_TS",
        "draft_sample_method": "probabilistic",
    }
    assert "model" not in json.loads(flag(args, "--speculative-config"))  # draft ships in dspark/
    assert build_invocation(derive(plan)).image == "vllm/vllm-openai:minimax-m31-flash"


@pytest.mark.parametrize("hw", ["b200x4", "gb200x4", "b300x8", "gb300x4"])
def test_all_blackwell_products_use_blackwell(hw):
    assert plan_for(hw).recipe.recipe == "blackwell"


def test_rubin_is_its_own_preview_recipe():
    plan = plan_for("rubinx4")
    assert plan.recipe.recipe == "rubin"
    assert any("preview" in w for w in plan.warnings)


def test_hopper_recipe():
    plan = plan_for("h200x8")
    inv = build_invocation(derive(plan))
    assert plan.recipe.recipe == "hopper"
    assert flag(inv.args, "--tensor-parallel-size") == "8"
    assert flag(inv.args, "--kv-cache-dtype") == "fp8"
    assert json.loads(flag(inv.args, "--attention-config")) == {"indexer_kv_dtype": "fp8"}
    assert flag(inv.args, "--moe-backend") == "marlin"
    assert "--speculative-config" not in inv.args
    assert json.loads(flag(inv.args, "--limit-mm-per-prompt")) == {"video": 0}  # images stay on


def test_mi355x_quickstart_and_aiter():
    quick = build_invocation(derive(plan_for("mi355xx8")))
    assert quick.image == "vllm/vllm-openai-rocm:minimax-m31-flash"
    assert json.loads(flag(quick.args, "--speculative-config")) == {
        "method": "dspark",
        "num_speculative_tokens": 3,
        "attention_backend": "TRITON_ATTN",
    }
    assert flag(quick.args, "--kv-cache-dtype") == "nvfp4"
    # upstream's AMD commands: the data-parallel AITER encoder. Shared-expert fusion is gone:
    # vLLM skips it on a ModelOpt NVFP4/MXFP8 checkpoint (docs/decisions.md)
    assert "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS" not in quick.env_dict
    assert flag(quick.args, "--mm-encoder-tp-mode") == "data"
    assert flag(quick.args, "--mm-encoder-attn-backend") == "ROCM_AITER_FA"
    aiter_plan = plan_for("mi355xx8", variant="aiter")
    aiter = build_invocation(derive(aiter_plan))
    assert flag(aiter.args, "--moe-backend") == "aiter"
    # VLLM_ROCM_USE_AITER_MOE defaults on under the master switch (vllm/envs.py)
    assert aiter.env_dict["VLLM_ROCM_USE_AITER"] == "1"
    assert "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS" not in aiter.env_dict
    assert aiter_plan.settings.moe.expert_requantization == "mxfp8"  # seed 000: what it loads
    assumed = build_invocation(
        derive(plan_for("mi355xx8", variant="aiter", sets=("moe.expert_requantization=mxfp8",)))
    )
    assert assumed.args == aiter.args and assumed.env == aiter.env  # nothing reaches the engine
    (note,) = [e for e in assumed.effects if "expert_requantization" in e]
    assert "capacity assumption" in note and "no code path in stock vLLM 0.33" in note
    assert not any("the AITER MoE path re-quantizes" in e for e in assumed.effects)
    assert flag(aiter.args, "--kv-cache-dtype") == "nvfp4"  # caches stay NVFP4
    assert "VLLM_ATTENTION_BACKEND" not in aiter.env_dict  # removed from vLLM


def test_profiles():
    dep = build_invocation(derive(plan_for("b300x4", profile="throughput"))).args
    assert flag(dep, "--tensor-parallel-size") == "1"
    assert flag(dep, "--data-parallel-size") == "4"
    assert "--enable-expert-parallel" in dep
    long = build_invocation(derive(plan_for("mi355xx4", profile="long-context"))).args
    assert "--decode-context-parallel-size" not in long  # vLLM needs TP above the 4 KV heads for it
    assert flag(long, "--max-model-len") == "524288"  # the checkpoint's max_position_embeddings


def test_unsupported_profile_names_reason():
    with pytest.raises(InputError, match="data and expert parallelism need GPUs"):
        plan_for("cpu", profile="throughput")


def test_unknown_profile_suggests():
    with pytest.raises(InputError, match="did you mean 'throughput'"):
        plan_for("b300x4", profile="throughput2")


def test_provenance_points_at_file_lines():
    plan = plan_for("b300x4")
    source = plan.provenance["cache.block_size"]
    assert source.file == "recipes/blackwell.yaml"
    line = Path(__file__).resolve().parents[2].joinpath(source.file).read_text().splitlines()[source.line - 1]
    assert "block_size: 128" in line
    assert plan.provenance["serving.max_model_len"].layer == "defaults"


def test_layers_in_order(tmp_path):
    override = tmp_path / "site.yaml"
    override.write_text("serving:\n  max_model_len: 131072\n  max_num_seqs: 32\n")
    plan = plan_for("b300x4", profile="long-context", files=(override,), sets=("serving.max_num_seqs=16",))
    # profile set 1M, the file lowered it, --set won over the file
    assert plan.settings.serving.max_model_len == 131072
    assert plan.provenance["serving.max_model_len"].file == str(override)
    assert plan.provenance["serving.max_model_len"].line == 2
    assert plan.settings.serving.max_num_seqs == 16
    assert str(plan.provenance["serving.max_num_seqs"]) == "--set #1"


def test_rule_violation_names_rule_reason_and_layer(tmp_path):
    with pytest.raises(RuleViolation) as info:
        plan_for("b300x4", sets=("cache.block_size=64",))
    text = info.value.one_line()
    assert "blackwell-block-size" in text and "128-token blocks" in text and "--set #1" in text
    override = tmp_path / "o.yaml"
    override.write_text("speculative:\n  method: dspark\n  tokens: 3\n")
    with pytest.raises(RuleViolation) as info:
        plan_for("h200x8", files=(override,))
    assert "hopper-no-dspark" in info.value.one_line() and f"{override}:2" in info.value.one_line()


def test_unknown_key_did_you_mean(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cache:\n  kv_dtype: fp8\n  blok_size: 64\n")
    with pytest.raises(InputError) as info:
        plan_for("b300x4", files=(bad,))
    assert "cache.block_size" in info.value.one_line() and f"{bad}:3" in info.value.one_line()


def test_bad_value_reports_source():
    with pytest.raises(InputError) as info:
        plan_for("b300x4", sets=("cache.kv_dtype=int3",))
    assert "cache.kv_dtype" in info.value.one_line() and "--set #1" in info.value.one_line()


def test_set_json_values_and_hostile_strings():
    plan = plan_for(
        "b300x4",
        sets=('engine.extra_args=["--foo", "a b; $(rm -rf /)"]', "model.served_name=x'; echo pwned"),
    )
    inv = build_invocation(derive(plan))
    assert inv.args[-2:] == ("--foo", "a b; $(rm -rf /)")
    assert flag(inv.args, "--served-model-name") == "x'; echo pwned"


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("max_num_seqs=64", "serving.max_num_seqs=64"),  # the last part of a setting's path
        ("cache.max_num_seqs=64", "serving.max_num_seqs=64"),  # in another section
        ("max_nm_seqs=64", "serving.max_num_seqs=64"),  # a close spelling of that last part
        ("serving.max_num_seq=64", "serving.max_num_seqs=64"),  # a close spelling of the path
        ("port=8001", "runtime.port=8001"),
    ],
)
def test_an_unknown_set_key_suggests_the_setting_and_the_flag_to_type(typed, meant):
    with pytest.raises(InputError) as info:
        plan_for("b300x4", sets=(typed,))
    line = info.value.one_line()
    assert f"did you mean {meant.split('=')[0]!r}? --set {meant}" in line, line


def test_an_unknown_key_suggests_no_section_and_no_far_setting():
    """`tensor_parallel` is not the section `parallelism`, and no setting is spelt near it."""
    for typed in ("tensor_parallel=3", "runtime.hf_tokn=x"):
        with pytest.raises(InputError) as info:
            plan_for("b300x4", sets=(typed,))
        assert "did you mean" not in info.value.one_line() and "plan --explain" in info.value.one_line()


def test_a_list_setting_given_a_bare_word_says_the_json_form_to_type(tmp_path):
    with pytest.raises(InputError) as info:
        plan_for("b300x4", sets=("engine.extra_args=--enforce-eager",))
    line = info.value.one_line()
    assert "valid tuple" not in line and "engine.extra_args is a list" in line and "JSON" in line
    assert "--set 'engine.extra_args=[\"--enforce-eager\"]'" in line, line
    with pytest.raises(InputError) as info:  # two flags in one word: two items, no space to wrap at
        plan_for("b300x4", sets=("engine.extra_args=--enforce-eager --seed 3",))
    assert '--set \'engine.extra_args=["--enforce-eager","--seed","3"]\'' in info.value.one_line()
    typed = plan_for("b300x4", sets=('engine.extra_args=["--enforce-eager"]',))  # the form it gives
    assert build_invocation(derive(typed)).args[-1] == "--enforce-eager"
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  extra_args: --enforce-eager\n")
    with pytest.raises(InputError) as info:  # from a file: its line, and a YAML list
        plan_for("b300x4", files=(bad,))
    assert f"{bad}:2" in info.value.one_line() and "a YAML list" in info.value.one_line()


def test_bad_set_syntax():
    with pytest.raises(InputError, match=r"key\.path=value"):
        plan_for("b300x4", sets=("nokey",))


def test_invalid_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("serving:\n  max_model_len: [1,\n")
    with pytest.raises(InputError) as info:
        plan_for("b300x4", files=(bad,))
    assert str(bad) in info.value.one_line()


def test_missing_file():
    with pytest.raises(InputError, match="not found"):
        plan_for("b300x4", files=(Path("/nonexistent.yaml"),))


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        ("mi355x8", ("mi355x", 8)),  # the x between product and count left out: the count kept
        ("h20x8", ("h200", 8)),
        ("b3004", ("b300", 4)),
        ("gb30x4", ("gb300", 4)),
        ("mi355", ("mi355x", None)),  # no count typed: none made up
        ("foo", None),
    ],
)
def test_a_misspelt_hardware_is_read_as_the_product_and_count_meant(typed, meant):
    from m31ctl.hardware import likely_spec

    assert likely_spec(typed) == meant


def test_an_unknown_hardware_suggests_the_host_typed_not_another_count():
    with pytest.raises(InputError) as info:
        simulated("mi355x8")
    assert "did you mean mi355xx8?" in info.value.one_line() and "x4" not in info.value.one_line()


def test_the_cli_suggests_the_host_typed_with_its_product_spelt_right(cli):
    result = cli("plan", "--hardware", "mi355x8")
    assert result.returncode == 2 and "did you mean mi355xx8?" in result.stderr, result.stderr


def test_unsupported_hardware_is_refused_with_what_was_found():
    with pytest.raises(UnsupportedHardware, match="RTX"):
        plan_for("rtxpro6000x4")
    with pytest.raises(UnsupportedHardware, match="MI300"):
        plan_for("mi300xx8")


def test_fit_requires_enough_gpus():
    plan = plan_for("h200x2")  # the selected recipe needs 8
    with pytest.raises(HostPreconditionError, match="needs 8 GPUs"):
        require_fit(derive(plan))


def test_hash_is_stable_and_changes_with_settings():
    assert plan_for("b300x4").hash == plan_for("b300x4").hash
    assert plan_for("b300x4").hash != plan_for("b300x4", sets=("serving.max_num_seqs=8",)).hash


def test_speculative_consistency():
    with pytest.raises(InputError, match="speculative"):
        plan_for("b300x4", sets=("speculative.method=none",))


# --- issue 13: the model's hard constraints on every hardware ---------------------------------
GPU_HOSTS = ("b300x4", "b200x8", "gb300x4", "rubinx4", "h200x8", "h100x8", "mi355xx8")


def _gpu_plans():
    for host in GPU_HOSTS:
        recipe = select_recipe(simulated(host))
        for variant in recipe.variants:
            for profile, option in recipe.profiles.items():
                if not option.unsupported:
                    yield (
                        host,
                        resolve(PlanRequest(hardware=simulated(host), variant=variant, profile=profile)),
                    )


def test_every_gpu_plan_carries_128_token_blocks_and_the_amd_backend():
    seen = 0
    for host, plan in _gpu_plans():
        args = list(build_invocation(derive(plan)).args)
        assert args[args.index("--block-size") + 1] == "128", host
        if plan.hardware.vendor == "amd":
            assert args[args.index("--attention-backend") + 1] == "TRITON_ATTN", host
        else:
            assert "--attention-backend" not in args, host
        seen += 1
    assert seen >= 20


def test_blackwell_and_rubin_plans_state_cuda_13_4(cli):
    for host in ("b300x4", "b200x8", "gb300x4", "rubinx4"):
        data = cli_json.data(cli("plan", "--hardware", host, "--json").stdout)
        assert data["requirements"] == {"cuda_driver": "13.4"}, host
        shown = cli("plan", "--hardware", host).stdout
        # What the recipe recommends, said as one word (doctor warns below it; nothing refuses it).
        assert "Recommended: a driver supporting CUDA 13.4 (doctor warns below it)" in shown
        assert "Requires:" not in shown and "recommended by the recipe" not in shown
    assert cli_json.data(cli("plan", "--hardware", "h200x8", "--json").stdout)["requirements"] == {}


def test_every_rule_has_a_source_shown_by_recipes_show(cli):
    for recipe in builtin_recipes().values():
        shown = cli_json.data(cli("recipes", "show", recipe.recipe, "--json").stdout)
        for rule in shown["rules"]:
            assert len(rule["source"]) > 8, (recipe.recipe, rule["id"])
        text = cli("recipes", "show", recipe.recipe).stdout
        assert text.count("  source: ") == len(recipe.rules)


def test_recipes_show_says_each_rule_in_words_and_json_keeps_its_structure(cli):
    text = cli("recipes", "show", "hopper", env={"COLUMNS": "400"}).stdout
    assert not any(repr_ in text for repr_ in ("{'", "['", "'fp8'", "False")), text
    for said in (
        "rule hopper-block-size: cache.block_size must equal 128 because",
        "rule hopper-indexer-cache: cache.indexer_dtype must be one of fp8, bf16 because",
        "rule hopper-no-video: multimodal.video must be false because",
    ):
        assert said in text, said
    amd = cli("recipes", "show", "mi355x", env={"COLUMNS": "400"}).stdout
    assert "speculative.draft_attention_backend must not be one of FLASHINFER_TS, FLASHINFER because" in amd
    rules = {r["id"]: r for r in cli_json.data(cli("recipes", "show", "hopper", "--json").stdout)["rules"]}
    assert rules["hopper-block-size"]["equals"] == 128
    assert rules["hopper-indexer-cache"]["one_of"] == ["fp8", "bf16"]


def test_a_rule_without_source_is_refused(tmp_path, cli):
    text = (ROOT / "recipes" / "hopper.yaml").read_text()
    stripped = "\n".join(line for line in text.splitlines() if not line.strip().startswith("source:"))
    path = tmp_path / "hopper.yaml"
    path.write_text(stripped)
    result = cli("recipes", "validate", str(path))
    assert result.returncode == 2 and "source" in result.stderr


def test_constraints_doc_is_generated_from_the_recipes():
    from m31ctl.cli.recipes import constraints_markdown

    assert (ROOT / "docs" / "constraints.md").read_text() == constraints_markdown(), (
        "run scripts/gen-constraints"
    )


def test_blocking_128_cannot_be_overridden_on_amd(cli):
    result = cli("plan", "--hardware", "mi355xx8", "--set", "cache.block_size=16")
    assert (
        result.returncode == 2
        and "mi350-block-size" in result.stderr
        and "No common block size" in result.stderr
    )
    backend = cli("plan", "--hardware", "mi355xx8", "--set", "attention_backend=FLASH_ATTN")
    assert backend.returncode == 2 and "mi350-triton-attention" in backend.stderr


def test_aiter_variant_says_what_it_switches_on(cli):
    data = cli_json.data(cli("plan", "--hardware", "mi355xx8", "--variant", "aiter", "--json").stdout)
    notes = " ".join(data["engine_notes"])
    assert "RMSNorm" in notes and "custom all-reduce" in notes
    assert data["settings"]["moe"]["expert_requantization"] == "mxfp8"


@pytest.mark.parametrize(("host", "tensor"), [("b200x8", 4), ("mi355xx8", 4)])
def test_fill_host_uses_every_gpu_with_data_parallel_replicas(host, tensor, cli, tmp_path):
    data = cli_json.data(
        cli("plan", "--hardware", host, "--set", "parallelism.fill_host=true", "--json").stdout
    )
    args = data["argv"]
    assert data["gpus_needed"] == 8 and not any("plan uses 4" in w for w in data["warnings"])
    assert args[args.index("--tensor-parallel-size") + 1] == str(tensor)
    assert args[args.index("--data-parallel-size") + 1] == "2"
    assert data["provenance"]["parallelism.data"].startswith("parallelism.fill_host: 2 replicas")
    # vLLM spreads the experts over all DP x TP = 8 ranks (FusedMoEParallelConfig.make), so each
    # replica holds more KV than a lone TP4: more than twice as many sequences
    assert "--enable-expert-parallel" in args
    assert data["provenance"]["parallelism.expert"].startswith("runtime shape: data parallelism on a MoE")
    layout = data["moe_layout"]  # stated in the plan, not warned
    assert layout["expert_parallel"] and layout["expert_parallel_size"] == 8
    assert layout["tensor_parallel_size"] == 1
    assert layout["expert_parallel_source"].startswith("runtime shape: data parallelism on a MoE")
    assert not any(w.startswith("MoE layout") for w in data["warnings"])
    alone = cli_json.data(cli("capacity", "--hardware", host, "--json").stdout)["fit"]
    filled = cli_json.data(
        cli("capacity", "--hardware", host, "--set", "parallelism.fill_host=true", "--json").stdout
    )["fit"]
    assert filled["sequences"] > 2 * alone["sequences"]
    assert filled["weights_per_gpu_gb"] < 0.6 * alone["weights_per_gpu_gb"]
    for target in ("script", "compose", "k8s", "systemd"):
        rendered = cli(
            "render", "--target", target, "--hardware", host, "--set", "parallelism.fill_host=true"
        )
        assert rendered.returncode == 0, (target, rendered.stderr)
        assert "--data-parallel-size" in rendered.stdout
    dry = cli_json.data(
        cli("launch", "--hardware", host, "--set", "parallelism.fill_host=true", "--dry-run", "--json").stdout
    )
    run = dry["docker_run"]
    if host.startswith("b200"):
        assert run[run.index("--gpus") + 1] == "8"
    else:
        assert dry["container"]["devices"] == ["/dev/kfd", "/dev/dri"]


def test_text_only_and_encoder_data_parallel_are_named_and_exclusive(cli):
    text = cli_json.data(
        cli("plan", "--hardware", "b300x4", "--set", "multimodal.text_only=true", "--json").stdout
    )
    assert "--language-model-only" in text["argv"]
    enc = cli_json.data(
        cli(
            "plan", "--hardware", "mi355xx8", "--set", "multimodal.encoder_data_parallel=true", "--json"
        ).stdout
    )["argv"]
    assert enc[enc.index("--mm-encoder-attn-backend") + 1] == "ROCM_AITER_FA"
    assert enc[enc.index("--mm-encoder-tp-mode") + 1] == "data" and "shm" in enc
    nv = cli_json.data(
        cli("plan", "--hardware", "h200x8", "--set", "multimodal.encoder_data_parallel=true", "--json").stdout
    )["argv"]
    assert nv[nv.index("--mm-encoder-attn-backend") + 1] == "FLASHINFER"
    both = cli(
        "plan", "--hardware", "b300x4", "--set", "multimodal.text_only=true",
        "--set", "multimodal.encoder_data_parallel=true",
    )  # fmt: skip
    assert both.returncode == 2 and "exclude each other" in both.stderr


def test_memo_keys_on_code_and_stays_bounded(tmp_path, monkeypatch):
    """An edit to the code that did the work is never answered from before it; the memo keeps
    its newest entries only."""
    import os

    from m31ctl import memo

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code = tmp_path / "worker.py"
    code.write_text("v1")
    calls: list[str] = []

    def work() -> str:
        calls.append(code.read_text())
        return code.read_text()

    assert memo.memoized("t", b"k", work, code=(str(code),)) == "v1"
    assert memo.memoized("t", b"k", work, code=(str(code),)) == "v1" and calls == ["v1"]
    code.write_text("v2!")  # an edit: size and mtime change
    assert memo.memoized("t", b"k", work, code=(str(code),)) == "v2!" and calls == ["v1", "v2!"]

    monkeypatch.setattr(memo, "MAX_ENTRIES", 3)
    folder = tmp_path / "cache" / "m31ctl" / "bounded"
    for n in range(6):
        memo.memoized("bounded", str(n).encode(), lambda n=n: n)
        for entry in folder.glob("*.json"):  # entry n is n seconds old on a clock of its own
            if entry.read_text().split("\n", 1)[-1] == str(n):  # below the header
                os.utime(entry, ns=(n * 10**9, n * 10**9))
    assert sorted(int(e.read_text().split("\n", 1)[-1]) for e in folder.glob("*.json")) == [3, 4, 5]


def test_parsed_recipe_cache_changes_nothing(tmp_path, monkeypatch):
    """Plans resolved from the parsed-file cache equal plans parsed from YAML, byte for byte in
    the order of every mapping (the memo once stored sorted keys, and `capacity`'s rows came out
    in another order); an unwritable cache directory falls back to parsing."""
    from m31ctl.plan import catalog as recipes_module
    from tests.conftest import run_cli

    def fresh_plans() -> list[str]:
        for loader in (
            recipes_module.builtin_recipes,
            recipes_module.defaults_layer,
            recipes_module.model_facts,
        ):
            loader.cache_clear()
        return [
            run_cli(command, "--hardware", h, *extra).stdout
            for h in ("b300x4", "h200x8", "mi355xx8")
            for command, *extra in (("plan", "--json"), ("plan", "--explain"), ("capacity", "--json"))
        ]

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = fresh_plans()  # parses and writes the cache
    assert list((tmp_path / "cache" / "m31ctl" / "parsed").glob("*.json"))
    assert fresh_plans() == first  # read back from the cache
    monkeypatch.setenv("M31CTL_NO_CACHE", "1")
    assert fresh_plans() == first
    monkeypatch.delenv("M31CTL_NO_CACHE")
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    assert fresh_plans() == first
    for loader in (recipes_module.builtin_recipes, recipes_module.defaults_layer, recipes_module.model_facts):
        loader.cache_clear()


# --- runtime shapes (m31ctl/plan/runtime_shapes.py) ----------------------------------------------


def shaped(hw: str, *sets: str, **kw):  # type: ignore[no-untyped-def]
    return plan_for(hw, sets=sets, **kw)


def test_the_nvfp4_decode_row_limit_sets_max_num_seqs_per_layout():
    for hw, profile, limit in (
        ("b300x4", "latency", 512),
        ("b300x4", "throughput", 128),
        ("rubinx4", "throughput", 128),
    ):
        p = shaped(hw, profile=profile)
        assert p.settings.serving.max_num_seqs == limit == p.max_num_seqs_limit
        source = str(p.provenance["serving.max_num_seqs"])
        assert "vllm-nvfp4-decode-rows" in source and "65536" in source
        inv = build_invocation(derive(p))
        assert flag(inv.args, "--max-num-seqs") == str(limit)
    # no MSA CUTLASS NVFP4 decode: ROCm, or an FP8 cache on Hopper
    for hw in ("mi355xx8", "h200x8"):
        p = shaped(hw)
        assert p.settings.serving.max_num_seqs is None and p.max_num_seqs_limit is None
    # fewer draft tokens, more requests: 65536 // (16 heads x 4)
    assert shaped("b300x4", "speculative.tokens=3").settings.serving.max_num_seqs == 1024


def test_a_plan_past_the_decode_row_limit_is_refused_with_the_source(cli, tmp_path):
    from m31ctl.errors import RuleViolation

    with pytest.raises(RuleViolation) as caught:
        shaped("b300x4", "serving.max_num_seqs=1024", profile="throughput")
    line = caught.value.one_line()
    assert "vllm-nvfp4-decode-rows" in line and "msa_cutlass_sparse_decode.py" in line and "--set #1" in line
    assert "at most 128 decoding requests" in line
    layer = tmp_path / "bench-profile.yaml"  # what a bench sweep may have written
    layer.write_text("serving:\n  max_num_seqs: 600\n")
    result = cli("plan", "--hardware", "b300x4", "-f", str(layer))
    assert result.returncode == 2 and "bench-profile.yaml" in result.stderr
    assert shaped("b300x4", "serving.max_num_seqs=300").settings.serving.max_num_seqs == 300


def test_bench_profile_never_writes_past_the_runtime_limit():
    from m31ctl.served import profile
    from m31ctl.served.figures import Point

    fields = {name: 0 for name in Point._fields}
    point = Point(**{**fields, "concurrency": 1024, "requests": 2048, "spec": None, "error": None})  # type: ignore[arg-type]
    text = profile.profile_yaml(point, "chat", (), "measured", 1, max_num_seqs_limit=512)
    assert "  max_num_seqs: 512\n" in text and "capped from 1024" in text
    assert "  max_num_seqs: 1024\n" in profile.profile_yaml(point, "chat", (), "measured", 1)


def test_the_moe_layout_is_stated_and_expert_parallelism_decided():
    dep = shaped("b300x4", profile="throughput")
    assert dep.moe_layout is not None and dep.moe_layout.how().startswith("expert parallelism over 4 ranks")
    # DP without a word on EP: decided, with the rule as the source
    filled = shaped("b200x8", "parallelism.fill_host=true")
    assert filled.settings.parallelism.expert is True
    assert "runtime shape" in str(filled.provenance["parallelism.expert"])
    # said explicitly: kept, and the flattened TP layout stated as vLLM builds it
    flat = shaped("b200x8", "parallelism.fill_host=true", "parallelism.expert=false")
    assert "--enable-expert-parallel" not in build_invocation(derive(flat)).args
    assert flat.moe_layout is not None and "flattened over DP x TP = 8 ranks" in flat.moe_layout.how()
    assert (flat.moe_layout.expert_size, flat.moe_layout.tensor_size) == (1, 8)
    # TP alone: stated too (vLLM's MoE is TP4 over every expert), and nothing to warn
    tp4 = shaped("b300x4")
    assert not any(w.startswith("MoE layout") for w in tp4.warnings)
    assert tp4.moe_layout is not None and "flattened over DP x TP = 4 ranks" in tp4.moe_layout.describe()
    assert tp4.moe_layout.experts_per_gpu() == "every expert, a 1/4 slice of each"
    assert resolve(PlanRequest(hardware=simulated("cpu"), recipe="cpu")).moe_layout is None  # no experts


def test_a_moe_group_split_over_nodes_and_cross_node_moe_without_rdma_are_warned():
    dep8 = ("parallelism.nodes=2", "parallelism.tensor=1", "parallelism.data=8", "parallelism.expert=true")
    split = shaped("b200x8", *dep8)
    assert any("fits one node of 8 GPUs" in w and "4 ranks on each node" in w for w in split.warnings)
    assert any("over TCP sockets" in w and "set fabric.rdma" in w for w in split.warnings)
    rdma = shaped(
        "b300x4", *dep8[:1], "parallelism.data=2", "fabric.rdma={}", "kubernetes.pod_security=privileged"
    )
    assert not any("TCP sockets" in w for w in rdma.warnings)
    assert rdma.moe_layout is not None and "across 2 nodes" in rdma.moe_layout.how()  # stated, not warned
    assert not any("fits one node" in w for w in rdma.warnings)  # 8 ranks on 4-GPU nodes
