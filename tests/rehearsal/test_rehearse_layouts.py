"""`m31ctl rehearse`: the twin, the pods read from the rendered manifest, the log reading (fast,
no Docker); then real rehearsals with vLLM's CPU build in Docker (marked docker, vllm, slow)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from m31ctl.deployment import derive
from m31ctl.errors import InputError
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.rehearsal import logs
from m31ctl.rehearsal.pods import read_manifest, refuse_secret_expansion, service_links
from m31ctl.rehearsal.prepared import prepare
from m31ctl.rehearsal.session import Options
from m31ctl.render.kubelet_expansion import literal
from tests.conftest import ROOT
from tests.support import cli_json
from tests.support.readme import readme_command, run_as_written
from tests.support.rehearsal import DP, DP_DENSE, RWX, leftovers, needs_image, set_flags

PP = ("parallelism.nodes=2", "parallelism.tensor=8")
# README's rehearse example (its Rehearsal section), which test_two_node_dp_rehearsal_serves runs
# as written: the README's text is what that test proves (tests/test_readme_commands.py).
README_EXAMPLE = "m31ctl rehearse --hardware b300x4 --set parallelism.nodes=2"


def _plan(*sets: str):
    return resolve(PlanRequest(hardware=simulated("b300x4"), sets=(*sets, *RWX)))


def _prepared(tmp_path: Path, *sets: str):
    return prepare(_plan(*sets), Options(cache_dir=tmp_path))


def test_dp_twin_keeps_the_shape_and_says_what_it_scaled(tmp_path):
    prepared = _prepared(tmp_path, *DP)
    par = prepared.twin.plan.settings.parallelism
    assert (par.nodes, par.tensor, par.pipeline, par.data, par.expert) == (2, 1, 1, 2, True)
    assert prepared.twin.moe  # expert parallelism needs a model with experts
    changed = {c.key: c for c in prepared.twin.changes}
    assert changed["parallelism.data"].plan == 8 and changed["parallelism.data"].twin == 2
    assert "headless" in changed["parallelism.data"].why
    assert "speculative.method" in changed and "model.path" in changed
    # Names, ports and the served model name are the plan's.
    kept = prepared.twin.plan.settings
    assert kept.runtime.container_name == prepared.twin.original.settings.runtime.container_name
    assert kept.model.served_name == "MiniMax-M3.1-Flash"


def test_pp_twin_is_one_stage_a_node_over_ray(tmp_path):
    prepared = _prepared(tmp_path, *PP)
    par = prepared.twin.plan.settings.parallelism
    assert (par.nodes, par.tensor, par.pipeline, par.data) == (2, 1, 2, 1)
    leader, worker = prepared.manifest.pods
    assert leader.command is not None and "ray start --head" in leader.command[-1]
    assert worker.command is not None and "ray start --address=" in worker.command[-1]


def test_one_node_keeps_two_ranks_in_one_pod(tmp_path):
    for sets, shape in (
        (("parallelism.tensor=4",), (2, 1)),
        (("parallelism.tensor=1", "parallelism.data=4"), (1, 2)),
    ):
        twin = _prepared(tmp_path, *sets).twin
        par = twin.plan.settings.parallelism
        assert (par.nodes, par.tensor, par.data) == (1, *shape) and twin.ranks_per_node == 2
        # One core per rank: with 'auto' both ranks of one pod bound to the same core.
        assert twin.plan.settings.runtime.env["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"


def test_pods_get_the_lws_environment_and_dns_names(tmp_path):
    prepared = _prepared(tmp_path, *DP)
    leader, worker = prepared.manifest.pods
    name = derive(prepared.twin.plan).name
    address = f"{name}-0.{name}.default"
    assert dict(leader.env)["LWS_LEADER_ADDRESS"] == dict(worker.env)["LWS_LEADER_ADDRESS"] == address
    assert (dict(leader.env)["LWS_WORKER_INDEX"], dict(worker.env)["LWS_WORKER_INDEX"]) == ("0", "1")
    assert dict(worker.env)["LWS_GROUP_SIZE"] == "2"
    assert address in leader.aliases and address not in worker.aliases
    # The pod's own command, unchanged: the shell expands the LWS variables, not the rehearsal.
    assert worker.command is not None and "--headless" in worker.command[-1]
    assert "LWS_WORKER_INDEX" in worker.command[-1]
    assert [p.describe() for p in leader.probes][:2] == [
        "startup GET :8000/health",
        "liveness GET :8000/health",
    ]
    assert worker.probes == ()
    # The pod's memory-backed /dev/shm (emptyDir sizeLimit, a Kubernetes quantity) becomes a tmpfs
    # of the same bytes as the plan's runtime.shm_size.
    from m31ctl.rehearsal.kubelet import run_args
    from m31ctl.units import parse_size

    create = run_args(leader, "s", "net")
    (shm,) = [m for m in create["host"]["mounts"] if m["Target"] == "/dev/shm"]
    shm_size = prepared.twin.plan.settings.runtime.shm_size
    assert shm == {"Type": "tmpfs", "Target": "/dev/shm", "TmpfsOptions": {"SizeBytes": parse_size(shm_size)}}


def _lws(command: list[str], env: list[dict[str, object]], links: bool = False) -> list[dict[str, object]]:
    container = {"name": "vllm", "image": "i", "command": command, "env": env}
    pod = {"spec": {"containers": [container], "enableServiceLinks": links}}
    lws = {
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "x"},
        "spec": {"leaderWorkerTemplate": {"size": 1, "workerTemplate": pod}},
    }
    service = {
        "kind": "Service",
        "metadata": {"name": "vllm"},
        "spec": {"ports": [{"name": "http", "port": 80}]},
    }
    return [lws, service]


def test_kubelet_expansion_applies_to_env_and_command():
    env = [{"name": "A", "value": "$(LWS_GROUP_SIZE)-$(MISSING)"}, {"name": "B", "value": literal("$(A)")}]
    (pod,) = read_manifest(_lws(["echo", "$(A)", "$$(A)", literal("$(B)")], env)).pods
    assert dict(pod.env)["A"] == "1-$(MISSING)" and dict(pod.env)["B"] == "$(A)"
    assert pod.command == ("echo", "1-$(MISSING)", "$(A)", "$(B)")


def test_init_containers_come_first_and_share_the_pods_env():
    container = {"name": "vllm", "image": "i", "args": ["$(A)"], "env": [{"name": "A", "value": "a"}]}
    init = {"name": "pull", "image": "i", "command": ["echo", "$(A)"], "env": [{"name": "A", "value": "b"}]}
    pod = {"spec": {"initContainers": [init], "containers": [container]}}
    deployment = {"kind": "Deployment", "metadata": {"name": "d"}, "spec": {"template": pod}}
    first, main = read_manifest([deployment]).pods
    assert (first.init, first.command, first.aliases) == (True, ("echo", "b"), ())
    assert (main.init, main.args, main.role, main.aliases) == (False, ("a",), "server", ("d-0",))


def test_service_links_set_vllm_port_when_enabled():
    """A Service named vllm injects VLLM_PORT, which vLLM reads as its own setting."""
    (pod,) = read_manifest(_lws(["true"], [], links=True)).pods
    assert dict(pod.env)["VLLM_PORT"].startswith("tcp://")
    assert ("VLLM_SERVICE_PORT_HTTP", "80") in service_links(_lws(["true"], [])[1:])


def test_rendered_dollars_reach_the_command_literally(tmp_path):
    """The render doubles every `$` of a plan value, so the kubelet's expansion gives the
    process the value as written (a `$(VLLM_API_KEY)` in a flag is never the key)."""
    plan = _plan(*DP, 'engine.extra_args=["--hf-overrides","$(VLLM_API_KEY)"]', "runtime.api_key=true")
    leader, _ = prepare(plan, Options(cache_dir=tmp_path)).manifest.pods
    assert leader.command is not None and "'$(VLLM_API_KEY)'" in leader.command[-1]


def test_a_command_that_expands_a_secret_is_refused():
    docs = _lws(
        ["echo", "$(KEY)"], [{"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]
    )
    with pytest.raises(InputError, match="expands the secret KEY"):
        refuse_secret_expansion(read_manifest(docs))


def test_only_the_k8s_target_is_rehearsed(tmp_path):
    with pytest.raises(InputError, match="k8s"):
        prepare(_plan(), Options(target="compose", cache_dir=tmp_path))


# The modules that make the twin and read it once (prepare); runner.py names the Plan it is handed.
READ_THE_PLAN = {"prepared", "twin", "pods", "runner"}


def test_after_prepare_no_step_reads_the_plan_or_its_deployment():
    """The steps after prepare (the cluster, the kubelet, the proofs, the result) read what
    prepare derived once (Prepared), never the plan or the Deployment again."""
    import ast

    for path in sorted((ROOT / "m31ctl" / "rehearsal").glob("*.py")):
        if path.stem in READ_THE_PLAN:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            assert not [n for n in names if n.startswith(("m31ctl.deployment", "m31ctl.plan"))], path.name


def test_a_node_log_gives_ranks_ready_time_and_vllms_error_line():
    text = "\n".join(
        [
            "2026-12-01T14:49:58.123456789Z (EngineCore_DP0 pid=32) INFO [multiproc_executor.py:153] DP group "
            "leader: node_rank=0, node_rank_within_dp=0, master_addr=127.0.0.1, mq_connect_ip=172.18.0.2 (local)",
            "2026-12-01T14:50:00.000000000Z (EngineCore_DP0 pid=32) INFO init engine (profile, create kv cache, "
            "warmup model) took 3.08 s",
            "2026-12-01T14:50:01.000000000Z Traceback (most recent call last):",
            "2026-12-01T14:50:01.000000000Z pydantic_core._pydantic_core.ValidationError: 1 validation error",
            "2026-12-01T14:50:01.000000000Z   Value error, Number of experts in the model must be greater than 0 "
            "when expert parallelism is enabled. [type=value_error]",
        ]
    )
    read = logs.read_log(text)
    assert read.ranks[0].startswith("DP group leader: node_rank=0") and "172.18.0.2" in read.ranks[0]
    assert read.engine_ready_at is not None
    assert read.error_line is not None and "Number of experts" in read.error_line
    assert read.cause == "expert parallelism on a model without experts"
    worker = logs.read_log(
        "\n".join(
            "2026-12-01T14:57:17Z (Worker_DP1_EP1 pid=36) ERROR 12-01 14:57:17 [multiproc_executor.py:1063] "
            + line
            for line in (
                "Traceback (most recent call last):",
                '  File "/opt/vllm/lib/python3.11/site-packages/vllm/distributed/device_communicators/'
                'base_device_communicator.py", line 296, in all_gatherv',
                "    raise NotImplementedError",
                "NotImplementedError",
                "RuntimeError: Worker failed with error '', please check the stack trace above for the root cause",
            )
        )
    )
    assert worker.error_line == "NotImplementedError at base_device_communicator.py:296 in all_gatherv"
    assert worker.cause and "expert parallelism across data-parallel ranks" in worker.cause
    shell = logs.read_log("2026-12-01T14:50:01Z /bin/sh: 2: ray: not found")
    assert shell.error_line == "/bin/sh: 2: ray: not found" and shell.cause and "Ray" in shell.cause


# Real rehearsals: Docker, the rehearsal image, about 2 CPU-minutes each on two cores.
heavy = [pytest.mark.docker, pytest.mark.vllm, pytest.mark.slow]


def _rehearse(*args: str, timeout: int = 1800) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "m31ctl", "rehearse", "--hardware", "b300x4", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )


def test_the_readme_example_is_the_dense_dp_layout_over_two_nodes():
    """What test_two_node_dp_rehearsal_serves runs (README's example, as written) is the layout
    its checks are about: DP8 x TP1 without expert parallelism over two nodes of a b300x4."""
    words = shlex.split(readme_command(README_EXAMPLE).text)
    sets = [words[i + 1] for i, word in enumerate(words[:-1]) if word == "--set"]
    assert words[:2] == ["m31ctl", "rehearse"] and words[words.index("--hardware") + 1] == "b300x4"
    assert sorted(sets) == sorted((*DP_DENSE, *RWX)) and "--json" in words


@pytest.mark.parametrize("_", [0], ids=["dp2-over-two-nodes"])
@needs_image
@pytest.mark.docker
@pytest.mark.vllm
@pytest.mark.slow
def test_two_node_dp_rehearsal_serves(_, tmp_path):
    """README's rehearse example, read from README.md and run exactly as written (its own
    --timeout: the default 600 s)."""
    done = run_as_written(readme_command(README_EXAMPLE), tmp_path, timeout=900)
    result = cli_json.data(done.stdout)
    print(json.dumps({k: result[k] for k in ("served", "layout", "timings_s", "failure", "error_line")}))
    assert done.returncode == 0 and result["served"], done.stderr[-2000:]
    leader, worker = result["nodes"]
    assert leader["role"] == "leader" and worker["role"] == "worker"
    assert leader["ready_s"] and worker["ready_s"]
    assert any("headless" in line for line in worker["ranks"])
    assert result["probes_passed"] == len(result["probes"]) >= 3
    assert result["completions"] >= 4 and result["smoke"]["ok"]
    assert result["cleaned"] and not leftovers()


@needs_image
@pytest.mark.docker
@pytest.mark.vllm
@pytest.mark.slow
def test_a_plan_vllm_refuses_fails_with_vllms_own_line():
    """More sequences than the CPU build's token budget: vLLM's SchedulerConfig refuses it at
    start, on every node; the rehearsal exits non-zero quoting that line. (With the recipe's NVFP4
    caches m31ctl refuses 4096 itself, before any container: the decode row limit, issue 35; FP8
    caches have no such limit, so the plan goes through and vLLM's own refusal is what shows.)"""
    refused = _rehearse(*set_flags(*DP_DENSE, *RWX, "serving.max_num_seqs=4096"), "--timeout", "900")
    assert refused.returncode == 2 and "NVFP4" in refused.stderr and not leftovers()
    fp8 = ("cache.kv_dtype=fp8", "cache.indexer_dtype=fp8")
    done = _rehearse(*set_flags(*DP_DENSE, *RWX, *fp8, "serving.max_num_seqs=4096"), "--timeout", "900")
    result = cli_json.data(done.stdout)
    assert done.returncode == 5 and not result["served"]
    assert "must be greater than or equal to max_num_seqs (4096)" in result["error_line"]
    assert result["cleaned"] and not leftovers()


@needs_image
@pytest.mark.docker
@pytest.mark.vllm
@pytest.mark.slow
def test_pp_over_ray_fails_with_the_pods_own_error():
    """The CPU image has no Ray: the leader's `ray start` is the shell's error, named."""
    done = _rehearse(*set_flags(*PP, *RWX), "--timeout", "600")
    result = cli_json.data(done.stdout)
    assert done.returncode == 5 and "ray: not found" in result["error_line"]
    assert "Ray" in result["cause"] and result["cleaned"] and not leftovers()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
@needs_image
@pytest.mark.docker
@pytest.mark.slow
def test_ctrl_c_leaves_no_container_network_or_volume(signum):
    child = subprocess.Popen(
        [sys.executable, "-m", "m31ctl", "rehearse", "--hardware", "b300x4", *set_flags(*DP_DENSE, *RWX)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        # A child started from a non-interactive shell inherits SIGINT ignored: give it the default.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert child.stderr is not None
    seen = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = child.stderr.readline()
        seen.append(line)
        if ("started" in line and "container" in line) or not line:
            break
    assert leftovers(), f"nothing was started: {''.join(seen)[-2000:]}"
    os.kill(child.pid, signum)
    _, err = child.communicate(timeout=180)
    assert child.returncode == 130, err[-2000:]
    assert not leftovers()
