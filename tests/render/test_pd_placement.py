"""Where the P/D roles run in Kubernetes (issue 49): a pair that fits one node asks for it
(preferred podAffinity on the node's hostname, so the KV crosses no network and a full node
never leaves a role Pending); a pair that cannot share a node says that its KV crosses the
network, and over what."""

from __future__ import annotations

import subprocess

import yaml

from m31ctl.deployment import derive
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.render import get_target
from tests.conftest import PINNED_COMMIT
from tests.support.render import tool


def _render(hardware: str, *sets: str) -> str:
    plan = resolve(PlanRequest(hardware=simulated(hardware), sets=("disaggregation.enabled=true", *sets)))
    (artifact,) = get_target("k8s")(derive(plan, commit=PINNED_COMMIT))
    return artifact.content


def test_a_pair_on_one_node_prefers_its_peers_node(tmp_path):
    text = _render("b300x8")
    roles = [d for d in yaml.safe_load_all(text) if d and d["kind"] == "Deployment" and "vllm" in str(d)]
    roles = [d for d in roles if d["spec"]["template"]["spec"]["containers"][0]["name"] == "vllm"]
    assert len(roles) == 2
    names = sorted(d["metadata"]["name"] for d in roles)
    for role in roles:
        (term,) = role["spec"]["template"]["spec"]["affinity"]["podAffinity"][
            "preferredDuringSchedulingIgnoredDuringExecution"
        ]
        assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
        (expression,) = term["podAffinityTerm"]["labelSelector"]["matchExpressions"]
        assert sorted(expression["values"]) == names
    assert "the roles prefer one node" in " ".join(line.lstrip("# ") for line in text.splitlines())
    path = tmp_path / "k8s.yaml"
    path.write_text(text)
    # The router's LWS-free manifest is plain Kubernetes: its schema takes the affinity.
    checked = subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(path)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_pair_wider_than_a_node_says_its_kv_crosses_the_network():
    text = _render("b300x4")
    assert "affinity" not in text
    assert "KV crosses the network" in " ".join(line.lstrip("# ") for line in text.splitlines())
