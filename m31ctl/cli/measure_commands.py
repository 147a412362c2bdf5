"""The commands that measure a server or the checkpoint it serves: smoke, verify, bench (and
`bench compare`), pull, rehearse. Each parses its options, calls one function below cli/ and
prints what it returned."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from m31ctl.cli.app import command
from m31ctl.cli.options import (
    AnyRuntimeOpt,
    BenchPythonOpt,
    JsonOpt,
    NameOpt,
    NoValidateOpt,
    PlanOptions,
    ReportOpt,
    ToleranceOpt,
    UrlOpt,
)
from m31ctl.cli.output import emit
from m31ctl.errors import ExitCode, InputError

if TYPE_CHECKING:
    from m31ctl.deployment import Deployment


@command
def smoke(
    url: UrlOpt = None,
    name: NameOpt = None,
    model: Annotated[
        str | None, typer.Option("--model", help="Served model name (default: the first).")
    ] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Tokens to generate.")] = 16,
    runtime: AnyRuntimeOpt = None,
    json: JsonOpt = False,
) -> int:
    """A chat completion and a streamed one; TTFT, tok/s.

    Send a chat completion and a streamed one; check their shape; measure TTFT and tokens/s."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.cli import smoking  # noqa: F401  (registers the smoke report's text view)
    from m31ctl.runtime import running_server
    from m31ctl.served import smoke as smoke_test

    if url is None:
        server = running_server(name, runtime)
        url = str(server.endpoint)
        # The model the server was launched to serve (its recorded plan), not merely the first listed.
        model = model or (server.plan.served_model if server.plan else None)
    report = smoke_test.run(url.rstrip("/"), model, max_tokens)
    emit(report, json)
    return int(ExitCode.OK if report.ok else ExitCode.CHECK_FAILED)


@command
def verify(
    plan_options: PlanOptions,
    url: UrlOpt = None,
    name: NameOpt = None,
    runtime: AnyRuntimeOpt = None,
    bench_python: BenchPythonOpt = None,
    no_load: Annotated[bool, typer.Option("--no-load", help="Skip the vllm bench serve run.")] = False,
    output: ReportOpt = None,
    baseline: Annotated[
        Path | None, typer.Option("--baseline", help="Fail when worse than this earlier report.")
    ] = None,
    tolerance: ToleranceOpt = 0.25,
    json: JsonOpt = False,
) -> int:
    """Prove the running server is the plan's (the gate).

    Function, served facts, vllm bench serve load, regression."""
    from m31ctl.cli.verifying import run_verify  # lazy: only the command run loads its modules (COMMANDS)

    def asked() -> Deployment:
        from m31ctl.commands import deployment  # lazy: only when no server's recorded plan is used

        return deployment(plan_options.request(), validate=False, fit=False)

    # Without plan options a server's recorded plan is verified (no probe of this host for one).
    return run_verify(
        asked,
        plan_options.given,
        url=url,
        name=name,
        runtime=runtime,
        bench_python=bench_python,
        no_load=no_load,
        output=output,
        baseline=baseline,
        tolerance=tolerance,
        as_json=json,
    )


# bench's price and pick options, shared with `bench compare`.
GpuHourOpt = Annotated[
    float | None, typer.Option("--gpu-hour", help="Price per GPU-hour: report cost per million tokens.")
]
NodeHourOpt = Annotated[
    float | None, typer.Option("--node-hour", help="Price per node-hour (instead of --gpu-hour).")
]
CurrencyOpt = Annotated[str, typer.Option("--currency", help="The price's currency code.")]
PickOpt = Annotated[
    str, typer.Option("--pick", help="throughput | cost: what the best point under the SLO maximises.")
]


