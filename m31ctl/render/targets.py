"""Each target's artifacts from the Deployment: the shell script and systemd unit through the
templates in templates/, Compose and Kubernetes as data serialized to YAML."""

from __future__ import annotations

import shlex
from typing import Any, NamedTuple

from m31ctl.container import ContainerSpec
from m31ctl.deployment import Deployment
from m31ctl.errors import InputError
from m31ctl.render.common import header, health_command, in_comment, render_spec, render_template
from m31ctl.render.dockercli import docker_download_argv, docker_run_argv, publish_spec
from m31ctl.render.download import download_command
from m31ctl.render.escape import Interpolation, compose_escape, yaml_file
from m31ctl.render.k8s import k8s_comments, k8s_documents

ENV_FILE = "/etc/m31ctl/minimax-m31-flash.env"
# The one env-file format that docker's --env-file (the script) and systemd's EnvironmentFile=
# (the unit) read alike: NAME=value, a comment line, or a blank line. Docker keeps quotes,
# backslashes and spaces in a value as they are; systemd strips quotes, reads backslash escapes
# and trims spaces. (A grep -E pattern: inside brackets a backslash is literal.)
ENV_FILE_LINE = r"""^(#.*|[A-Za-z_][A-Za-z0-9_]*=[^[:space:]"'\$]*)?$"""
ENV_FILE_FORMAT = "one NAME=value a line, no quotes, spaces, backslashes or $ in a value (# starts a comment)"
# What systemd allows the start beyond the readiness wait: removing an old container, the checks.
START_MARGIN_S = 60
READY_POLL_S = 10


class Artifact(NamedTuple):
    name: str
    content: str
    mode: int = 0o644


def env_file_check(path: str, shown: str, code: int) -> str:
    """A sh snippet that stops (exit `code`) when the env file at `path` (a shell word; `shown`
    inside double quotes) strays from ENV_FILE_FORMAT. It names the lines by number only: their
    values are secrets."""
    message = ENV_FILE_FORMAT.replace("$", "\\$")
    return (
        f"bad=$(grep -n -v -E {shlex.quote(ENV_FILE_LINE)} {path} | cut -d: -f1 | paste -s -d, -) || true\n"
        'if [ -n "$bad" ]; then\n'
        f'  echo "m31ctl: {shown} line(s) $bad: write {message} (docker and systemd read the rest '
        'differently)" >&2\n'
        f"  exit {code}\n"
        "fi"
    )


def _download_argv(deployment: Deployment, spec: ContainerSpec, token_by_name: bool) -> list[str]:
    """The checkpoint download before the engine (render/download.py), or [] for a local one."""
    command = download_command(deployment)
    if command is None:
        return []
    return docker_download_argv(spec, command, deployment.vendor.visibility_vars, token_by_name)


def render_script(deployment: Deployment) -> list[Artifact]:
    spec = render_spec(deployment)
    argv = docker_run_argv(spec._replace(secret_env=()), "detached")
    split = argv.index(spec.image)
    download = _download_argv(deployment, spec, token_by_name=False)
    at = download.index(spec.image) if download else 0
    content = render_template(
        "script.sh.j2",
        header_comment=header(deployment, "script"),
        env_file=ENV_FILE,
        env_format=ENV_FILE_FORMAT,
        env_check=env_file_check('"$ENV_FILE"', "$ENV_FILE", 2),
        name=spec.name,
        secret_names=list(spec.secret_env),
        required_names=list(deployment.secrets.required),
        host_dirs=_writable_sources(spec),
        run_lines=_paired(argv[:split]),
        engine_lines=_paired(argv[split:]),
        download_lines=_paired(download[:at]),
        download_command=download[at:],
        download_s=deployment.budgets.download_s,
        url=deployment.network.local_url,
        startup_timeout=spec.startup_timeout,
        health_argv=health_command(spec, "/v1/models"),
    )
    return [Artifact("m31ctl-run.sh", content, 0o755)]


