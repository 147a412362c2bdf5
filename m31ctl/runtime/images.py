"""What the Docker Engine knows about an engine image: its ID, its registry digest, and the
vLLM inside it (asked of the image's own Python, once per image ID). Used by doctor's engine
check and by `m31ctl lock`."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

from m31ctl.resources import cache_root
from m31ctl.runtime import engine_api


class ImageFacts(NamedTuple):
    reference: str
    id: str | None  # the local image ID (content hash of its config); None when absent
    digest: str | None  # the registry digest (repo@sha256:...) when the image came from one
    vllm_version: str | None  # None when the image cannot tell (no vLLM, or not runnable here)


# vLLM's imports take about 8 s on a fast host; a hung import must not hang doctor or lock.
SCHEMA_TIMEOUT_S = 300


def _cache_dir() -> Path:
    return cache_root() / "engine-schemas"


def engine_schema(client: Any, image: Any) -> dict[str, Any]:
    """Run the image's own Python on extract_schema.py; cached per image id (vLLM imports take ~8 s)."""
    cached = _cache_dir() / f"{image.id.replace(':', '_')}.json"
    if cached.is_file():
        data: dict[str, Any] = json.loads(cached.read_text())
        return data
    script = resources.files("m31ctl.engine").joinpath("extract_schema.py")
    with resources.as_file(script) as path:
        host = client.api.create_host_config(
            binds={str(path.parent): {"bind": "/m31ctl", "mode": "ro"}}, network_mode="none"
        )
        # Removed whatever happens once created (a failed start, a timeout, Ctrl-C).
        with engine_api.throwaway(
            client,
            "schema",
            image=image.id,
            entrypoint=["python3", "/m31ctl/extract_schema.py"],
            command=[],
            host_config=host,
        ) as container:
            container.start()
            code = int(container.wait(timeout=SCHEMA_TIMEOUT_S).get("StatusCode", -1))
            output = container.logs(stdout=True, stderr=False)
            if code != 0:
                said = container.logs(stdout=False, stderr=True).decode("utf-8", "replace").strip()
                raise RuntimeError(f"schema extraction exited with code {code}: {said[-300:]}")
    data = json.loads(output.decode())
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(data))
    return data


# The router's --help answers at once; a minute covers a loaded host's container start.
ROUTER_RUN_TIMEOUT_S = 60


def runs_router(client: Any, image: Any) -> bool:
    """Whether `image` runs vllm-router (`vllm-router --help` exits 0; 0.1.17 has no --version),
    cached per image ID: vLLM's own images do not carry it (the router is its own project)."""
    cached = _cache_dir() / f"router-{image.id.replace(':', '_')}.txt"
    if cached.is_file():
        return cached.read_text() == "yes"
    host = client.api.create_host_config(network_mode="none")
    try:
        with engine_api.throwaway(
            client,
            "router",
            image=image.id,
            entrypoint=["vllm-router"],
            command=["--help"],
            host_config=host,
        ) as container:
            container.start()
            code = int(container.wait(timeout=ROUTER_RUN_TIMEOUT_S).get("StatusCode", -1))
    except Exception as exc:  # the Engine refuses to start a missing executable (OCI: not found)
        if "not found" not in str(exc) and "no such file" not in str(exc).lower():
            raise
        code = 127
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text("yes" if code == 0 else "no")
    return code == 0


def image_facts(reference: str, ask_vllm: bool = True) -> ImageFacts:
    """The engine's facts about `reference`. Raises DockerUnreachable when there is no engine."""
    with engine_api.engine_boundary("inspecting the engine image"):
        client = engine_api.connect()
        image = engine_api.local_image(client, reference)
        if image is None:
            return ImageFacts(reference, None, None, None)
        digests = image.attrs.get("RepoDigests") or []
        repository = reference.rsplit(":", 1)[0] if ":" in reference.split("/")[-1] else reference
        digest = next(
            (d for d in digests if d.split("@", 1)[0] == repository), digests[0] if digests else None
        )
        version = None
        if ask_vllm:
            try:
                version = str(engine_schema(client, image).get("version") or "") or None
            except Exception:  # no python3 or no vLLM in the image: it cannot tell
                version = None
        return ImageFacts(reference, str(image.id), digest, version)