@command
def bench(
    plan_options: PlanOptions,
    url: UrlOpt = None,
    name: NameOpt = None,
    runtime: AnyRuntimeOpt = None,
    bench_python: BenchPythonOpt = None,
    concurrency: Annotated[
        str, typer.Option("--concurrency", help="Points to measure, e.g. 1,4,16.")
    ] = "1,4,16",
    workload: Annotated[str, typer.Option("--workload", help="chat | agentic | long-context.")] = "chat",
    slo: Annotated[
        str | None,
        typer.Option("--slo", help="e.g. ttft_p99_ms=500,tpot_p99_ms=50: pick the best point meeting it."),
    ] = None,
    requests: Annotated[
        int | None,
        typer.Option(
            "--requests", help="Requests per point (default 4x concurrency, at least verify.requests)."
        ),
    ] = None,
    output_len: Annotated[
        int | None,
        typer.Option("--output-len", help="Output tokens per request (default verify.output_len)."),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the generated workload.")] = 0,
    plot: Annotated[Path | None, typer.Option("--plot", help="Draw the frontier to this PNG.")] = None,
    write_profile: Annotated[
        Path | None,
        typer.Option("--write-profile", help="Write the chosen point as a plan layer file (YAML)."),
    ] = None,
    output: ReportOpt = None,
    baseline: Annotated[
        Path | None, typer.Option("--baseline", help="Fail when worse than this earlier bench report.")
    ] = None,
    tolerance: ToleranceOpt = 0.25,
    gpu_hour: GpuHourOpt = None,
    node_hour: NodeHourOpt = None,
    currency: CurrencyOpt = "USD",
    pick: PickOpt = "throughput",
    json: JsonOpt = False,
) -> int:
    """Measure the serving frontier with vllm bench serve.

    It becomes the plan's operating point (`m31ctl bench compare A.json B.json` lays reports side
    by side)."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.cli.bench import parse_concurrency, run_bench
    from m31ctl.served.bench_run import BenchRequest
    from m31ctl.served.target import Where

    request = BenchRequest(
        where=Where(url=url, name=name, runtime=runtime, bench_python=bench_python),
        concurrencies=parse_concurrency(concurrency),
        workload=workload,
        slo=slo,
        requests=requests,
        output_len=output_len,
        seed=seed,
        baseline=baseline,
        tolerance=tolerance,
        gpu_hour=gpu_hour,
        node_hour=node_hour,
        currency=currency,
        pick=pick,
        profile=write_profile,
        plot=plot,
    )

    def asked() -> Deployment:
        from m31ctl.commands import deployment  # lazy: only when no server's recorded plan is used

        return deployment(plan_options.request(), validate=False, fit=False)

    # Without plan options a server's recorded plan is used, as verify does (no probe of this host).
    return run_bench(asked, plan_options.given, request, output=output, as_json=json)


# `m31ctl bench compare`: bench's one sub-command. bench takes no positional argument, so a command
# line whose word after `bench` is `compare` names it (build_app registers this group instead).
bench_app = typer.Typer(help="Compare bench reports.", no_args_is_help=True)


@bench_app.command("compare")
def bench_compare(
    reports: Annotated[list[Path], typer.Argument(help="Two or more bench reports (bench -o).")],
    slo: Annotated[
        str | None, typer.Option("--slo", help="The verdict's SLO (default: the first report's).")
    ] = None,
    pick: PickOpt = "throughput",
    gpu_hour: GpuHourOpt = None,
    node_hour: NodeHourOpt = None,
    currency: CurrencyOpt = "USD",
    force: Annotated[
        bool, typer.Option("--force", help="Compare reports of different workloads or models.")
    ] = False,
    plot: Annotated[Path | None, typer.Option("--plot", help="Draw the frontiers together here.")] = None,
    output: Annotated[Path | None, typer.Option("-o", "--output", help="Save the comparison here.")] = None,
    json: JsonOpt = False,
) -> int:
    """Lay bench reports side by side: point by point differences and which run's best point wins."""
    from m31ctl.cli.bench_compare import (  # lazy: only the command run loads its modules (COMMANDS)
        CompareOptions,
        run_compare,
    )

    options = CompareOptions(
        reports=tuple(reports),
        slo=slo,
        pick=pick,
        gpu_hour=gpu_hour,
        node_hour=node_hour,
        currency=currency,
        force=force,
        plot=plot,
        output=output,
        as_json=json,
    )
    return run_compare(options)


@command
def pull(
    plan_options: PlanOptions,
    revision: Annotated[
        str, typer.Option("--revision", help="Branch, tag or commit; the download is pinned to its commit.")
    ] = "main",
    verify: Annotated[
        bool, typer.Option("--verify", help="Check every file's size and hub hash; fetch bad ones again.")
    ] = False,
    stall_timeout: Annotated[
        float,
        typer.Option("--stall-timeout", help="Seconds without a byte before a file's transfer is retried."),
    ] = 60.0,
    retries: Annotated[
        int,
        typer.Option(
            "--retries", help="Retries of a stalled file (then plain HTTP instead of Xet, then exit 5)."
        ),
    ] = 3,
    json: JsonOpt = False,
) -> int:
    """Download the plan's checkpoint into its cache.

    The checkpoint and its dspark/ draft, into its Hugging Face cache: resumable, watched, pinned."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.cli.pulling import run_pull
    from m31ctl.commands import deployment

    d = deployment(plan_options.request(), validate=False, fit=False)  # no GPU needed
    return run_pull(d, revision, verify, stall_timeout, retries, json)


@command
def rehearse(
    plan_options: PlanOptions,
    target: Annotated[str, typer.Option("--target", help="What to render and run (k8s).")] = "k8s",
    keep: Annotated[
        bool, typer.Option("--keep", help="Leave the containers and network for a look.")
    ] = False,
    timeout: Annotated[int, typer.Option("--timeout", help="Seconds for the leader to become ready.")] = 600,
    image: Annotated[
        str, typer.Option("--image", help="Rehearsal base image (vLLM's CPU build).")
    ] = "m31ctl/vllm-cpu:0.32.0",
    clock_scale: Annotated[
        float | None,
        typer.Option(
            "--clock-scale",
            help="Rehearse at the plan's own clock scaled by F (0 < F <= 1): a load of that length "
            "injected into every engine, vLLM's handshake scaled alike (README: the deployment's clock).",
        ),
    ] = None,
    leader_delay: Annotated[
        float, typer.Option("--leader-delay", help="Start the leader S seconds after its workers.")
    ] = 0.0,
    rollout: Annotated[
        bool,
        typer.Option(
            "--rollout",
            help="Then roll an image change out by the rendered strategy under load, and drain the "
            "old pod with a stream on it (an aggregated plan on one node; about 4 minutes more).",
        ),
    ] = False,
    no_validate: NoValidateOpt = False,
    json: JsonOpt = False,
) -> int:
    """Run the plan's layout for real on vLLM's CPU build.

    Its rendered commands with a tiny model, Docker containers as nodes; completions and smoke
    through the leader; then it all removed."""
    # lazy: only the command run loads its modules (COMMANDS)
    from m31ctl.cli.rehearsing import run_rehearse
    from m31ctl.commands import deployment
    from m31ctl.rehearsal.session import Options

    if timeout <= 0:
        raise InputError(f"--timeout {timeout} is not a positive number of seconds")
    if clock_scale is not None and not 0 < clock_scale <= 1:
        raise InputError(f"--clock-scale {clock_scale:g} is not in (0, 1]", hint="e.g. --clock-scale 0.05")
    if leader_delay < 0:
        raise InputError(f"--leader-delay {leader_delay:g} is negative")
    plan = deployment(plan_options.request(), not no_validate).plan
    options = Options(
        target, keep, timeout, image, clock_scale=clock_scale, leader_delay_s=leader_delay, rollout=rollout
    )
    return run_rehearse(plan, options, json)
