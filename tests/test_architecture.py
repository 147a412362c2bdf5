"""The layout's promises, checked on the source: no import cycles (function-level imports
included), typer and rich only under m31ctl/cli/, one Docker client (the SDK only in
m31ctl/runtime/engine_api.py, no `docker` CLI run anywhere), and data flowing one way between
the stage packages."""

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


# The program's one Docker client (issue 38): launch, status, stop, doctor and the rehearsal all
# talk to the Engine through it; no second client, through the SDK or the `docker` CLI.
DOCKER_CLIENT = "m31ctl.runtime.engine_api"


def test_only_the_one_docker_client_imports_the_docker_sdk():
    # Absolute import names: `m31ctl.runtime.docker` (the runtime) is no `docker` (the SDK).
    users = {
        name for name, path in MODULES.items() if any(m.split(".")[0] == "docker" for m in _imports(path))
    }
    assert users == {DOCKER_CLIENT}


# What may start a process, and what each starts: none of them is the `docker` CLI.
PROCESS_STARTERS = {
    "m31ctl.runtime.native": "vllm serve",
    "m31ctl.runtime.native_identity": "the engine's Python, reading its vLLM and torch metadata",
    "m31ctl.runtime.load_run": "vllm bench serve",
    "m31ctl.probe.snapshot": "the vendors' probe tools (nvidia-smi, amd-smi, ...) for probe and doctor",
    "m31ctl.engine.dry_run": "vLLM's own argument parser",
}
_SPAWNING = {
    "subprocess": {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
    "os": {"system", "popen", "execv", "execve", "execvp", "execvpe", "execl", "execlp", "execle",
           "execlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnlp", "posix_spawn",
           "posix_spawnp"},
    "asyncio": {"create_subprocess_exec", "create_subprocess_shell"},
}  # fmt: skip
# m31ctl's own wrappers of them, which a caller hands an argv (probe.snapshot.run_command, a Runner).
_RUNNER_NAMES = {"run", "run_command", "runner", "Popen", "check_output", "call", "system"}


def _starts_a_process(node: ast.AST) -> bool:
    func = node.func if isinstance(node, ast.Call) else None
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return func.attr in _SPAWNING.get(func.value.id, set())
    return False


def _docker_words(tree: ast.AST) -> list[int]:
    """Lines of string constants that name the docker CLI as a command: "docker", or a command
    line starting "docker " (the runtime's registry key `"docker"` is no command in a module
    that starts nothing)."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and (node.value == "docker" or node.value.startswith("docker "))
    ]


def _argv_head(node: ast.AST) -> str | None:
    """The first word of a list or tuple literal argv, when it is a constant."""
    if isinstance(node, (ast.List, ast.Tuple)) and node.elts:
        first = node.elts[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value.split()[0] if first.value.split() else ""
    return None


def test_nothing_runs_the_docker_cli():
    """The Docker Engine is reached through the one client only (DOCKER_CLIENT): a module that
    starts processes is one of PROCESS_STARTERS and holds no `docker` command word, and no call
    of a process runner anywhere is handed an argv beginning with `docker`."""
    starters, worded, handed = set(), [], []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        if any(_starts_a_process(node) for node in ast.walk(tree)):
            starters.add(name)
            worded += [f"{name}:{line}" for line in _docker_words(tree)]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            callee = (
                func.attr
                if isinstance(func, ast.Attribute)
                else func.id
                if isinstance(func, ast.Name)
                else ""
            )
            argvs = [*node.args, *(k.value for k in node.keywords if k.arg in ("args", "argv", "cmd"))]
            if callee in _RUNNER_NAMES and any(_argv_head(a) == "docker" for a in argvs):
                handed.append(f"{name}:{node.lineno}")
    assert starters <= set(PROCESS_STARTERS), (
        f"starts processes, not in PROCESS_STARTERS: {starters - set(PROCESS_STARTERS)}"
    )
    assert worded == [], f"a process-starting module names the docker CLI: {worded}"
    assert handed == [], f"the docker CLI handed to a process runner: {handed}"


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
    # render/ and runtime/ are siblings (issue 52): each reads the Deployment and what is derived
    # beside it for both, the container (container.py, its `docker run` argv in docker_run.py) and
    # the P/D pair on one host (pair.py); neither imports the other, and those modules neither.
    **dict.fromkeys(
        ("m31ctl.container", "m31ctl.docker_run", "m31ctl.pair"),
        ("m31ctl.render", "m31ctl.runtime", "m31ctl.doctor", "m31ctl.cli", "m31ctl.deploy"),
    ),
    "m31ctl.render": ("m31ctl.runtime", "m31ctl.doctor", "m31ctl.cli"),
    "m31ctl.runtime": ("m31ctl.render", "m31ctl.doctor", "m31ctl.cli", "m31ctl.deploy", "m31ctl.served"),
    "m31ctl.doctor": ("m31ctl.cli", "m31ctl.deploy", "m31ctl.served"),
    # pull reads the plan and writes the cache; the runtime, doctor and CLI may call it, not the reverse
    "m31ctl.pull": ("m31ctl.runtime", "m31ctl.doctor", "m31ctl.render", "m31ctl.cli", "m31ctl.deploy"),
    # served talks to a running server (smoke, verify, bench): plan, engine, capacity and the
    # runtime (find the server, run the engine's benchmark) below it, never the CLI or launch.
    "m31ctl.served": ("m31ctl.cli", "m31ctl.deploy", "m31ctl.doctor", "m31ctl.render", "m31ctl.pull"),
}
# Who may import served: the CLI, and the rehearsal (it smokes the server it launched). The
# runtime keeps the lifecycle and never reads a server's answers.
SERVED_USERS = ("m31ctl.cli", "m31ctl.rehearsal", "m31ctl.served")


def test_only_the_cli_and_the_rehearsal_import_served():
    users = {
        name
        for name, imported in GRAPH.items()
        if any(m == "m31ctl.served" or m.startswith("m31ctl.served.") for m in imported)
    }
    assert {u for u in users if not any(u == p or u.startswith(p + ".") for p in SERVED_USERS)} == set()


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
    # plan/checkpoint_facts.py reads the checkpoint's config at plan time, before a Deployment exists.
    "os.path.expanduser(": {"m31ctl.checkpoint", "m31ctl.resources"},
    # The Hugging Face cache's layout (which vLLM reads) is spelled in m31ctl/checkpoint.py alone.
    'f"models--': {"m31ctl.checkpoint"},
    'startswith("simulated': set(),
    "checkpoint_gb * 8000": set(),
    "STOP_MARGIN_S": {"m31ctl.timeline"},
    "_MBIT_PER_GB": {"m31ctl.timeline"},
    # vLLM's engine-ready limit is raised in one place (the adapter, from the timeline).
    "VLLM_ENGINE_READY_TIMEOUT_S": {"m31ctl.timeline"},
    '"VLLM_API_KEY"': {"m31ctl.redact"},
    # Whether a P/D pair fits one host is asked where it is refused, m31ctl/pair.py (one message,
    # one error type for every target and runtime); the Deployment counts nodes by it and the
    # plan's JSON shows it; the k8s P/D render places the roles on one node when it holds.
    ".fits_one_host": {"m31ctl.deployment", "m31ctl.pair", "m31ctl.cli.views", "m31ctl.render.pd"},
    # A container's labels are its plan's (container.py); a P/D group's are its own plan's, named
    # once in pair.py (group_labels) and read off the router's container (DockerPair.router_spec)
    # by the Docker targets and launch, so no renderer labels the group's parts on its own.
    "labels_for(": {"m31ctl.container", "m31ctl.pair"},
    # engine.extra_args setting a flag m31ctl owns is refused once, for the plan a command acts on
    # (commands.deployment), before anything is shown, rendered or started; the adapter's argv
    # (build_invocation, every renderer's and runtime's) reads extra_args as given (issue 52).
    "refuse_owned_flags(": {"m31ctl.engine.adapter", "m31ctl.commands"},
    # Runtimes are dispatched through their registry (m31ctl.runtime.get_runtime), never by name.
    'runtime == "': set(),
    'deep == "': set(),
}
# Vendor facts are typed fields of the vendor's row (m31ctl/hardware.py VendorFacts): a branch
# compares a Platform member or reads a field, never an attribute of these names to a spelling.
VENDOR_ATTRIBUTES = {"vendor", "driver_stack", "platform", "device_type"}


def _strings(node: ast.AST) -> list[str]:
    """The string literals `node` is: a constant, or a tuple/list/set of them (`x in ("a", "b")`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for element in node.elts for s in _strings(element)]
    return []


def _vendor_attribute(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr in VENDOR_ATTRIBUTES


def test_no_vendor_fact_is_compared_to_a_string():
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            operands = [node.left, *node.comparators]
            if any(map(_vendor_attribute, operands)) and any(_strings(o) for o in operands):
                found.append(f"{name}:{node.lineno}")
    assert found == []


def test_every_label_key_is_in_the_one_table():
    """m31ctl/labels.py spells every label key m31ctl sets or filters on; another module with an
    `io.m31ctl.` literal (a docstring aside) keeps a second table that can drift from it."""
    found = sorted(
        name
        for name, path in MODULES.items()
        if name != "m31ctl.labels" and any("io.m31ctl." in s for s in _label_literals(path))
    )
    assert found == []


def _label_literals(path: Path) -> list[str]:
    """The string constants of `path` that are not docstrings."""
    tree = ast.parse(path.read_text())
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


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


def _reads_a_clock(node: ast.AST) -> bool:
    """An expression that reads the timeline (`x.timeline.y`, or a ContainerSpec's clocks)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and (
            sub.attr in ("timeline", "stop_timeout", "startup_timeout")
            or (isinstance(sub.value, ast.Attribute) and sub.value.attr == "timeline")
        ):
            return True
    return False


def _is_now(node: ast.AST) -> bool:
    func = node.func if isinstance(node, ast.Call) else None
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("clock", "monotonic", "time")


# The packages that set a deployment's clocks (rendered files, a launch and its runtime, a served
# check's wait on the engine): there a constant or a function named as seconds or a bound is a
# clock, so a sum of one is a clock the timeline does not hold. Elsewhere (doctor's own probes, a
# pull's stall limit, the rehearsal's scaled clocks) such names are m31ctl's own waits.
CLOCK_SETTERS = ("m31ctl.render", "m31ctl.runtime", "m31ctl.served")
# A clock's name ends in its unit or what it bounds: ROUTER_START_S, _roles_budget(), ..._TIMEOUT.
CLOCK_WORDS = {"s", "secs", "seconds", "mins", "minutes", "timeout", "deadline", "budget", "grace"}


def _name_of(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _clock_named(name: str) -> bool:
    return bool(name.strip("_")) and name.strip("_").lower().split("_")[-1] in CLOCK_WORDS


def _names_a_clock(node: ast.AST) -> bool:
    """A clock-named constant (`ROUTER_START_S`, `pd.ROUTER_STOP_S`) or the result of a
    clock-named function (`_roles_budget(group)`); a lower-case local is a value, not a name."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and _clock_named(_name_of(sub.func)):
            return True
        if _name_of(sub).isupper() and _clock_named(_name_of(sub)):
            return True
    return False


def _aggregates_clocks(node: ast.AST) -> bool:
    """`max(role.timeline.x for role in roles)`: a group's clock computed from its parts' clocks."""
    return (
        isinstance(node, ast.Call)
        and _name_of(node.func) in ("max", "min", "sum")
        and any(isinstance(a, (ast.GeneratorExp, ast.ListComp)) and _reads_a_clock(a.elt) for a in node.args)
    )


def clock_arithmetic(module: str, source: str) -> list[int]:
    """The lines of `module` that compute a clock: a sum, difference or product of a timeline
    read (anywhere) or of a clock-named constant or function (in CLOCK_SETTERS), or a group's
    clock aggregated from its parts'. A message being joined and a deadline (now plus a
    budget the timeline gave) are not clocks."""
    setter = module.startswith(CLOCK_SETTERS)
    found = []
    for node in ast.walk(ast.parse(source)):
        if _aggregates_clocks(node):
            found.append(node.lineno)
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult))):
            continue
        if any(isinstance(sub, ast.JoinedStr) for sub in ast.walk(node)):
            continue
        if any(_is_now(side) for side in (node.left, node.right)):
            continue
        sides = (node.left, node.right)
        if any(_reads_a_clock(side) or (setter and _names_a_clock(side)) for side in sides):
            found.append(node.lineno)
    return sorted(set(found))


