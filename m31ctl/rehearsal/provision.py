"""What a rehearsal's containers run, made once on a host and reused: the derived (shim) image
over the rehearsal image (scripts/build-rehearsal-image), and the tiny model, made inside that
image by make_tiny_model.py or make_tiny_moe.py. Both are keyed on the code that makes them: an
edit makes a new one."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, NamedTuple

from m31ctl.errors import HostPreconditionError
from m31ctl.labels import Label
from m31ctl.rehearsal import docker_verbs
from m31ctl.runtime import engine_api

VLLM_VERSION = "0.32.0"  # the rehearsal image's vLLM CPU build
BASE_IMAGE = f"m31ctl/vllm-cpu:{VLLM_VERSION}"  # scripts/build-rehearsal-image
PYTHON = "/opt/vllm/bin/python"  # the rehearsal image's (vLLM's) Python
# The base image's `vllm` console script fails its own version lookup (the distribution is
# named vllm-cpu), so `vllm serve`, which every rendered command runs, would not start. The
# derived image records a `vllm` distribution with the +cpu version vLLM's platform detection
# reads (vllm/platforms: vllm_version_matches_substr("cpu")); nothing else changes.
SHIM_IMAGE = f"m31ctl/vllm-cpu-rehearse:{VLLM_VERSION}"
BUILD_TIMEOUT_S = 600.0
MODEL_TIMEOUT_S = 600.0

PACKAGE_DIR = Path(__file__).resolve().parent
# The slow-load plugin (a vLLM general plugin, m31ctl/rehearsal/slow_load/): installed into the
# derived image's site-packages, acting only where M31CTL_REHEARSAL_LOAD_DELAY_S is set.
SLOW_LOAD_DIR = PACKAGE_DIR / "slow_load"
SITE_PACKAGES = "/opt/vllm/lib/python3.11/site-packages"
GENERATORS = ("make_tiny_model.py", "make_tiny_moe.py")


def _slow_load_files() -> list[tuple[str, bytes]]:
    return sorted(
        (str(path.relative_to(SLOW_LOAD_DIR)), path.read_bytes())
        for path in SLOW_LOAD_DIR.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    )


def _shim_digest() -> str:
    digest = hashlib.sha256()
    for name, data in _slow_load_files():
        digest.update(name.encode() + b"\0" + data)
    return digest.hexdigest()[:8]


def shim_image(base: str) -> str:
    """The derived image's tag for a base image (another base, e.g. one with Ray, gets its own),
    with the plugin's digest: a changed plugin makes a new image."""
    if base == BASE_IMAGE:
        return f"{SHIM_IMAGE}-{_shim_digest()}"
    name, _, tag = base.rpartition(":") if ":" in base.rsplit("/", 1)[-1] else (base, "", "latest")
    return f"{name}-rehearse:{tag}-{_shim_digest()}"


SHIM_DOCKERFILE = """FROM {base}
RUN d={site}/vllm-{version}.dist-info && mkdir -p "$d" \\
 && printf 'Metadata-Version: 2.1\\nName: vllm\\nVersion: {version}+cpu\\n' > "$d/METADATA" \\
 && vllm --version
{plugin}
LABEL {base_label}="{base}"
"""


def shim_dockerfile(base: str) -> str:
    """The derived image: the `vllm` distribution record, and the slow-load plugin's files
    (base64 in the Dockerfile: a build from a Dockerfile alone has no context to copy from)."""
    lines = [
        f"RUN mkdir -p {SITE_PACKAGES}/{Path(name).parent} && echo {base64.b64encode(data).decode()} "
        f"| base64 -d > {SITE_PACKAGES}/{name}"
        for name, data in _slow_load_files()
    ]
    return SHIM_DOCKERFILE.format(
        base=base,
        base_label=Label.REHEARSAL_BASE,
        site=SITE_PACKAGES,
        version=VLLM_VERSION,
        plugin="\n".join(lines),
    )


def ensure_image(client: Any, base: str) -> str:
    """The derived image's tag, built over `base` when it is not here yet."""
    if engine_api.local_image(client, base) is None:
        raise HostPreconditionError(
            f"the rehearsal image {base} is not here", hint="build it: scripts/build-rehearsal-image"
        )
    shim = shim_image(base)
    if engine_api.local_image(client, shim) is None:
        failed = docker_verbs.build_image(client, shim, shim_dockerfile(base), BUILD_TIMEOUT_S)
        if failed is not None:
            raise HostPreconditionError(f"building {shim} failed: {failed.strip()[-500:]}")
    return shim


class TinyModels(NamedTuple):
    """Where this host keeps the tiny models, one a kind; the twin serves the one of its plan's
    kind (twin.py). Keyed on the generators' bytes, so an edit of them makes new ones (the
    weights are seeded: the same code makes the same model)."""

    dense: Path  # make_tiny_model.py's Llama
    moe: Path  # make_tiny_moe.py's, for a plan with expert parallelism


def tiny_models(root: Path) -> TinyModels:
    digest = hashlib.sha256(b"".join((PACKAGE_DIR / g).read_bytes() for g in GENERATORS)).hexdigest()[:10]
    return TinyModels(root / f"tiny-llama-{digest}", root / f"tiny-moe-{digest}")


def ensure_model(client: Any, image: str, model_dir: Path, moe: bool, session: str) -> None:
    """The tiny model, made inside the rehearsal image (it has torch and transformers) on the
    first run of a kind, then reused. Made under a temporary name and renamed: a Ctrl-C never
    leaves half a model behind under the real name."""
    if (model_dir / "config.json").is_file():
        return
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    scratch = model_dir.with_name(f"{model_dir.name}.{session}.tmp")
    generator = GENERATORS[1] if moe else GENERATORS[0]
    mounts = [
        {"Type": "bind", "Source": str(PACKAGE_DIR), "Target": "/m31ctl-rehearsal", "ReadOnly": True},
        {"Type": "bind", "Source": str(model_dir.parent), "Target": "/out", "ReadOnly": False},
    ]
    try:
        done = docker_verbs.run_to_end(
            client,
            MODEL_TIMEOUT_S,
            host={"mounts": mounts, "network_mode": "none"},
            image=image,
            labels={Label.REHEARSAL: session},
            user=f"{os.getuid()}:{os.getgid()}",
            environment=["HOME=/tmp"],
            entrypoint=[PYTHON],
            command=[f"/m31ctl-rehearsal/{generator}", f"/out/{scratch.name}"],
        )
        if not done.ok:
            raise HostPreconditionError(f"making the tiny model failed: {done.err.strip()[-500:]}")
        for path in [scratch, *scratch.iterdir()]:
            path.chmod(0o755 if path.is_dir() else 0o644)  # mounted read-only, read by any user
        scratch.rename(model_dir)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)  # gone when renamed; half a model otherwise
