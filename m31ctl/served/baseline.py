"""The one reader of an earlier report that a run is compared with (`verify --baseline`,
`bench --baseline`): bounded in size and depth (inputs.read_json), its shape checked before
anything runs, so a wrong file is exit 2 naming the file and what is wrong."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from m31ctl.errors import InputError
from m31ctl.inputs import read_json
from m31ctl.served import figures


def read_baseline(
    path: Path, what: str, problem: Callable[[object], str | None], hint: str
) -> dict[str, Any]:
    """The report in `path` as a JSON object, or InputError when `problem` finds one."""
    data = read_json(path, what)
    found = problem(data)
    if found:
        raise InputError(f"not a {what}: {found}", where=str(path), hint=hint)
    assert isinstance(data, dict)  # every problem function refuses anything else
    return data


def verify_report(path: Path) -> dict[str, Any]:
    """A saved verify report (`verify -o`): its checks and the load's vLLM figures."""
    return read_baseline(path, "verify report", _verify_problem, "pass a file `verify -o` wrote")


def bench_points(path: Path, workload: str) -> list[dict[str, Any]]:
    """An earlier bench report's points; one of another workload compares nothing alike."""

    def problem(data: object) -> str | None:
        if not isinstance(data, dict) or not isinstance(data.get("points"), list):
            return "no points"
        if data.get("workload") != workload:
            return f"the baseline measured workload {data.get('workload')!r}; this run measures {workload!r}"
        return None

    data = read_baseline(
        path, "bench report", problem, "compare runs of the same --workload (m31ctl bench -o)"
    )
    return [p for p in data["points"] if isinstance(p, dict)]


def _verify_problem(data: object) -> str | None:
    if not isinstance(data, dict):
        return "expected a JSON object"
    checks = data.get("checks")
    if not isinstance(checks, list) or not all(isinstance(c, dict) for c in checks):
        return "'checks' must be a list of objects" if "checks" in data else "no checks"
    bench = data.get("bench")
    if bench is None:
        return None
    if not isinstance(bench, dict):
        return f"'bench' must be an object or null, not {type(bench).__name__}"
    for figure in figures.VERIFY_REGRESSION:
        key = figures.VLLM_KEY[figure]
        value = bench.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            return f"bench.{key} must be a number, not {type(value).__name__}"
    return None