def test_no_clock_is_computed_outside_the_timeline():
    """Every clock a rendered file or a launch sets is a figure of m31ctl/timeline.py: a
    consumer that adds a margin to one, or sums two, is a second clock that can disagree (the
    startup probe once waited 1,200 s while the script waited 3,201 s for the same start; the P/D
    router's deadline was once its roles' longest plus a margin of render/pd.py's own)."""
    found = [
        f"{name}:{line}"
        for name, path in MODULES.items()
        if name != "m31ctl.timeline"
        for line in clock_arithmetic(name, path.read_text())
    ]
    assert found == [], f"clock arithmetic outside m31ctl/timeline.py: {found}"


@pytest.mark.parametrize(
    "source",
    [
        "deadline = _roles_budget(group) + ROUTER_START_S",
        "grace = pd.ROUTER_STOP_S * 2",
        "wait = IMAGE_PULL_S + spec.download",
        "start = role.timeline.ready_s + 60",
        "budget = max(role.timeline.progress_deadline_s for role in group.roles)",
    ],
)
def test_the_clock_check_finds_clock_arithmetic_in_a_renderer(source):
    """The check above on the shapes it refuses, in a module that renders (a clock of its own)."""
    assert clock_arithmetic("m31ctl.render.pd", source) == [1]


