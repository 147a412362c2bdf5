"""The `docker` runtime: the serving container's lifecycle on the Docker Engine, by job.

This class is the Runtime protocol's face and only dispatches: one container's launch
(runtime/docker_launch.py, converged by runtime/flow.py) or a P/D group's (runtime/docker_group.py,
given the pair that m31ctl/pair.py places on this host); what stands, its logs and its stop
(runtime/docker_servers.py); the engine container's host settings and the throwaway runs in the
engine image (runtime/docker_create.py). Only containers labelled as ours are ever changed, and
every Engine call runs inside engine_api.engine_boundary, so SDK errors surface as documented exit
codes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from m31ctl.container import container_spec
from m31ctl.deployment import Deployment
from m31ctl.docker_run import docker_run_argv
from m31ctl.errors import M31Error
from m31ctl.pair import docker_pair
from m31ctl.runtime import docker_group, docker_servers, engine_api
from m31ctl.runtime.docker_create import run_script
from m31ctl.runtime.docker_launch import ContainerLaunch, single
from m31ctl.runtime.flow import converge
from m31ctl.runtime.gates import CheckId
from m31ctl.runtime.load_run import BenchRunner, container_bench
from m31ctl.runtime.protocol import DryRun, LaunchOptions, LaunchResult, Reporter, ScriptRun, ServerStatus


class DockerRuntime:
    name = "docker"
    gates = (
        CheckId.DOCKER,
        CheckId.GPU_RUNTIME,
        CheckId.GPUS,
        CheckId.GPU_MEMORY,
        CheckId.MIG,
        CheckId.DISK,
        CheckId.SHM,
        CheckId.CAPACITY,
        CheckId.API_KEY,
    )

    # A P/D plan runs as one group: prefill, decode and vllm-router (runtime/docker_group.py).
    runs_groups = True

    def dry_run(self, deployment: Deployment) -> DryRun:
        if deployment.disaggregated is not None:
            return docker_group.dry_run_group(
                docker_pair(deployment, "launch", on_this_host=True, fronted=True)
            )
        spec = container_spec(deployment)
        return DryRun(
            "container",
            ("docker", *docker_run_argv(spec, "detached")),
            {"container": spec.to_data()},
            argv_key="docker_run",
        )

    def launch(self, deployment: Deployment, options: LaunchOptions) -> LaunchResult:
        with engine_api.engine_boundary("launching"):
            # a changed plan's container is stopped on this client (flow.converge)
            client, cwd = engine_api.connect(timeout=engine_api.STOPPING_TIMEOUT_S), os.getcwd()
            if deployment.disaggregated is not None:
                # Placed once (m31ctl/pair.py) and read by the group's launch; started here, its
                # roles join this host's GPU groups by GID.
                pair = docker_pair(deployment, "launch", on_this_host=True, fronted=True)
                return docker_group.launch_group(
                    pair, options, client, lambda part, o: ContainerLaunch(part, o, client, cwd)
                )
            backend = ContainerLaunch(single(deployment), options, client, cwd)
            return converge(self.name, backend, deployment, options)

    def servers(self) -> list[ServerStatus]:
        with engine_api.engine_boundary("listing containers"):
            return docker_servers.servers(engine_api.connect())

    def foreign(self, name: str) -> bool:
        with engine_api.engine_boundary("looking up a container"):
            container = engine_api.find_container(engine_api.connect(), name)
            return container is not None and not docker_servers.ours(container)

    def logs(self, name: str, follow: bool, tail: int, write: Callable[[str], None]) -> None:
        with engine_api.engine_boundary("reading logs"):
            docker_servers.write_logs(engine_api.connect(), name, follow, tail, write)

    def stop(self, name: str, timeout: int | None, keep: bool, report: Reporter) -> None:
        with engine_api.engine_boundary("stopping a container"):
            client = engine_api.connect(timeout=engine_api.STOPPING_TIMEOUT_S)
            docker_servers.stop(client, name, timeout, keep, report)

    def bench_runner(self, deployment: Deployment, shared: Sequence[str] = ()) -> BenchRunner:
        spec = container_spec(deployment)
        mounts = [(m.source, m.target) for m in spec.mounts] + [(path, path) for path in shared]
        return container_bench(spec.image, mounts)

    def run_engine_script(
        self,
        deployment: Deployment,
        script: Path,
        args: Sequence[str],
        timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> ScriptRun:
        return run_script(deployment, script, args, timeout, env)

    def engine_identity(self, deployment: Deployment) -> str | None:
        """The engine image's ID: a tag moved to another build is another engine."""
        image = container_spec(deployment).image
        try:
            with engine_api.engine_boundary(f"reading the ID of {image}"):
                found = engine_api.local_image(engine_api.connect(), image)
        except M31Error:
            return None  # the preflight's own Docker checks say why
        return f"{image} {found.id}" if found is not None else None


# doctor's host check imports the trial run from here (m31ctl/doctor/checks/host.py).
__all__ = ["DockerRuntime"]
