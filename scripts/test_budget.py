"""What the last `scripts/test` run spent, from the files it wrote (issue 47's budget):

    scripts/test --budget [build/test/junit.xml]

the set-up phases (build/test/phases.tsv), then the slowest test files and tests with their share
of pytest's time, so a change can say what it costs before it lands. Standard library only."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

BUDGET_S = 35 * 60  # the whole command, fresh clone, the 2-core development machine
SETUP_BUDGET_S = 12 * 60  # of it, set-up without a cached rehearsal image


def _tests(junit: Path) -> list[tuple[str, float, str]]:
    """(test id, seconds, outcome) of every test case in a JUnit XML file."""
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        module = case.get("classname", "").replace(".", "/")
        rows.append((f"{module}.py::{case.get('name')}", float(case.get("time", 0)), outcome))
    return rows


def _phases(path: Path) -> list[tuple[str, int]]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()[1:]
    return [(name, int(seconds)) for name, seconds in (line.split("\t") for line in lines)]


def main(argv: list[str]) -> int:
    junit = Path(argv[0]) if argv else Path("build/test/junit.xml")
    phases = _phases(Path(argv[1]) if len(argv) > 1 else junit.parent / "phases.tsv")
    if not junit.exists():
        print(f"no {junit}: run scripts/test first", file=sys.stderr)
        return 1
    tests = _tests(junit)
    total = sum(seconds for _, seconds, _ in tests)
    if phases:
        whole = sum(seconds for _, seconds in phases)
        setup = sum(seconds for name, seconds in phases if name not in ("lint", "pytest"))
        print(f"scripts/test: {whole / 60:.1f} min in all (budget {BUDGET_S // 60}); set-up {setup / 60:.1f} min")
        for name, seconds in phases:
            print(f"  {name:<12} {seconds:>6} s")
    print(f"pytest: {len(tests)} tests, {total / 60:.1f} min of test time")
    by_file: dict[str, float] = defaultdict(float)
    for test_id, seconds, _ in tests:
        by_file[test_id.split("::")[0]] += seconds
    print("\nslowest files:")
    for path, seconds in sorted(by_file.items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {seconds:>7.1f} s  {100 * seconds / max(total, 1e-9):>5.1f} %  {path}")
    print("\nslowest tests:")
    for test_id, seconds, outcome in sorted(tests, key=lambda row: -row[1])[:25]:
        mark = "" if outcome == "passed" else f"  [{outcome}]"
        print(f"  {seconds:>7.1f} s  {100 * seconds / max(total, 1e-9):>5.1f} %  {test_id}{mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