@pytest.mark.parametrize(
    "source",
    [
        "deadline = time.monotonic() + timeline.ready_s",
        "message = f'{timeline.ready_s} s' + suffix",
        "cost = per_hour / (tok_s * SECONDS_PER_HOUR)",
        "left = budget - meter.overhead",
        "probes = max(1, math.ceil(spec.startup_timeout / PROBE_PERIOD_S))",
        "ready = timeline.ready_s",
    ],
)
def test_the_clock_check_passes_what_is_not_a_new_clock(source):
    assert clock_arithmetic("m31ctl.render.pd", source) == []


def _literal_keys(node: ast.AST) -> set[str]:
    """The constant keys of a dict literal or a `dict(...)` call; empty for anything else."""
    if isinstance(node, ast.Dict):
        return {k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        return {k.arg for k in node.keywords if k.arg}
    return set()


def _each_to_json(value: ast.AST) -> bool:
    """`[c.to_json() for c in ...]`: a list of checks rendered by their own type."""
    elt = value.elt if isinstance(value, (ast.ListComp, ast.GeneratorExp)) else None
    return (
        isinstance(elt, ast.Call)
        and isinstance(elt.func, ast.Attribute)
        and elt.func.attr == "to_json"
        and not elt.args
    )


def test_every_check_result_is_the_one_type_in_the_one_shape():
    """m31ctl/checks.py's CheckResult is every command's check result and its to_json the one
    JSON shape (issue 38: doctor, smoke and verify had three). Outside checks.py no module spells
    a check as a dict (a "check" key, or a status beside a message, detail or remedy), every
    report's "checks" list is its results' own to_json, and the reports hold CheckResult."""
    import typing

    from m31ctl.checks import CheckResult, CheckStatus, judged
    from m31ctl.doctor import DoctorReport
    from m31ctl.served.smoke import SmokeReport
    from m31ctl.served.verified import VerifyReport

    spelt, listed = [], []
    for name, path in MODULES.items():
        if name == "m31ctl.checks":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            keys = _literal_keys(node)
            if "check" in keys or ("status" in keys and keys & {"message", "detail", "remedy"}):
                spelt.append(f"{name}:{node.lineno}")
            if isinstance(node, ast.Dict):
                for key, value in zip(node.keys, node.values, strict=True):
                    if isinstance(key, ast.Constant) and key.value == "checks" and not _each_to_json(value):
                        listed.append(f"{name}:{node.lineno}")
    assert spelt == [], f"a check result spelt as a dict outside m31ctl/checks.py: {spelt}"
    assert listed == [], f"a report's checks not rendered by CheckResult.to_json: {listed}"

    for report, field in ((DoctorReport, "results"), (SmokeReport, "checks"), (VerifyReport, "checks")):
        held = typing.get_type_hints(report)[field]
        assert typing.get_args(held)[0] is CheckResult, (report, held)
    chat = judged("chat", False, "HTTP 500")
    assert chat.status is CheckStatus.FAIL
    one = {"id", "title", "status", "message", "remedy", "duration_s"}
    for found in (SmokeReport("http://h:1", "m", [chat]), VerifyReport("http://h:1", "abc", [chat])):
        assert found.to_json()["checks"] == [chat.to_json()] and set(chat.to_json()) == one
    assert chat.to_json()["status"] == "fail" and {s.value for s in CheckStatus} == {
        "ok",
        "warn",
        "fail",
        "skip",
    }
    with pytest.raises(ValueError):
        CheckResult("chat", "chat", "pass", "")  # type: ignore[arg-type]  # verify's old spelling


def _unexplained_imports(path: Path) -> list[int]:
    """The lines of `path`'s imports inside functions that say nowhere why they are not at the
    top: a comment on the import itself, or on the line above it (or above the block of imports
    it belongs to), e.g. `# lazy: jinja2 costs start-up`."""
    lines = path.read_text().splitlines()
    tree = ast.parse("\n".join(lines))
    imports = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
    import_lines = {line for n in imports for line in range(n.lineno, (n.end_lineno or n.lineno) + 1)}
    inner = {
        node.lineno: node
        for function in ast.walk(tree)
        if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
        for node in ast.walk(function)
        if isinstance(node, (ast.Import, ast.ImportFrom))
    }
    found = []
    for lineno, node in sorted(inner.items()):
        if any("#" in line for line in lines[lineno - 1 : node.end_lineno]):
            continue
        above = lineno - 2  # the line above, past blank lines and the block's earlier imports
        while above >= 0 and (
            not lines[above].strip() or (above + 1 in import_lines and "#" not in lines[above])
        ):
            above -= 1
        if above < 0 or "#" not in lines[above]:
            found.append(lineno)
    return found


def test_every_import_inside_a_function_says_why():
    """Imports belong at the top of a module, where they show what it depends on; one inside a
    function (a heavy or optional library, vLLM in the engine's Python, a command's own modules
    loaded only when it runs) carries one short comment saying why (scripts/bench.py measures the
    start-up cost that most of them save)."""
    root = PACKAGE.parent
    found = [
        f"{path.relative_to(root)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in _unexplained_imports(path)
    ]
    assert found == []


def test_distinct_names_for_distinct_things():
    """Two modules of one file name (once three base.py, two verify.py, two model.py) or two
    top-level classes of one name (the runtime protocol and a settings section, both `Runtime`)
    make a reader, a traceback and a grep ask which one is meant: each is named for what it holds.
    Package __init__.py files are the one name shared by design."""
    seen: dict[str, list[str]] = {}
    for name, path in sorted(MODULES.items()):
        if path.name != "__init__.py":
            seen.setdefault(f"module {path.name}", []).append(name)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                seen.setdefault(f"class {node.name}", []).append(name)
    assert {key: names for key, names in seen.items() if len(names) > 1} == {}


def test_tests_mirror_the_packages():
    """A package's tests live in the folder of its name (tests/render/ for m31ctl/render/); the
    files left in tests/ itself test the top-level modules or the program as a whole (README,
    architecture, hostile input, the GPU host)."""
    tests = PACKAGE.parent / "tests"
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()}
    folders = {p.parent.name for p in tests.glob("*/test_*.py")}
    assert folders <= packages, folders - packages


