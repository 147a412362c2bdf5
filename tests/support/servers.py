"""Real engines the session shares: one aggregated CPU server launched by m31ctl itself, natively
(issue 47: each vLLM start costs about a minute of this two-core machine, and an idle aggregated
vLLM costs nothing: docs/decisions.md "The test command in 35 minutes"). The tests that only read
a server (smoke, verify, bench, status, logs, capacity) use this one; tests that kill, restart or
reconfigure an engine start their own."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from subprocess import CompletedProcess

from tests.conftest import last_json, run_cli
from tests.ports import free_port
from tests.support import cli_json


@dataclass(frozen=True)
class Server:
    """A launched server: what launched it, and how to reach it with m31ctl."""

    name: str
    port: int
    model: Path
    env: dict[str, str]  # M31CTL_STATE_DIR: the server's records
    plan: tuple[str, ...]  # the plan options, --name and --port as the settings they set
    launch_args: tuple[str, ...]
    launched: CompletedProcess[str]

    @property
    def result(self) -> dict:  # type: ignore[type-arg]
        return dict(last_json(self.launched.stdout))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def launch_cpu_server(model: Path, vllm_py: str, state: Path) -> Server:
    """The CPU rehearsal recipe launched natively on `model`, with the preflight's deep checks (this
    is the suite's one launch that proves them inside launch; doctor's tests prove each check)."""
    name, port = f"m31ctl-shared-{uuid.uuid4().hex[:6]}", free_port()
    sets = (f"model.path={model}", f"runtime.native_python={vllm_py}")
    plan = ("--hardware", "cpu", *(w for s in sets for w in ("--set", s)))
    plan_with_names = (*plan, "--set", f"runtime.container_name={name}", "--set", f"runtime.port={port}")
    args = ("launch", "--runtime", "native", *plan, "--name", name, "--port", str(port), "--timeout", "900")
    env = {"M31CTL_STATE_DIR": str(state)}
    launched = run_cli(*args, "--json", env=env)
    assert launched.returncode == 0, launched.stderr[-3000:]
    return Server(name, port, model, env, plan_with_names, args, launched)


def stop_and_check(server: Server) -> None:
    """Stop the shared server and prove stop's promise: it said what it stopped, the engine's
    process is gone, status lists nothing."""
    rows = cli_json.data(run_cli("status", "--runtime", "native", "--json", env=server.env).stdout)[
        "containers"
    ]
    pids = [r["pid"] for r in rows if r["name"] == server.name]
    stopped = run_cli("stop", "--runtime", "native", "--json", env=server.env)
    assert stopped.returncode == 0 and cli_json.data(stopped.stdout)["stopped"] == [server.name], (
        stopped.stderr
    )
    for pid in pids:
        assert (
            not os.path.exists(f"/proc/{pid}")
            or Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
        ), f"the engine {pid} outlived stop"
    assert (
        cli_json.data(run_cli("status", "--runtime", "native", "--json", env=server.env).stdout)["containers"]
        == []
    )
