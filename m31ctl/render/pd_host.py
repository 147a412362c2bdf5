"""A prefill/decode (P/D) plan on one host without Compose: the script and systemd targets.

Each role runs as the aggregated server's container does (targets.py: the same `docker run`
argv, download, secrets and readiness wait), on the pair's own Docker network with the fixed
address it advertises to its peer for NIXL's side channel, exactly as the Compose target and
launch place them (m31ctl/pair.py: the pair on one host, the one definition all of them read).
vllm-router starts once both roles answer /health: it gives up on workers after its own startup
timeout. It checks no key and serves worker management, so it listens on the loopback of its
front's network namespace (issue 49, engine/router_front.py: the Compose target's front, the
same DockerPair.front), and the front holds the pair's network and the published ports. The
script runs the roles, the front and the router in that order and removes what it started when
it fails; systemd gets one unit per role and the router's, which runs the front beside the
router, ordered by After=/Requires=.
docs/decisions.md ("P/D: script and systemd targets") cites the sources.
"""

from __future__ import annotations

import shlex
from typing import Any

from m31ctl.deployment import RENDERED_ROUTER_METRICS_PORT, Deployment
from m31ctl.docker_run import docker_run_argv
from m31ctl.engine.adapter import SIDE_CHANNEL_HOST_ENV
from m31ctl.pair import (
    PAIR_SUBNET,
    ROUTER_API_KEY_ENV,
    DockerPair,
    PairRole,
    docker_pair,
    front_run_argv,
    pair_upstreams,
    router_run_argv,
)
from m31ctl.redact import API_KEY_ENV
from m31ctl.render.artifact import Artifact
from m31ctl.render.common import header, health_command, render_template
from m31ctl.render.pd import download_spec, group_download_spec
from m31ctl.render.script_cache import at_run_time, script_cache
from m31ctl.render.targets import (
    ENV_FILE,
    ENV_FILE_FORMAT,
    HF_TOKEN_FILE,
    HF_TOKEN_IN_CONTAINER,
    HF_TOKEN_PATH_ENV,
    READY_POLL_S,
    SERVED,
    SYSTEMD_DOCKER,
    UnitExtras,
    download_argv,
    engine_secret_env,
    env_file_check,
    env_file_precheck,
    paired,
    readiness_wait_on,
    systemd_unit,
    writable_sources,
)

# The script's exit code when the pair's network exists with another subnet (as for a container
# that exists already: something of this host is in the way).
IN_THE_WAY = 4


def network_ensure(docker: str, network: str, code: int, created: str) -> str:
    """A sh snippet: the pair's network exists with PAIR_SUBNET, else exit `code`. `created`:
    a statement run when this snippet created it. Both role units run it at once, so a create that
    fails because the peer's unit created it first is no failure."""
    net, subnet = shlex.quote(network), shlex.quote(PAIR_SUBNET)
    fmt = shlex.quote("{{range .IPAM.Config}}{{.Subnet}} {{end}}")
    return (
        f"if ! {docker} network inspect {net} >/dev/null 2>&1; then\n"
        f"  if {docker} network create --driver bridge --subnet {subnet} {net} >/dev/null; then\n"
        f"    {created}\n"
        f"  elif ! {docker} network inspect {net} >/dev/null 2>&1; then\n"
        f'    echo "m31ctl: could not create network" {net} "({PAIR_SUBNET})" >&2\n'
        f"    exit {code}\n"
        "  fi\n"
        "fi\n"
        f"subnets=$({docker} network inspect --format {fmt} {net})\n"
        'case " $subnets " in\n'
        f'  *" {PAIR_SUBNET} "*) ;;\n'
        f'  *) echo "m31ctl: network" {net} "has subnet(s) $subnets, not {PAIR_SUBNET}: remove it (docker network rm"'
        f' {net}")" >&2\n'
        f"     exit {code} ;;\n"
        "esac"
    )


# ---------------------------------------------------------------------------------------------
# script


def _script_role(pair: DockerPair, role: PairRole) -> dict[str, Any]:
    spec = role.spec
    argv = docker_run_argv(spec._replace(secret_env=()), "detached", attachment=role.attachment)
    argv = at_run_time(role.engine, argv)  # the cache in the home of whoever runs the script
    split = argv.index(spec.image)
    return {
        "var": role.key.upper(),
        "key": role.key,
        "name": spec.name,
        "address": role.address,
        "run_lines": paired(argv[:split]),
        "engine_lines": paired(argv[split:]),
        "ready_s": spec.startup_timeout,
        "load_s": role.engine.timeline.load_s,
        "health_argv": health_command(spec, "/health"),
    }