# Tests stand alone (issue 47): a test module imports m31ctl, tests/conftest.py, the helpers in
# tests/support/ and the stand-ins at the top of tests/, never another test module, so that each
# runs, moves or is deleted on its own; and a script (scripts/) imports no test code.
TESTS = PACKAGE.parent / "tests"
SCRIPTS = PACKAGE.parent / "scripts"
TEST_SHARED = {
    *("conftest", "support"),
    *("ports", "fakes", "standin_hub", "standin_vllm", "stub_docker", "dockerlib", "slow_docker"),
}
# What two benchmarks still take from tests/: a stand-in each (the engine images, the hub), reached
# as tests.dockerlib and, with tests/ on sys.path, as standin_hub. No other script may join them.
SCRIPTS_USING_STAND_INS = {
    ("scripts/bench_launch.py", "tests.dockerlib"),
    ("scripts/bench_pull.py", "standin_hub"),
}


def _imported(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of everything `path` imports, at any depth of the file; `from a import
    b` is a.b (b may be a submodule), a relative import is made absolute from `root`."""
    package = list(path.relative_to(root).parent.parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


def _python_scripts() -> list[Path]:
    def python(p: Path) -> bool:
        return p.suffix == ".py" or p.read_bytes().startswith(b"#!/usr/bin/env python")

    return sorted(p for p in SCRIPTS.rglob("*") if p.is_file() and python(p))


def test_no_test_module_imports_another():
    root = PACKAGE.parent
    found = [
        f"{path.relative_to(root)}:{line} imports {name}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, name in _imported(path, root)
        if name.split(".")[0] == "tests" and (name.count(".") == 0 or name.split(".")[1] not in TEST_SHARED)
    ]
    assert found == [], "a test module's shared helper belongs in tests/support/"


def test_no_script_imports_the_tests():
    root = PACKAGE.parent
    # tests/ itself, or one of its modules reached with tests/ on sys.path.
    test_names = {"tests"} | {p.stem for p in TESTS.iterdir() if p.suffix == ".py" or p.is_dir()}
    found = [
        (str(path.relative_to(root)), line, name)
        for path in _python_scripts()
        for line, name in _imported(path, root)
        if name.split(".")[0] in test_names
    ]

    def excepted(path: str, name: str) -> tuple[str, str] | None:
        return next(
            ((p, m) for p, m in SCRIPTS_USING_STAND_INS if p == path and f"{name}.".startswith(f"{m}.")), None
        )

    assert [f"{path}:{line} imports {name}" for path, line, name in found if not excepted(path, name)] == []
    # An exception that no script needs any more is dropped from the list.
    assert {excepted(path, name) for path, _, name in found} == SCRIPTS_USING_STAND_INS


def test_the_rehearsal_derives_each_plan_it_runs_once():
    """deployment.derive runs in rehearsal/prepared.py alone, once: the twin (docs/architecture.md,
    rehearsal/); runner.py once derived three times, and a P/D plan's aggregated reference was the
    second until the pair was held against its prefill role."""
    calls = {
        name: sum(
            isinstance(n, ast.Call) and _name_of(n.func) == "derive"
            for n in ast.walk(ast.parse(path.read_text()))
        )
        for name, path in MODULES.items()
        if name.startswith("m31ctl.rehearsal")
    }
    assert {n: c for n, c in calls.items() if c} == {"m31ctl.rehearsal.prepared": 1}


# Modules over 500 lines today (issue 52 asks none); each may only shrink, and no other may grow
# past 500. A module split below 500 leaves this list.
_LONG_MODULES: dict[str, int] = {}


def test_no_module_grows_past_500_lines():
    lines = {name: len(path.read_text().splitlines()) for name, path in MODULES.items()}
    over = {name: n for name, n in lines.items() if n > 500}
    assert set(over) <= set(_LONG_MODULES), f"new modules over 500 lines: {set(over) - set(_LONG_MODULES)}"
    grown = {name: (n, _LONG_MODULES[name]) for name, n in over.items() if n > _LONG_MODULES[name]}
    assert not grown, f"modules over 500 lines grew (now, allowed): {grown}"


ARCHITECTURE = PACKAGE.parent / "docs" / "architecture.md"
# Registries filled or shaped in a way the table test below cannot see (by a decorator, rows of
# names or plain strings), named explicitly.
_OTHER_REGISTRIES = {
    ("runtime/__init__.py", "RUNTIMES"),
    ("cli/app.py", "COMMANDS"),
    ("hardware.py", "PRODUCTS"),
    ("hardware.py", "KNOWN_UNSERVED"),
}


def _where_a_new_thing_goes() -> set[tuple[str, str]]:
    """(module path under m31ctl/, NAME) for each "`path.py` `NAME`" the section names."""
    import re  # only this test reads prose

    text = ARCHITECTURE.read_text().split("## Where a new thing goes", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"`([\w/]+\.py)` `([A-Z_]+|text_view)`", " ".join(text.split())))


def _registry_tables() -> set[tuple[str, str]]:
    """Module-level tables whose rows are constructed values or functions: a registry."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        if "schemas" in path.parts:
            continue
        for node in ast.parse(path.read_text()).body:
            name, value = None, None
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and isinstance(node.targets[0], ast.Name)
            ):
                name, value = node.targets[0].id, node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                name, value = node.target.id, node.value
            if not name or not name.isupper() or not isinstance(value, ast.Dict) or len(value.values) < 2:
                continue
            rows = value.values
            if all(isinstance(v, ast.Call | ast.Name) for v in rows):
                found.add((path.relative_to(PACKAGE).as_posix(), name))
    return found


def test_where_a_new_thing_goes_names_every_registry_and_each_exists():
    named = _where_a_new_thing_goes()
    missing = (_registry_tables() | _OTHER_REGISTRIES) - named
    assert not missing, (
        f"registries docs/architecture.md does not name under 'Where a new thing goes': {missing}"
    )
    for module, name in named:
        source = (PACKAGE / module).read_text()
        defined = f"\n{name}:" in source or f"\n{name} =" in source or f"\ndef {name}(" in source
        assert defined, f"docs/architecture.md names {module} {name}, which that module does not define"
