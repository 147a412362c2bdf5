"""The engine never holds the Hugging Face token (issue 49): it serves offline the snapshot the
download step left, and a pod's spec or `docker inspect` would show the token for as long as it
runs. The download step keeps it; the API key stays with the engine."""

from __future__ import annotations

import yaml

from m31ctl.deployment import derive
from m31ctl.hardware import simulated
from m31ctl.plan import PlanRequest, resolve
from m31ctl.render import get_target
from tests.conftest import PINNED_COMMIT


def _pod_specs(hardware: str, *sets: str) -> list[dict]:  # type: ignore[type-arg]
    plan = resolve(PlanRequest(hardware=simulated(hardware), sets=sets))
    found = []
    for artifact in get_target("k8s")(derive(plan, commit=PINNED_COMMIT)):
        for doc in yaml.safe_load_all(artifact.content):
            template = (doc or {}).get("spec", {}).get("template")
            if template:
                found.append(template["spec"])
    return found


def _secret_names(container: dict) -> set[str]:  # type: ignore[type-arg]
    return {
        e["name"] for e in container.get("env", []) if "valueFrom" in e and "secretKeyRef" in e["valueFrom"]
    }


def test_the_engine_pod_gets_the_api_key_and_only_the_download_gets_the_token():
    for hardware, sets in (("b300x4", ()), ("b300x8", ("disaggregation.enabled=true",))):
        specs = [s for s in _pod_specs(hardware, *sets) if s["containers"][0]["name"] == "vllm"]
        assert specs, hardware
        for spec in specs:
            (engine,) = spec["containers"]
            (download,) = [c for c in spec["initContainers"] if c["name"] == "download"]
            assert "HF_TOKEN" not in _secret_names(engine), hardware
            assert "VLLM_API_KEY" in _secret_names(engine), hardware
            assert "HF_TOKEN" in _secret_names(download), hardware