def _writable_sources(spec: ContainerSpec) -> list[str]:
    """Host directories to create before `docker run`: a bind mount (--mount, Compose's long
    syntax) does not create its source, as `-v` did (as root)."""
    return [m.source for m in spec.mounts if not m.read_only]


def _paired(argv: list[str]) -> list[list[str]]:
    """Group `--flag value` pairs onto one line each, so a reviewer reads the script like a recipe."""
    lines: list[list[str]] = []
    i = 0
    while i < len(argv):
        if argv[i].startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            lines.append(argv[i : i + 2])
            i += 2
        else:
            lines.append([argv[i]])
            i += 1
    return lines


def readiness_wait(spec: ContainerSpec) -> str:
    """The unit's ExecStartPost: systemd reports the unit started (and starts what is ordered
    after it) only once the model answers /health, the container's main process (`docker run`,
    $MAINPID) dies, or the startup budget passes."""
    probe = " ".join(shlex.quote(w) for w in health_command(spec, "/health"))
    name = shlex.quote(spec.name)
    budget = spec.startup_timeout
    return (
        f"deadline=$(($(date +%s) + {budget}))\n"
        f"until docker exec {name} {probe} >/dev/null 2>&1; do\n"
        f'  if [ -n "${{MAINPID:-}}" ] && ! kill -0 "$MAINPID" 2>/dev/null; then\n'
        f'    echo "m31ctl: {spec.name} exited while loading; see journalctl -u {spec.name}" >&2\n'
        f"    exit 1\n"
        f"  fi\n"
        f'  if [ "$(date +%s)" -ge "$deadline" ]; then\n'
        f'    echo "m31ctl: {spec.name} not ready after {budget} s" >&2\n'
        f"    exit 1\n"
        f"  fi\n"
        f"  sleep {READY_POLL_S}\n"
        f"done"
    )


def render_systemd(deployment: Deployment) -> list[Artifact]:
    spec = render_spec(deployment)
    unit = f"{spec.name}.service"
    env_check = (
        f"[ ! -e {shlex.quote(ENV_FILE)} ] || {{\n{env_file_check(shlex.quote(ENV_FILE), ENV_FILE, 1)}\n}}"
    )
    content = render_template(
        "systemd.service.j2",
        header_comment=header(deployment, "systemd"),
        unit_name=unit,
        plan_hash=deployment.plan.hash,
        env_file=ENV_FILE,
        env_format=ENV_FILE_FORMAT,
        env_check=env_check,
        name=spec.name,
        host_dirs=_writable_sources(spec),
        run_argv=docker_run_argv(spec, "foreground"),
        download_argv=_download_argv(deployment, spec, token_by_name=True),
        download_s=deployment.budgets.download_s,
        ready_wait=readiness_wait(spec),
        startup_timeout=spec.startup_timeout,
        start_timeout=spec.startup_timeout + START_MARGIN_S,
        stop_timeout=spec.stop_timeout,
        required_names=list(deployment.secrets.required),
    )
    return [Artifact(unit, content)]


def _compose_gpus(spec: ContainerSpec) -> dict[str, Any]:
    chosen: dict[str, Any] = (
        {"device_ids": list(spec.gpu_device_ids)} if spec.gpu_device_ids else {"count": spec.gpu_count}
    )
    device = {"driver": "nvidia", **chosen, "capabilities": ["gpu"]}
    return {"resources": {"reservations": {"devices": [device]}}}


def _compose_environment(deployment: Deployment, spec: ContainerSpec) -> list[str]:
    environment: list[str] = [f"{k}={v}" for k, v in spec.env]
    for name in spec.secret_env:
        # A bare NAME takes the value from the environment of `docker compose`: by reference.
        # A required one fails closed: Compose refuses to start without it.
        environment.append(
            Interpolation(f"{name}=${{{name}:?the plan requires {name}: export it before docker compose up}}")
            if name in deployment.secrets.required
            else name
        )
    return environment


