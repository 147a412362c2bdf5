"""`m31ctl bench`'s core: its options checked, the server found as verify finds it (target.py),
the sweep run against it (sweep.py) and the report built (bench_report.py). The CLI parses the
options, shows the progress events, writes the files the report names and prints it."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

from m31ctl.deployment import Deployment
from m31ctl.errors import InputError
from m31ctl.plan import Plan
from m31ctl.served import bench_report, figures, sweep, workloads
from m31ctl.served import target as targets
from m31ctl.served.baseline import bench_points
from m31ctl.served.cost import Costing, Price, deployment_costing, parse_price
from m31ctl.served.figures import Limit
from m31ctl.served.server import HttpServer
from m31ctl.served.sweep import Event, Sweep

# --pick: what the operating point maximises among the points that meet the SLO.
PICKS = ("throughput", "cost")


class BenchRequest(NamedTuple):
    """bench's options, as the CLI parsed them (built by keyword)."""

    where: targets.Where
    concurrencies: tuple[int, ...]
    workload: str = "chat"
    slo: str | None = None
    requests: int | None = None
    output_len: int | None = None
    seed: int = 0
    baseline: Path | None = None
    tolerance: float = 0.25
    gpu_hour: float | None = None  # price per GPU-hour (--gpu-hour)
    node_hour: float | None = None  # price per node-hour (--node-hour)
    currency: str = "USD"
    pick: str = "throughput"
    profile: Path | None = None  # where the chosen point goes as a layer file (--write-profile)
    plot: Path | None = None  # where the frontier plot goes (--plot)


class Checked(NamedTuple):
    """What check() made of the options that need more than parsing."""

    slo: tuple[Limit, ...]
    price: Price | None


class BenchResult(NamedTuple):
    """bench's result: the plan the figures were read with, the sweep, its report (what --json
    prints and -o saves, naming the profile and plot it asks the CLI to write), the profile's
    text, and the price applied."""

    plan: Plan
    found: Sweep
    report: dict[str, Any]
    profile_text: str | None
    profile_asked: bool
    costing: Costing | None = None

    @property
    def ok(self) -> bool:
        return bool(self.report["ok"])

    def to_json(self) -> dict[str, Any]:
        return self.report


def check(req: BenchRequest) -> Checked:
    """Refuse bad options before anything runs (exit 2)."""
    if req.pick not in PICKS:
        raise InputError(f"unknown --pick {req.pick!r}", hint=f"choose one of: {', '.join(PICKS)}")
    price = parse_price(req.gpu_hour, req.node_hour, req.currency)
    if price is None and req.pick == "cost":
        raise InputError("--pick cost needs a price", hint="add --gpu-hour PRICE or --node-hour PRICE")
    if req.workload not in workloads.WORKLOADS:
        raise InputError(
            f"unknown --workload {req.workload!r}", hint=f"choose one of: {', '.join(workloads.WORKLOADS)}"
        )
    for flag, value in (("--requests", req.requests), ("--output-len", req.output_len)):
        if value is not None and value < 1:
            raise InputError(f"{flag} {value} must be at least 1")
    if not (0 <= req.tolerance < math.inf):
        raise InputError(f"--tolerance {req.tolerance:g} must be a non-negative fraction", hint="e.g. 0.25")
    slo = figures.parse_slo(req.slo) if req.slo is not None else ()
    return Checked(slo, price)


def run(
    asked: Callable[[], Deployment],
    given: bool,
    req: BenchRequest,
    checked: Checked,
    on_event: Callable[[Event], None],
) -> BenchResult:
    """`asked()` resolves the plan options (`given`: any were passed); without them, the plan a
    server m31ctl runs was launched with is used, as verify does (target.py). Progress goes to
    `on_event`."""
    baseline = bench_points(req.baseline, req.workload) if req.baseline is not None else None
    with tempfile.TemporaryDirectory(prefix="m31ctl-bench-") as tmp:
        workdir = Path(tmp)
        workdir.chmod(0o755)  # a sibling container's benchmark reads the datasets
        # The dataset m31ctl writes is read at the same path by the engine's benchmark.
        target = targets.find(asked, given, req.where, shared=(str(workdir),))
        if target.bench is None:
            raise InputError(
                "--url needs --bench-python: a Python with vLLM, to run vllm bench serve",
                hint="or bench the server m31ctl runs (--name)",
            )
        plan = target.deployment.plan
        costing = deployment_costing(target.deployment, checked.price)
        objective = costing.objective() if costing is not None and req.pick == "cost" else figures.THROUGHPUT
        request = sweep.SweepRequest(
            base=target.base,
            workload=req.workload,
            concurrencies=req.concurrencies,
            requests=req.requests,
            output_len=req.output_len,
            slo=checked.slo,
            seed=req.seed,
            objective=objective,
            gpus=target.deployment.serving_gpus,
        )
        server = HttpServer(target.base, plan.settings.model.served_name, engine_base=target.engine_base)
        try:
            found = sweep.run(plan, request, server, target.bench, workdir, on_event)
        finally:
            server.close()
    return report_of(plan, req, found, target.server_hash, baseline, costing)


def report_of(
    plan: Plan,
    req: BenchRequest,
    found: Sweep,
    server_hash: str | None,
    baseline: list[dict[str, Any]] | None,
    costing: Costing | None = None,
) -> BenchResult:
    """The report of a finished sweep, naming the profile and the plot the CLI writes (no plot
    when no point measured anything: an empty plot says nothing)."""
    want_profile = req.profile is not None
    made = bench_report.build(
        plan, found, server_hash, baseline, req.tolerance, costing, req.pick,
        datetime.now(timezone.utc), want_profile=want_profile,
    )  # fmt: skip
    report = made.data
    if req.profile is not None and made.profile_text is not None:
        report["profile"] = str(req.profile)
    if req.plot is not None:
        if bench_report.plottable(found):
            report["plot"] = str(req.plot)
        else:
            report["plot"] = None
            report["warnings"].append(f"plot: {req.plot} not written: no point was measured")
    return BenchResult(plan, found, report, made.profile_text, want_profile, costing)
