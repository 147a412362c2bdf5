"""A P/D role on GPUs 4-7 of one host sees GPUs 4-7, counted the way its vendor's runtime counts.

ROCm applies ROCR_VISIBLE_DEVICES first and numbers what it exposes from 0; HIP_VISIBLE_DEVICES
then picks among those (ROCm's GPU isolation guide). The decode role used to get both set to
4,5,6,7, which leaves HIP pointing past the four GPUs ROCR exposed: no GPU at all (issue 49).
NVIDIA's twin gets its GPUs from the container runtime's device request, numbered from 0 inside,
and no CUDA variable that could renumber them."""

from __future__ import annotations

import yaml

from m31ctl.deployment import derive
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.render import get_target
from tests.conftest import PINNED_COMMIT


def _pd(hardware: str):  # type: ignore[no-untyped-def]
    plan = resolve(PlanRequest(hardware=simulated(hardware), sets=("disaggregation.enabled=true",)))
    return derive(plan, commit=PINNED_COMMIT)


def _rocm_sees(host_gpus: int, env: dict[str, str]) -> list[int]:
    """The host GPUs a ROCm process uses: ROCR picks from the host's, HIP from what ROCR left."""
    exposed = list(range(host_gpus))
    if "ROCR_VISIBLE_DEVICES" in env:
        exposed = [exposed[int(i)] for i in env["ROCR_VISIBLE_DEVICES"].split(",")]
    if "HIP_VISIBLE_DEVICES" in env:
        exposed = [exposed[int(i)] for i in env["HIP_VISIBLE_DEVICES"].split(",") if int(i) < len(exposed)]
    return exposed


def _compose_env(service: dict) -> dict[str, str]:  # type: ignore[type-arg]
    return dict(item.split("=", 1) for item in service["environment"])


def test_amd_roles_see_their_own_gpus_in_compose():
    (compose,) = [a for a in get_target("compose")(_pd("mi355xx8")) if a.name.endswith(".yaml")]
    services = yaml.safe_load(compose.content)["services"]
    assert _rocm_sees(8, _compose_env(services["prefill"])) == [0, 1, 2, 3]
    assert _rocm_sees(8, _compose_env(services["decode"])) == [4, 5, 6, 7]
    assert "CUDA_VISIBLE_DEVICES" not in _compose_env(services["decode"])  # vLLM copies HIP's


def test_amd_decode_role_sees_its_gpus_in_the_script_and_systemd():
    for target in ("script", "systemd"):
        text = "\n".join(a.content for a in get_target(target)(_pd("mi355xx8")))
        assert "ROCR_VISIBLE_DEVICES=4,5,6,7" in text, target
        assert "HIP_VISIBLE_DEVICES=4,5,6,7" not in text, target


def test_amd_pods_number_their_allocation_from_zero():
    """A pod sees only what the device plugin gave it: both roles count from 0."""
    docs = [d for a in get_target("k8s")(_pd("mi355xx8")) for d in yaml.safe_load_all(a.content) if d]
    envs = [
        {e["name"]: e.get("value") for e in c.get("env", [])}
        for d in docs
        for c in _containers(d)
        if c.get("name") in ("vllm", "engine") or "ROCR_VISIBLE_DEVICES" in str(c.get("env"))
    ]
    assert envs and all(_rocm_sees(4, env) == [0, 1, 2, 3] for env in envs)


def test_nvidia_decode_role_gets_its_gpus_by_device_request_only():
    (compose,) = [a for a in get_target("compose")(_pd("b300x8")) if a.name.endswith(".yaml")]
    decode = yaml.safe_load(compose.content)["services"]["decode"]
    (request,) = decode["deploy"]["resources"]["reservations"]["devices"]
    assert request["device_ids"] == ["4", "5", "6", "7"]
    assert not any(e.startswith("CUDA_VISIBLE_DEVICES=") for e in decode.get("environment", []))


def _containers(doc: dict) -> list[dict]:  # type: ignore[type-arg]
    """Every container spec of a Kubernetes document, however deep its pod template sits."""
    found: list[dict] = []  # type: ignore[type-arg]
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found.extend(c for c in node.get("containers", []) if isinstance(c, dict))
            stack.extend(v for k, v in node.items() if k != "containers")
        elif isinstance(node, list):
            stack.extend(node)
    return found