def _compose_volume(source: str, target: str, read_only: bool) -> dict[str, Any]:
    """The long syntax: the short one splits on every colon, so a path with one breaks it."""
    volume: dict[str, Any] = {"type": "bind", "source": source, "target": target}
    if read_only:
        volume["read_only"] = True
    return volume


def compose_document(deployment: Deployment) -> dict[str, Any]:
    """Built from raw values, then escaped as a whole (compose_escape): Compose interpolates `$`
    in every string, so only the Interpolations stay live."""
    spec = render_spec(deployment)
    service: dict[str, Any] = {
        "image": spec.image,
        "container_name": spec.name,
        "command": list(spec.args),
        "labels": dict(spec.labels),
        "ports": [publish_spec(spec)],
        "volumes": [_compose_volume(m.source, m.target, m.read_only) for m in spec.mounts],
        "environment": _compose_environment(deployment, spec),
    }
    if spec.ipc_host:
        service["ipc"] = "host"
    else:
        service["shm_size"] = spec.shm_size
    service["ulimits"] = {name: {"soft": soft, "hard": hard} for name, soft, hard in spec.ulimits}
    if spec.device_request:
        service["deploy"] = _compose_gpus(spec)
    if spec.devices:
        service["devices"] = list(spec.devices)
        service["group_add"] = list(spec.group_add)
        service["cap_add"] = list(spec.cap_add)
    if spec.security_opt:
        service["security_opt"] = list(spec.security_opt)
    service["logging"] = {
        "driver": "json-file",
        "options": {"max-size": spec.log_max_size, "max-file": str(spec.log_max_files)},
    }
    service["restart"] = spec.restart
    service["stop_grace_period"] = f"{spec.stop_timeout}s"
    service["healthcheck"] = {
        "test": ["CMD", *health_command(spec, "/health")],
        "interval": "30s",
        "timeout": "10s",
        "retries": 3,
        "start_period": f"{spec.startup_timeout}s",
    }
    # No top-level `name`: Debian's docker-compose 1.29 refuses it; the project name comes from
    # the directory or `-p`, and the container is named by container_name either way.
    document: dict[str, Any] = compose_escape({"services": {"vllm": service}})
    return document


def render_compose(deployment: Deployment) -> list[Artifact]:
    spec = render_spec(deployment)
    comments = [
        *header(deployment, "compose").splitlines(),
        "# Secrets: HF_TOKEN and VLLM_API_KEY are taken from the environment of `docker compose` by name.",
        "# Create the cache directory first (a long-syntax bind mount does not): mkdir -p "
        + " ".join(in_comment(shlex.quote(d), "<runtime.hf_cache>") for d in _writable_sources(spec)),
    ]
    content = yaml_file(comments, [compose_document(deployment)], explicit_start=False)
    return [Artifact("compose.yaml", content)]


def single_host_only(deployment: Deployment, target: str) -> None:
    """script, compose and systemd run on one host: refuse a layout wider than it."""
    layout = deployment.layout
    if layout.spans_nodes:
        raise InputError(
            f"the plan spans {layout.nodes} nodes (parallelism.nodes): a {target} runs on one host",
            hint="use --target k8s (a LeaderWorkerSet spans nodes) or a host with enough GPUs",
        )


def render_k8s(deployment: Deployment) -> list[Artifact]:
    documents = k8s_documents(deployment)  # refusals first: no comment for a manifest not made
    comments = [*header(deployment, "k8s").splitlines(), *k8s_comments(deployment)]
    content = yaml_file(comments, documents, explicit_start=True)
    return [Artifact("k8s.yaml", content)]


# The registry: a new target is a function above and one line here.
RENDERERS = {"script": render_script, "compose": render_compose, "k8s": render_k8s, "systemd": render_systemd}
TARGETS = tuple(RENDERERS)
# Targets that run on one host (Kubernetes spans nodes with a LeaderWorkerSet).
SINGLE_HOST = ("script", "compose", "systemd")