def render_script_pd(deployment: Deployment) -> list[Artifact]:
    pair = docker_pair(deployment, "script", fronted=True)
    group, prefill, router_spec = pair.group, pair.roles[0], pair.router_spec
    assert pair.front is not None
    specs = [role.spec for role in pair.roles]
    fetch = group_download_spec(pair)  # one for both roles, as Compose's download service
    download = at_run_time(deployment, download_argv(prefill.engine, fetch, token_by_name=False))
    at = download.index(fetch.image) if download else 0
    router, front = router_run_argv(pair, "detached"), front_run_argv(pair, "detached")
    content = render_template(
        "script-pd.sh.j2",
        header_comment=header(deployment, "script"),
        env_file=ENV_FILE,
        env_format=ENV_FILE_FORMAT,
        env_check=env_file_check('"$ENV_FILE"', "$ENV_FILE", 2),
        network=pair.network,
        subnet=PAIR_SUBNET,
        network_ensure=network_ensure("docker", pair.network, IN_THE_WAY, "created_network=1"),
        side_channel_env=SIDE_CHANNEL_HOST_ENV,
        roles=[_script_role(pair, role) for role in pair.roles],
        router_name=router_spec.name,
        front_name=pair.front.name,
        front_run_lines=paired(front.options),
        front_lines=paired(front.command),
        front_key=bool(pair.front.secret_env),
        router_run_lines=paired(router.options),
        router_lines=paired(router.command),
        router_start_s=router_spec.startup_timeout,
        router_health_argv=health_command(router_spec, "/health"),
        router_key=bool(router_spec.secret_env),
        router_key_env=ROUTER_API_KEY_ENV,
        api_key_env=API_KEY_ENV,
        restart=prefill.spec.restart,
        poll_s=READY_POLL_S,
        secret_names=list(prefill.spec.secret_env),
        engine_secret_names=list(engine_secret_env(prefill.spec)),
        required_names=list(deployment.secrets.required),
        host_dirs=at_run_time(deployment, sorted({d for spec in specs for d in writable_sources(spec)})),
        hf_cache=script_cache(deployment),
        token_file=HF_TOKEN_FILE,
        token_path_env=HF_TOKEN_PATH_ENV,
        token_in_container=HF_TOKEN_IN_CONTAINER,
        download_name=f"{fetch.name}-download",
        download_lines=paired(download[:at]),
        download_command=download[at:],
        download_s=group.prefill.timeline.download_s,
        url=group.router.network.local_url,
    )
    return [Artifact("m31ctl-run.sh", content, 0o755)]


# ---------------------------------------------------------------------------------------------
# systemd


def _role_unit(pair: DockerPair, role: PairRole) -> Artifact:
    """The aggregated unit for the role (targets.systemd_unit): its own clocks, download and
    readiness wait, on the pair's network, which it creates if its peer's unit has not."""
    ensure = (
        f"The pair's network {pair.network} ({PAIR_SUBNET}), where this role advertises {role.address}.",
        network_ensure(SYSTEMD_DOCKER, pair.network, 1, ":"),
    )
    extras = UnitExtras(
        description=f"{SERVED} {role.key} engine of a prefill/decode pair, served by vLLM",
        pre_start=(ensure,),
        attachment=role.attachment,
        download=download_spec(role.engine, role.spec),
        group=pair.deployment,
    )
    return systemd_unit(role.engine, role.spec, extras)


def _router_start(pair: DockerPair) -> dict[str, Any]:
    """ExecStart: `docker run` itself, or, where the roles take an API key, through sh, which
    hands the key to the router's environment by name (systemd cannot copy one variable to another)."""
    router = router_run_argv(pair, "foreground")
    if not pair.router_spec.secret_env:
        return {"run_argv": [*router.options, *router.command], "run_script": ""}
    words = [SYSTEMD_DOCKER, *router.options, "--env", ROUTER_API_KEY_ENV, *router.command]
    script = (
        f'if [ -n "${{{API_KEY_ENV}:-}}" ]; then {ROUTER_API_KEY_ENV}="${API_KEY_ENV}"; '
        f"export {ROUTER_API_KEY_ENV}; fi\n"
        "exec " + " ".join(shlex.quote(w) for w in words)
    )
    return {"run_argv": [], "run_script": script}


def _front_start(pair: DockerPair) -> list[str]:
    """ExecStartPre: the front's `docker run`, detached and removed when it stops (the unit
    supervises it with the router: a front Docker restarted would leave the router in a network
    namespace that is gone), the roles' key by name from the unit's environment where keyed."""
    front = front_run_argv(pair, "foreground")  # --rm: no restart policy of Docker's
    assert pair.front is not None and front.options[:2] == ["run", "--rm"]
    keyed = ["--env", API_KEY_ENV] if pair.front.secret_env else []
    return [SYSTEMD_DOCKER, "run", "--detach", *front.options[1:], *keyed, *front.command]


def _router_unit(pair: DockerPair) -> Artifact:
    deployment, group, spec = pair.deployment, pair.group, pair.router_spec
    assert pair.front is not None
    clocks = group.router_timeline  # the unit's own; the container's are the spec's
    unit = f"{spec.name}.service"
    content = render_template(
        "systemd-router.service.j2",
        header_comment=header(deployment, "systemd"),
        unit_name=unit,
        description=f"{SERVED} prefill/decode router (vllm-router)",
        plan_hash=deployment.plan.hash,
        role_units=[f"{role.name}.service" for role in group.roles],
        upstreams=list(pair_upstreams(group)),
        network=pair.network,
        url=group.router.network.local_url,
        metrics_port=RENDERED_ROUTER_METRICS_PORT,
        router_key=bool(spec.secret_env),
        router_key_env=ROUTER_API_KEY_ENV,
        api_key_env=API_KEY_ENV,
        env_file=ENV_FILE,
        env_check=env_file_precheck(),
        required_names=list(deployment.secrets.required),
        name=spec.name,
        front_name=pair.front.name,
        front_argv=_front_start(pair),
        front_key=bool(pair.front.secret_env),
        docker=SYSTEMD_DOCKER,
        **_router_start(pair),
        ready_wait=readiness_wait_on(spec.name, health_command(spec, "/health"), spec.startup_timeout),
        start_s=spec.startup_timeout,
        start_timeout=clocks.systemd_start_s,
        stop_timeout=spec.stop_timeout,
        unit_stop_timeout=clocks.systemd_stop_s,
    )
    return Artifact(unit, content)


def render_systemd_pd(deployment: Deployment) -> list[Artifact]:
    pair = docker_pair(deployment, "systemd", fronted=True)
    return [*(_role_unit(pair, role) for role in pair.roles), _router_unit(pair)]
