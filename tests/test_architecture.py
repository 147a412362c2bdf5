"""The layout's promises, checked on the source: no import cycles (function-level imports
included), typer and rich only under m31ctl/cli/, the Docker SDK only in the engine adaptor,
and data flowing one way between the stage packages."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "m31ctl"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of the file (functions included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from m31ctl.cli import recipes` imports the submodule m31ctl.cli.recipes; names that
            # are not submodules come from the package itself.
            subs = {f"{node.module}.{a.name}" for a in node.names} & set(MODULES)
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(node.module)
    return found


GRAPH = {name: {m for m in _imports(path) if m in MODULES and m != name} for name, path in MODULES.items()}


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1 visiting, 2 done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycle = [*stack[stack.index(nxt) :], nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)


def _users_of(prefixes: tuple[str, ...]) -> set[str]:
    return {
        name
        for name, path in MODULES.items()
        if any(m == p or m.startswith(p + ".") for m in _imports(path) for p in prefixes)
    }


def test_only_cli_imports_typer_and_rich():
    assert {m for m in _users_of(("typer", "rich", "click")) if not m.startswith("m31ctl.cli")} == set()


def test_only_the_engine_adaptor_imports_the_docker_sdk():
    users = _users_of(("docker",)) - {"m31ctl.runtime.docker"}  # the runtime module shares the name
    sdk_users = {m for m in users if any(i.startswith("docker") for i in _imports(MODULES[m]))}
    # the docker runtime builds DeviceRequest/Ulimit types for the create call, inside the boundary
    assert sdk_users <= {"m31ctl.runtime.engine_api", "m31ctl.runtime.docker"}


# Which stage may import which: probe -> hardware -> plan -> capacity/engine -> render/runtime/doctor -> cli.
FORBIDDEN = {
    "m31ctl.probe": (
        "m31ctl.plan",
        "m31ctl.deployment",
        "m31ctl.capacity",
        "m31ctl.engine",
        "m31ctl.render",
        "m31ctl.runtime",
        "m31ctl.doctor",
        "m31ctl.cli",
    ),
    "m31ctl.plan": (
        "m31ctl.deployment",
        "m31ctl.capacity",
        "m31ctl.engine",
        "m31ctl.render",
        "m31ctl.runtime",
        "m31ctl.doctor",
        "m31ctl.cli",
        "m31ctl.probe",
    ),
    # The Deployment is derived from the plan and read by everything that acts on it.
    "m31ctl.deployment": (
        "m31ctl.capacity",
        "m31ctl.engine",
        "m31ctl.render",
        "m31ctl.runtime",
        "m31ctl.doctor",
        "m31ctl.cli",
        "m31ctl.probe",
    ),
    "m31ctl.capacity": ("m31ctl.render", "m31ctl.runtime", "m31ctl.doctor", "m31ctl.cli"),
    "m31ctl.engine": ("m31ctl.render", "m31ctl.runtime", "m31ctl.doctor", "m31ctl.cli"),
    "m31ctl.render": ("m31ctl.runtime", "m31ctl.doctor", "m31ctl.cli"),
    "m31ctl.runtime": ("m31ctl.doctor", "m31ctl.cli", "m31ctl.deploy"),
    "m31ctl.doctor": ("m31ctl.cli", "m31ctl.deploy"),
    # pull reads the plan and writes the cache; the runtime, doctor and CLI may call it, not the reverse
    "m31ctl.pull": ("m31ctl.runtime", "m31ctl.doctor", "m31ctl.render", "m31ctl.cli", "m31ctl.deploy"),
    # bench measures a running server: plan, engine and runtime below it, never the CLI or launch.
    "m31ctl.bench": ("m31ctl.cli", "m31ctl.deploy", "m31ctl.doctor", "m31ctl.render"),
}


@pytest.mark.parametrize("stage", sorted(FORBIDDEN))
def test_data_flows_one_way(stage):
    bad = [
        (name, target)
        for name in MODULES
        if name == stage or name.startswith(stage + ".")
        for target in GRAPH[name]
        if any(target == f or target.startswith(f + ".") for f in FORBIDDEN[stage])
    ]
    assert bad == []


# Facts the Deployment derives once (m31ctl/deployment.py): a consumer that spells one of these
# again is recomputing it. Each pattern names where it may appear.
DERIVED_ONCE = {
    # engine_rules reads the checkpoint's config at plan time, before a Deployment exists.
    "os.path.expanduser(": {"m31ctl.checkpoint", "m31ctl.resources"},
    # The Hugging Face cache's layout (which vLLM reads) is spelled in m31ctl/checkpoint.py alone.
    'f"models--': {"m31ctl.checkpoint"},
    'startswith("simulated': set(),
    "checkpoint_gb * 8000": set(),
    "STOP_MARGIN_S": {"m31ctl.deployment"},
    '"VLLM_API_KEY"': {"m31ctl.redact"},
    'vendor == "': {"m31ctl.hardware"},
    # Runtimes are dispatched through their registry (m31ctl.runtime.get_runtime), never by name.
    'runtime == "': set(),
    'deep == "': set(),
    'vendor != "': {"m31ctl.hardware"},
}


@pytest.mark.parametrize("pattern", sorted(DERIVED_ONCE))
def test_derived_facts_are_not_recomputed(pattern):
    found = {name for name, path in MODULES.items() if pattern in path.read_text()}
    assert found <= DERIVED_ONCE[pattern], (
        f"{pattern!r} spelled again in {sorted(found - DERIVED_ONCE[pattern])}"
    )


LONGEST_FUNCTION = 80  # lines; a flat flag list longer than this becomes a table


def test_no_function_is_longer_than_a_screen():
    long = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > LONGEST_FUNCTION:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert long == []
