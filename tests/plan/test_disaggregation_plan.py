"""Prefill/decode disaggregation as a plan (issue 36): the roles are engines derived from the
plan's settings, the pair is refused before anything starts when vLLM could not pair it, and the
adapters spell each role's KV transfer and the router's command line."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from m31ctl.deployment import derive, require_fit
from m31ctl.engine.adapter import build_invocation
from m31ctl.errors import ExitCode, HostPreconditionError, InputError
from m31ctl.hardware import simulated
from m31ctl.pair import PairWiderThanHost, loopback_front_invocation, loopback_router_invocation, on_one_host
from m31ctl.plan import PlanRequest, resolve
from m31ctl.plan.disaggregation import CONNECTORS, Role
from tests.conftest import run_cli
from tests.ports import free_ports
from tests.support import cli_json

PD = "disaggregation.enabled=true"


def plan_for(spec: str, *sets: str):  # type: ignore[no-untyped-def]
    return resolve(PlanRequest(hardware=simulated(spec), sets=(PD, *sets)))


def _kv_config(args: tuple[str, ...]) -> dict:  # type: ignore[type-arg]
    return json.loads(args[args.index("--kv-transfer-config") + 1])


def test_each_role_is_an_engine_with_its_side_of_the_transfer():
    group = derive(plan_for("b300x8")).disaggregated
    assert group is not None and group.fits_one_host
    prefill, decode = (build_invocation(role) for role in group.roles)
    assert _kv_config(prefill.args) == {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    assert _kv_config(decode.args) == {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
    assert prefill.env_dict["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"
    assert decode.env_dict["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5700"
    # The Blackwell recipe's engine, twice: TP4 each, on GPUs of their own.
    assert [r.layout.gpus for r in group.roles] == [4, 4]
    assert [r.gpus.indices for r in group.roles] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [r.network.port for r in group.roles] == [8100, 8200]
    assert all(r.network.bind == "127.0.0.1" for r in group.roles)


def test_the_routers_front_is_the_plans_endpoint_and_the_router_pairs_the_roles_on_loopback():
    deployment = derive(plan_for("b300x8", "runtime.port=9000"))
    group = deployment.disaggregated
    assert group is not None and deployment.network.port == 9000
    argv = loopback_router_invocation(group).argv
    assert argv[0] == "vllm-router" and "--vllm-pd-disaggregation" in argv
    assert argv[argv.index("--prefill") + 1] == "http://127.0.0.1:8100"
    assert argv[argv.index("--decode") + 1] == "http://127.0.0.1:8200"
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--port") + 1] == "30000"
    assert argv[argv.index("--kv-connector") + 1] == "nixl"
    front = loopback_front_invocation(deployment).argv
    assert front[front.index("--port") + 1] == "9000" and front[front.index("--upstream-port") + 1] == "30000"


def test_a_group_is_not_one_engine():
    with pytest.raises(InputError, match="prefill/decode group"):
        build_invocation(derive(plan_for("b300x8")))


def test_an_aggregated_plan_keeps_its_identity():
    """Plans that do not disaggregate hash, lock and render as before the section existed."""
    plan = resolve(PlanRequest(hardware=simulated("b300x4")))
    assert "disaggregation" not in plan.settings_dict()
    assert derive(plan).disaggregated is None


def test_roles_take_their_own_layout():
    group = derive(plan_for("b300x8", "disaggregation.prefill.tensor=2", "disaggregation.decode.data=2",
                            "disaggregation.decode.tensor=2")).disaggregated  # fmt: skip
    assert group is not None
    assert [(r.layout.tensor, r.layout.data) for r in group.roles] == [(2, 1), (2, 2)]
    assert [r.gpus.indices for r in group.roles] == [(0, 1), (2, 3, 4, 5)]


def test_a_pair_wider_than_the_host_is_not_one_host():
    group = derive(plan_for("b300x4")).disaggregated
    assert group is not None and not group.fits_one_host  # 4 + 4 GPUs on a 4-GPU host: Kubernetes only


def test_a_pair_wider_than_the_host_says_so_at_plan_time_in_the_refusals_words():
    """B300x4: each TP4 role fits a node, the pair does not fit the host. The plan says so when it
    is made (Kubernetes places each role on a node of its own; the single-host targets refuse it),
    in the words the refusal uses (issue 53: the plan was silent until render --target compose)."""
    plan = plan_for("b300x4")
    (note,) = [w for w in plan.warnings if "prefill/decode pair" in w]
    assert "needs 8 GPUs (4 prefill, 4 decode) on one host" in note and "render --target k8s" in note
    with pytest.raises(PairWiderThanHost) as refused:
        on_one_host(derive(plan), "compose")
    assert refused.value.message.startswith(note.split(":")[0] + ": a compose runs on one host")


def _advised(plan) -> list[str]:  # type: ignore[no-untyped-def]
    return [m.group(1) for w in plan.warnings for m in [re.search(r"--set (\S+)", w)] if m]


@pytest.mark.parametrize(
    ("spec", "sets"),
    [
        ("b300x8", (PD,)),  # advised parallelism.fill_host, which a P/D plan refuses (issue 53)
        ("b300x16", (PD,)),
        ("b300x8", (PD, "disaggregation.decode.tensor=2")),
        ("b300x8", ()),
        ("b300x8", ("parallelism.tensor=2",)),
    ],
)
def test_a_plan_never_advises_a_setting_it_then_refuses(spec, sets):
    request = PlanRequest(hardware=simulated(spec), sets=sets)
    for setting in _advised(resolve(request)):
        followed = resolve(request._replace(sets=(*sets, setting)))
        assert not [w for w in followed.warnings if "GPUs" in w and "--set" in w], followed.warnings


def test_a_pair_counts_both_roles_against_the_host():
    assert not [w for w in plan_for("b300x8").warnings if "GPUs" in w]  # 4 + 4 on 8: the host is full
    (note,) = [w for w in plan_for("b300x8", "disaggregation.decode.tensor=2").warnings if "GPUs" in w]
    assert note.startswith("the prefill/decode pair uses 6 of the 8 GPUs (4 prefill, 2 decode)")
    assert "--set disaggregation.decode.data=2 serves on 8" in note


@pytest.mark.parametrize(
    ("sets", "key", "words"),
    [
        (("disaggregation.connector=lmcache",), "disaggregation.connector", "does not support HMA"),
        (("disaggregation.connector=moriio",), "disaggregation.connector", "does not run on cuda"),
        (("disaggregation.decode.kv_dtype=fp8",), "disaggregation.decode.kv_dtype", "KV cache dtype"),
        (("disaggregation.decode.image=vllm/vllm-openai:v0.33.0",), "disaggregation.decode.image",
         "vLLM version"),
        (("disaggregation.decode.port=8000",), "disaggregation.decode.port", "also runtime.port"),
        (("disaggregation.prefill.data=2", "disaggregation.prefill.tensor=2",
          "disaggregation.decode.side_channel_port=5601"), "disaggregation.decode.side_channel_port",
         "5601 is also disaggregation.prefill.side_channel_port"),
        (("parallelism.data=2",), "parallelism.data", "each role on its own"),
        (('engine.extra_args=["--kv-transfer=x"]',), "engine.extra_args", "--kv-transfer sets what"),
    ],
)  # fmt: skip
def test_a_pair_vllm_could_not_serve_is_refused_naming_the_setting(sets, key, words):
    with pytest.raises(InputError) as caught:
        plan_for("b300x8", *sets)
    assert caught.value.message.startswith(f"{key}: ") and words in caught.value.message


MORIIO = ("disaggregation.enabled=true", "disaggregation.connector=moriio")


def test_moriio_is_refused_with_its_reason_on_amd_and_as_foreign_on_nvidia():
    """vllm-router pairs MoRIIO only in discovery mode, which m31ctl does not render (issue 49):
    refused on AMD naming the router's own refusal and the extra config, with NIXL as the way;
    on NVIDIA the platform refusal comes first, its hint naming only connectors m31ctl pairs."""
    with pytest.raises(InputError) as amd:
        plan_for("mi355xx8", "disaggregation.connector=moriio")
    assert amd.value.message.startswith("disaggregation.connector: m31ctl cannot pair MoRIIOConnector yet: ")
    for words in ("only in ZMQ discovery mode", "MoRI-IO KV connector requires service discovery",
                  "proxy_ip, proxy_ping_port, http_port"):  # fmt: skip
        assert words in amd.value.message
    assert amd.value.hint == "use disaggregation.connector=nixl, which runs on rocm too"
    assert amd.value.where == "--set #2"
    with pytest.raises(InputError) as nvidia:
        plan_for("b300x8", "disaggregation.connector=moriio")
    assert "does not run on cuda" in nvidia.value.message
    assert nvidia.value.hint == "use disaggregation.connector=mooncake or nixl"
    assert CONNECTORS["moriio"].unpaired and not CONNECTORS["nixl"].unpaired


def test_amd_pairs_over_nixl_by_default():
    group = derive(plan_for("mi355xx8")).disaggregated
    assert group is not None
    assert {_kv_config(build_invocation(r).args)["kv_connector"] for r in group.roles} == {"NixlConnector"}


@pytest.mark.parametrize("json_out", [False, True])
def test_moriio_refusal_through_the_cli_is_one_line_and_exit_2(json_out):
    sets = [a for s in MORIIO for a in ("--set", s)]
    done = run_cli("plan", "--hardware", "mi355xx8", *sets, *(["--json"] if json_out else []))
    assert done.returncode == ExitCode.BAD_INPUT == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.count("\n") == 1
    assert done.stderr.startswith(
        "m31ctl: error: --set #2: disaggregation.connector: m31ctl cannot pair MoRIIOConnector yet: "
    )
    assert done.stderr.rstrip().endswith("(use disaggregation.connector=nixl, which runs on rocm too)")
    if json_out:
        error = cli_json.error(done.stdout)
        assert error["exit_code"] == 2 and error["where"] == "--set #2"
        assert error["message"].startswith("disaggregation.connector: m31ctl cannot pair MoRIIOConnector")
    else:
        assert done.stdout == ""


@pytest.mark.vllm
def test_the_pinned_router_refuses_moriio_with_the_urls_m31ctl_renders(vllm_py):
    """The refusal's premise, on the real vllm-router (0.1.17, beside the tests' vLLM): the
    router command m31ctl renders for an AMD pair, with --kv-connector moriio, exits at start.
    When a router pairs MoRIIO over fixed URLs this fails, and the refusal is to be revisited."""
    router = Path(vllm_py).parent / "vllm-router"
    if not router.exists():
        pytest.skip(f"no vllm-router beside {vllm_py}")
    group = derive(plan_for("mi355xx8")).disaggregated
    assert group is not None
    argv = list(loopback_router_invocation(group).argv)
    port, metrics, prefill, decode = free_ports(4)
    values = {"--kv-connector": "moriio", "--port": str(port), "--prometheus-port": str(metrics),
              "--prefill": f"http://127.0.0.1:{prefill}", "--decode": f"http://127.0.0.1:{decode}",
              "--worker-startup-timeout-secs": "5"}  # fmt: skip
    for flag, value in values.items():
        argv[argv.index(flag) + 1] = value
    done = subprocess.run([str(router), *argv[1:]], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0, done.stderr[-2000:]
    assert "MoRI-IO KV connector requires service discovery" in done.stderr, done.stderr[-2000:]


def test_every_connector_the_router_pairs_declares_hybrid_support():
    assert all(c.hybrid for c in CONNECTORS.values() if c.router_name)
    assert Role.PREFILL.kv_role == "kv_producer" and Role.DECODE.kv_role == "kv_consumer"


def test_a_role_engine_is_refused_as_the_server_it_is():
    """The engine rules run for each role: TP3 cannot divide the attention heads."""
    with pytest.raises(InputError) as caught:
        plan_for("b300x8", "disaggregation.decode.tensor=3")
    assert "tensor" in caught.value.message


def test_fit_is_per_role():
    deployment = derive(plan_for("b300x4", "disaggregation.decode.tensor=8"))
    with pytest.raises(HostPreconditionError):
        require_fit(deployment)


def test_plan_json_lists_roles_and_router():
    done = run_cli("plan", "--hardware", "cpu", "--variant", "pd", "--json")
    assert done.returncode == 0, done.stderr
    pd = cli_json.data(done.stdout)["disaggregation"]
    assert [pd[r]["kv_role"] for r in ("prefill", "decode")] == ["kv_producer", "kv_consumer"]
    assert pd["router"]["argv"][0] == "vllm-router" and pd["one_host"] is True
    # The plan shows the front on its address, its program by name (issue 49).
    front = pd["front"]["argv"]
    assert front[:3] == ["python3", "-c", "<m31ctl/engine/router_front.py>"], front
    assert front[front.index("--port") + 1] == "8000"


def test_a_refusal_is_one_line_and_exit_2():
    done = run_cli("plan", "--hardware", "b300x8", "--set", PD, "--set", "disaggregation.connector=lmcache")
    assert done.returncode == ExitCode.BAD_INPUT
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def _role_engines(*sets: str):  # type: ignore[no-untyped-def]
    group = derive(plan_for("b300x8", *sets)).disaggregated
    assert group is not None
    return {r.kv_transfer.role: (r, build_invocation(r).args) for r in group.roles if r.kv_transfer}


def test_each_roles_own_layout_settles_the_runtime_shapes():
    """The runtime shapes (plan/runtime_shapes.py) run on each role's own tensor and data size: a
    decode role at TP2 meets the NVFP4 decode row limit at 256 requests (32 query heads per rank x
    8 query tokens), not the plan's TP4 512; a decode role at DP4 gets expert parallelism. The
    plan settles one value both roles run, with the role that set it as its source."""
    engines = _role_engines("disaggregation.decode.tensor=2")
    for role in Role:
        args = engines[role][1]
        assert args[args.index("--max-num-seqs") + 1] == "256"
        assert engines[role][0].plan.max_num_seqs_limit == 256
    dep4 = plan_for("b300x8", "disaggregation.decode.tensor=1", "disaggregation.decode.data=4")
    assert dep4.settings.serving.max_num_seqs == 128  # 64 heads per rank x 8 query tokens
    assert "the decode role's layout" in str(dep4.provenance["serving.max_num_seqs"])
    assert "decided by the decode role's DP4" in str(dep4.provenance["parallelism.expert"])
    dep4_engines = _role_engines("disaggregation.decode.tensor=1", "disaggregation.decode.data=4")
    decode, args = dep4_engines[Role.DECODE]
    assert "--enable-expert-parallel" in args and args[args.index("--max-num-seqs") + 1] == "128"
    assert decode.plan.moe_layout is not None and decode.plan.moe_layout.expert_size == 4
    # said explicitly: refused where a role's own layout cannot run it, the role named
    with pytest.raises(InputError, match=r"disaggregation\.decode: serving\.max_num_seqs=512 .*at most 256"):
        plan_for("b300x8", "disaggregation.decode.tensor=2", "serving.max_num_seqs=512")


def test_plan_json_states_each_roles_moe_layout():
    from m31ctl.cli.views import plan_json

    deployment = derive(plan_for("b300x8", "disaggregation.decode.tensor=1", "disaggregation.decode.data=4"))
    data = plan_json(deployment, None)
    pd = data["disaggregation"]
    assert (pd["prefill"]["moe_layout"]["ranks"], pd["decode"]["moe_layout"]["ranks"]) == (4, 4)
    assert data["moe_layout"] == pd["decode"]["moe_layout"]  # the single-engine keys are decode's
    assert pd["decode"]["moe_layout"]["experts_per_gpu"] == "1/4 of the experts, whole"
