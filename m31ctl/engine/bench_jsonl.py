"""JSON Lines for vLLM's custom benchmark dataset where the engine's Python has no pandas.

`vllm bench serve --dataset-name custom` reads its JSONL with `pandas.read_json(lines=True)`,
and pandas is not a dependency of vLLM: the CPU build (.venv-vllm, the rehearsal image) and
engine images may lack it, and then the benchmark dies in vLLM's placeholder for the missing
module. `m31ctl bench` feeds its workloads through that dataset, so bench_serve.py calls
without_pandas() first: with pandas present it changes nothing; without it, vLLM's dataset
module gets this reader, which does exactly what CustomDataset asks of pandas (`.columns`,
`.iterrows()`, `row.to_dict()`). Standalone: run with the engine's Python, imports no m31ctl.
"""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from typing import Any


class _Row(dict):  # type: ignore[type-arg]
    def to_dict(self) -> dict[str, Any]:
        return dict(self)


class _Frame:
    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self._rows = rows
        self.columns = sorted({key for row in rows for key in row})

    def iterrows(self) -> Iterator[tuple[int, _Row]]:
        return enumerate(_Row(row) for row in self._rows)


def read_json(path_or_buf: str, lines: bool = False, **_ignored: Any) -> _Frame:
    if not lines:
        raise NotImplementedError("m31ctl's reader reads JSON Lines only (lines=True)")
    with open(path_or_buf, encoding="utf-8") as f:
        return _Frame([json.loads(line) for line in f if line.strip()])


def without_pandas() -> None:
    """Give vLLM's benchmark datasets this reader when pandas cannot be imported."""
    try:
        importlib.import_module("pandas")
    except ImportError:
        pass
    else:
        return
    # vLLM 0.32 keeps the datasets in a package (datasets/datasets.py); earlier ones in a module.
    for name in ("vllm.benchmarks.datasets.datasets", "vllm.benchmarks.datasets"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "pd"):
            module.__dict__["pd"] = sys.modules[__name__]
