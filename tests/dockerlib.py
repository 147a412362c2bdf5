"""Test images built locally (no registry is reachable): a stand-in engine on Debian's busybox."""

from __future__ import annotations

import io
import shutil
import tempfile
from pathlib import Path
from typing import Any

ENGINE_DIR = Path(__file__).parent / "engine_image"
BASE = "m31ctl-test/engine:ready"
MODES = ("oom", "hang", "crashloop")
BUSYBOX = Path("/bin/busybox")


def build_engine_images(client: Any) -> dict[str, str]:
    """Tags by mode. Rebuilds are cheap: docker caches the layers."""
    if not BUSYBOX.exists():
        raise RuntimeError(
            "Debian's busybox-static is needed (apt-get install busybox-static); .ci/run installs it"
        )
    with tempfile.TemporaryDirectory() as tmp:
        context = Path(tmp)
        shutil.copy(BUSYBOX, context / "busybox")
        shutil.copy(ENGINE_DIR / "engine.sh", context / "engine.sh")
        shutil.copy(ENGINE_DIR / "Dockerfile", context / "Dockerfile")
        client.images.build(path=str(context), tag=BASE, rm=True)
    tags = {"ready": BASE}
    for mode in MODES:
        dockerfile = f"FROM {BASE}\nENV FAKE_ENGINE_MODE={mode}\n".encode()
        tag = f"m31ctl-test/engine:{mode}"
        client.images.build(fileobj=io.BytesIO(dockerfile), tag=tag, rm=True)
        tags[mode] = tag
    return tags
