"""What every `--plot` shares (capacity, bench): the file name check before any work, matplotlib
on its headless backend (an optional dependency, imported on first use), and the write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from m31ctl.errors import InputError

FORMATS = (".png", ".svg", ".pdf")


def check_path(path: Path) -> None:
    """Refuse before any work: a name matplotlib would change (no suffix gets .png) or cannot write."""
    if path.suffix.lower() not in FORMATS:
        raise InputError(f"--plot {path}: use a file name ending in {', '.join(FORMATS)}")


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed), or exit 2 saying how to get it."""
    try:
        import matplotlib  # optional and heavy: only a --plot loads it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # after use("Agg"): no display needed
    except ImportError:
        raise InputError("--plot needs matplotlib", hint="pip install 'm31ctl[plot]'") from None
    return plt


def save(plt: Any, fig: Any, path: Path) -> None:
    """Write the figure (its directory made first) and close it, whatever happens."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path)
    except OSError as exc:
        raise InputError(f"--plot: cannot write {path}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
