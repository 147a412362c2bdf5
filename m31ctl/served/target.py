"""The one way verify and bench find what they talk to: the server's URL, the plan to read it
with, the plan hash it records, and the benchmark runner (its engine's own vLLM).

A server m31ctl runs is read with the plan it was launched with (recorded with it) unless plan
options are given; then with theirs, and the settings that differ are named in a plan check. So
a bare `m31ctl verify` or `m31ctl bench` never probes this host for a plan. --url names a server
m31ctl may not run: the plan options' plan, and a runner only from --bench-python."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from m31ctl.checks import CheckResult, judged
from m31ctl.deployment import Deployment
from m31ctl.errors import InputError
from m31ctl.runtime import get_runtime, running_server
from m31ctl.runtime.load_run import BenchRunner, native_bench
from m31ctl.runtime.planrecord import comparison, recorded_deployment


class Target(NamedTuple):
    deployment: Deployment  # the plan the server is read with
    base: str  # its URL, without a trailing slash
    server_hash: str | None  # the plan hash the server records (None: --url)
    plan_check: CheckResult | None  # the recorded plan against the asked one (None: nothing recorded)
    bench: BenchRunner | None  # None: --url without --bench-python

    @property
    def engine_base(self) -> str:
        """Where the engine's own /metrics are: a P/D group's decode role that m31ctl runs (its
        prompts arrive as KV from prefill; the router in front exports only its own metrics, on
        a port of its own), else the server itself (--url names a server only by its URL)."""
        if self.deployment.disaggregated is None or self.server_hash is None:
            return self.base
        return self.deployment.answering_engine.network.local_url

    @property
    def prefill_base(self) -> str | None:
        """Where a P/D group's prefill role that m31ctl runs answers, asked directly (verify's
        pd-parity reference: a request without kv_transfer_params is served wholly there); None
        for a server of one engine, or one --url names (the router's URL names no role)."""
        if self.deployment.disaggregated is None or self.server_hash is None:
            return None
        return self.deployment.disaggregated.prefill.network.local_url


class Where(NamedTuple):
    """Where the server is, as the options name it."""

    url: str | None
    name: str | None
    runtime: str | None
    bench_python: str | None


def find(asked: Callable[[], Deployment], given: bool, where: Where, shared: Sequence[str] = ()) -> Target:
    """`asked()` resolves the plan options (`given`: any were passed). `shared`: host folders
    the benchmark reads (a generated dataset), at the same path wherever it runs."""
    chosen = native_bench(where.bench_python) if where.bench_python else None
    if where.url is not None:
        return Target(asked(), where.url.rstrip("/"), None, None, chosen)
    server = running_server(where.name, where.runtime)
    own: Deployment | None = None
    if server.plan is not None:
        try:
            own = recorded_deployment(server.plan)
        except InputError:
            if not given:
                raise
    deployment = asked() if given or own is None else own
    check = None
    if own is not None:
        ok, message = comparison(server.plan_hash or "?", own.plan, deployment.plan)
        check = judged("plan", ok, message)
    # The server's own engine runs the benchmark: its image (or Python) as launched.
    bench = chosen or get_runtime(server.runtime).bench_runner(own or deployment, shared=tuple(shared))
    return Target(deployment, str(server.endpoint), server.plan_hash, check, bench)
