"""Each target's artifacts from the Deployment: the shell script and systemd unit through the
templates in templates/, Compose and Kubernetes as data serialized to YAML."""

from __future__ import annotations

import shlex
import textwrap
from typing import Any, NamedTuple

from m31ctl.container import ContainerSpec, render_spec
from m31ctl.deployment import HF_CACHE_IN_CONTAINER, Deployment
from m31ctl.docker_run import Attachment, docker_run_argv, mount_spec, publish_spec
from m31ctl.engine.adapter import SERVE_COMMAND
from m31ctl.errors import InputError
from m31ctl.hardware import vendor_facts
from m31ctl.redact import API_KEY_ENV, HF_TOKEN_ENV
from m31ctl.render.artifact import Artifact as Artifact  # re-exported: files.py and render/ import it here
from m31ctl.render.common import engine_secrets, header, health_command, in_comment, render_template
from m31ctl.render.download import download_step
from m31ctl.render.escape import Interpolation, compose_escape, yaml_file
from m31ctl.render.k8s import k8s_comments, k8s_documents
from m31ctl.render.script_cache import at_run_time, script_cache

ENV_FILE = "/etc/m31ctl/minimax-m31-flash.env"
SERVED = "MiniMax-M3.1-Flash"  # what a unit's Description= names
# The one env-file format that the script (which takes a value verbatim, as docker's --env-file
# does) and systemd's EnvironmentFile= (the unit) read alike: NAME=value, a comment line, or a
# blank line. systemd strips quotes, reads backslash escapes and trims spaces. (A grep -E
# pattern: inside brackets a backslash is literal.)
ENV_FILE_LINE = r"""^(#.*|[A-Za-z_][A-Za-z0-9_]*=[^[:space:]"'\$]*)?$"""
ENV_FILE_FORMAT = "one NAME=value a line, no quotes, spaces, backslashes or $ in a value (# starts a comment)"
READY_POLL_S = 10
# The Hugging Face token as a file: huggingface_hub reads the token from HF_TOKEN_PATH when
# HF_TOKEN is unset (utils/_auth.py, constants.py), and an environment value is what `docker
# inspect` and `docker compose config` print. Compose mounts a secret at /run/secrets/<name>.
HF_TOKEN_FILE = "/etc/m31ctl/hf-token"  # on the host: the script's default (M31CTL_HF_TOKEN_FILE)
HF_TOKEN_PATH_ENV = "HF_TOKEN_PATH"
TOKEN_FILE_VAR = "M31CTL_HF_TOKEN_FILE"  # names the token file to the script and to Compose
COMPOSE_TOKEN_SECRET = "hf_token"
HF_TOKEN_IN_CONTAINER = f"/run/secrets/{COMPOSE_TOKEN_SECRET}"
# The API key as a file too (issue 53): vLLM reads its key from VLLM_API_KEY or --api-key only
# (vllm/envs.py; FrontendArgs.api_key), so a Compose container whose plan requires it starts
# through API_KEY_START, which exports the key from Compose's secret and execs the process's own
# entrypoint. `docker compose config` and `docker inspect` show the file's name, never the key.
API_KEY_FILE_VAR = "M31CTL_API_KEY_FILE"  # names the key file to Compose
COMPOSE_API_KEY_SECRET = "vllm_api_key"
API_KEY_IN_CONTAINER = f"/run/secrets/{COMPOSE_API_KEY_SECRET}"
# Fixed text: the file, the variable, the host variable naming the file and the command come as
# positional arguments, never spliced in. A missing, unreadable or empty file, or a directory (what
# a missing file was mounted as in issue 39's runs; this host's Docker refuses the mount instead),
# stops the container with one line: never a server without its key (vLLM serves unauthenticated
# when VLLM_API_KEY is empty).
API_KEY_START = """\
file=$1 var=$2 names=$3
shift 3
value=$(cat "$file" 2>/dev/null) || value=
if [ -z "$value" ]; then
  echo "m31ctl: $file is missing, unreadable or empty: the plan requires $var; export $names=PATH (a file holding the key) and run docker compose up again" >&2
  exit 1
fi
export "$var=$value"
exec "$@"
"""
# The one docker binary every line of the unit runs (ExecStart= needs an absolute path on older
# systemd; the readiness wait used to find `docker` on PATH, another binary where two are installed).
SYSTEMD_DOCKER = "/usr/bin/docker"


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


def download_argv(deployment: Deployment, spec: ContainerSpec, token_by_name: bool) -> list[str]:
    """Everything after `docker` for the checkpoint download before the engine (render/download.py),
    or [] for a local one: the engine image with the Hugging Face cache mounted and the step's
    environment (the engine's, less its GPU visibility and what only the engine reads), removed
    when done. `token_by_name`: pass HF_TOKEN by name (systemd, whose EnvironmentFile= set it); the
    script adds its own secret arguments instead."""
    step = download_step(deployment, spec.env)
    if step is None:
        return []
    command = step.command
    argv = ["run", "--rm", "--name", f"{spec.name}-download", "--entrypoint", command[0]]
    for mount in spec.mounts:
        if not mount.read_only:  # the cache; a local checkpoint has nothing to download
            argv += ["--mount", mount_spec(mount)]
    for key, value in step.env:
        argv += ["--env", f"{key}={value}"]
    if token_by_name:
        argv += ["--env", HF_TOKEN_ENV]  # by name: docker copies it from its own environment, if set
    return [*argv, spec.image, *command[1:]]


def engine_secret_env(spec: ContainerSpec) -> tuple[str, ...]:
    """The secrets the engine container of a Docker target gets (render/common.py engine_secrets:
    never HF_TOKEN, the rule every target follows)."""
    return engine_secrets(spec.secret_env)


def render_script(deployment: Deployment) -> list[Artifact]:
    spec = render_spec(deployment)
    argv = at_run_time(deployment, docker_run_argv(spec._replace(secret_env=()), "detached"))
    split = argv.index(spec.image)
    download = at_run_time(deployment, download_argv(deployment, spec, token_by_name=False))
    at = download.index(spec.image) if download else 0
    content = render_template(
        "script.sh.j2",
        header_comment=header(deployment, "script"),
        env_file=ENV_FILE,
        env_format=ENV_FILE_FORMAT,
        env_check=env_file_check('"$ENV_FILE"', "$ENV_FILE", 2),
        name=spec.name,
        secret_names=list(spec.secret_env),
        engine_secret_names=list(engine_secret_env(spec)),
        required_names=list(deployment.secrets.required),
        host_dirs=at_run_time(deployment, writable_sources(spec)),
        hf_cache=script_cache(deployment),
        token_file=HF_TOKEN_FILE,
        token_path_env=HF_TOKEN_PATH_ENV,
        token_in_container=HF_TOKEN_IN_CONTAINER,
        run_lines=paired(argv[:split]),
        engine_lines=paired(argv[split:]),
        download_lines=paired(download[:at]),
        download_command=download[at:],
        download_s=deployment.timeline.download_s,
        url=deployment.network.local_url,
        startup_timeout=spec.startup_timeout,
        load_s=deployment.timeline.load_s,
        health_argv=health_command(spec, "/v1/models"),
    )
    return [Artifact("m31ctl-run.sh", content, 0o755)]


def writable_sources(spec: ContainerSpec) -> list[str]:
    """Host directories to create before `docker run`: a bind mount (--mount, Compose's long
    syntax) does not create its source, as `-v` did (as root)."""
    return [m.source for m in spec.mounts if not m.read_only]


def paired(argv: list[str]) -> list[list[str]]:
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
    return readiness_wait_on(spec.name, health_command(spec, "/health"), spec.startup_timeout)


def readiness_wait_on(name: str, probe_argv: list[str], budget: int) -> str:
    """readiness_wait for any container of a unit (the P/D router): `probe_argv` run inside it."""
    probe = " ".join(shlex.quote(w) for w in probe_argv)
    quoted = shlex.quote(name)
    return (
        f"deadline=$(($(date +%s) + {budget}))\n"
        f"until {SYSTEMD_DOCKER} exec {quoted} {probe} >/dev/null 2>&1; do\n"
        f'  if [ -n "${{MAINPID:-}}" ] && ! kill -0 "$MAINPID" 2>/dev/null; then\n'
        f'    echo "m31ctl: {name} exited while loading; see journalctl -u {name}" >&2\n'
        f"    exit 1\n"
        f"  fi\n"
        f'  if [ "$(date +%s)" -ge "$deadline" ]; then\n'
        f'    echo "m31ctl: {name} not ready after {budget} s" >&2\n'
        f"    exit 1\n"
        f"  fi\n"
        f"  sleep {READY_POLL_S}\n"
        f"done"
    )


def render_systemd(deployment: Deployment) -> list[Artifact]:
    return [systemd_unit(deployment, render_spec(deployment))]


class UnitExtras(NamedTuple):
    """What a P/D role's unit adds to the aggregated one (render/pd_host.py)."""

    description: str = f"{SERVED} served by vLLM"
    # (comment, sh script) run as ExecStartPre before the download (the pair's network)
    pre_start: tuple[tuple[str, str], ...] = ()
    attachment: Attachment | None = None
    download: ContainerSpec | None = None  # the download's container, if not the engine's
    group: Deployment | None = None  # the plan the header names, if not the engine's own


def env_file_precheck() -> str:
    """The unit's first ExecStartPre: the env file, if present, in the format the script reads too."""
    return f"[ ! -e {shlex.quote(ENV_FILE)} ] || {{\n{env_file_check(shlex.quote(ENV_FILE), ENV_FILE, 1)}\n}}"


def service_spec(deployment: Deployment, spec: ContainerSpec) -> ContainerSpec:
    """A root unit on the server: the cache is a system path unless the plan names one."""
    return spec._replace(
        mounts=tuple(
            m._replace(source=deployment.service_hf_cache) if m.target == HF_CACHE_IN_CONTAINER else m
            for m in spec.mounts
        )
    )


def systemd_unit(deployment: Deployment, spec: ContainerSpec, extras: UnitExtras = UnitExtras()) -> Artifact:
    """One engine's unit: the aggregated server's, or a P/D role's (`extras`)."""
    spec = service_spec(deployment, spec)
    download = service_spec(deployment, extras.download) if extras.download is not None else spec
    unit = f"{spec.name}.service"
    run_spec = spec._replace(secret_env=engine_secret_env(spec))
    content = render_template(
        "systemd.service.j2",
        header_comment=header(extras.group or deployment, "systemd"),
        unit_name=unit,
        description=extras.description,
        plan_hash=deployment.plan.hash,
        env_file=ENV_FILE,
        env_format=ENV_FILE_FORMAT,
        env_check=env_file_precheck(),
        pre_start=list(extras.pre_start),
        name=spec.name,
        host_dirs=writable_sources(spec),
        run_argv=docker_run_argv(run_spec, "foreground", attachment=extras.attachment),
        download_argv=download_argv(deployment, download, token_by_name=True),
        download_s=deployment.timeline.download_s,
        ready_wait=readiness_wait(spec),
        docker=SYSTEMD_DOCKER,
        startup_timeout=spec.startup_timeout,
        start_timeout=deployment.timeline.systemd_start_s,
        stop_timeout=spec.stop_timeout,
        unit_stop_timeout=deployment.timeline.systemd_stop_s,
        required_names=list(deployment.secrets.required),
        engine_names=list(engine_secret_env(spec)),
    )
    return Artifact(unit, content)


def _compose_gpus(spec: ContainerSpec) -> dict[str, Any]:
    chosen: dict[str, Any] = (
        {"device_ids": list(spec.gpu_device_ids)} if spec.gpu_device_ids else {"count": spec.gpu_count}
    )
    runtime = vendor_facts(spec.vendor).gpu_runtime  # set: Compose asks for GPUs by device request only
    if runtime is None:
        return {}
    device = {"driver": runtime.name, **chosen, "capabilities": ["gpu"]}
    return {"resources": {"reservations": {"devices": [device]}}}


def api_key_entrypoint(variable: str, command: tuple[str, ...]) -> list[str]:
    """A Compose entrypoint that runs `command` (an entrypoint of its own) with `variable` set to
    the key in Compose's API-key secret (API_KEY_START); the service lists COMPOSE_API_KEY_SECRET."""
    start = ["/bin/sh", "-c", API_KEY_START, "m31ctl-api-key"]  # $0, then the positional arguments
    return [*start, API_KEY_IN_CONTAINER, variable, API_KEY_FILE_VAR, *command]


def _compose_environment(spec: ContainerSpec) -> list[str]:
    """The engine's environment: the plan's values only. Its one secret, the API key, comes as a
    file (compose_engine_service); HF_TOKEN never reaches an engine (engine_secret_env)."""
    unexpected = set(spec.secret_env) - {API_KEY_ENV}
    assert not unexpected, f"secrets a Compose engine would print in `docker compose config`: {unexpected}"
    return [f"{k}={v}" for k, v in spec.env]


def compose_volume(source: str, target: str, read_only: bool) -> dict[str, Any]:
    """The long syntax: the short one splits on every colon, so a path with one breaks it."""
    volume: dict[str, Any] = {"type": "bind", "source": source, "target": target}
    if read_only:
        volume["read_only"] = True
    return volume


def compose_engine_service(deployment: Deployment, spec: ContainerSpec) -> dict[str, Any]:
    """One engine's Compose service, raw (unescaped): the aggregated server, or a P/D role."""
    service: dict[str, Any] = {"image": spec.image, "container_name": spec.name}
    if API_KEY_ENV in spec.secret_env:  # the image's `vllm serve`, started with the key from the file
        service["entrypoint"] = api_key_entrypoint(API_KEY_ENV, SERVE_COMMAND)
        service["secrets"] = [COMPOSE_API_KEY_SECRET]
    service.update(
        command=list(spec.args),
        labels=dict(spec.labels),
        ports=[publish_spec(spec)],
        volumes=[compose_volume(m.source, m.target, m.read_only) for m in spec.mounts],
        environment=_compose_environment(spec),
    )
    if spec.ipc_host:
        service["ipc"] = "host"
    else:
        service["shm_size"] = spec.shm_size
    service["ulimits"] = {name: {"soft": soft, "hard": hard} for name, soft, hard in spec.ulimits}
    if spec.device_request:
        service["deploy"] = _compose_gpus(spec)
    if spec.devices:
        service["devices"] = list(spec.devices)
    if spec.group_add:
        service["group_add"] = list(spec.group_add)
    if spec.cap_add:
        service["cap_add"] = list(spec.cap_add)
    if spec.security_opt:
        service["security_opt"] = list(spec.security_opt)
    service["logging"] = {
        "driver": "json-file",
        "options": {"max-size": spec.log_max_size, "max-file": str(spec.log_max_files)},
    }
    service["restart"] = spec.restart
    service["stop_grace_period"] = f"{spec.stop_timeout}s"
    # The start period counts from the engine's start: the download ran before it.
    service["healthcheck"] = {
        "test": ["CMD", *health_command(spec, "/health")],
        "interval": "30s",
        "timeout": "10s",
        "retries": 3,
        "start_period": f"{spec.startup_timeout}s",
    }
    return service


def compose_document(deployment: Deployment) -> dict[str, Any]:
    """Built from raw values, then escaped as a whole (compose_escape): Compose interpolates `$`
    in every string, so only the Interpolations stay live."""
    spec = render_spec(deployment)
    engine_names = engine_secret_env(spec)
    service = compose_engine_service(deployment, spec._replace(secret_env=engine_names))
    document: dict[str, Any] = {"services": {"vllm": service}}
    download = compose_download(deployment, spec)
    if download is not None:
        document = {"services": {"download": token_from_file(download), "vllm": service}}
        # Compose 1.29+ and v2: the engine starts only once the download exited 0.
        service["depends_on"] = {"download": {"condition": "service_completed_successfully"}}
    secrets = compose_secrets(token=download is not None, api_key=API_KEY_ENV in engine_names)
    if secrets:
        document["secrets"] = secrets
    # No top-level `name`: Debian's docker-compose 1.29 refuses it; the project name comes from
    # the directory or `-p`, and the container is named by container_name either way.
    escaped: dict[str, Any] = compose_escape(document)
    return escaped


def compose_download(deployment: Deployment, spec: ContainerSpec) -> dict[str, Any] | None:
    """The checkpoint download as a one-shot service (render/download.py), as every target runs
    it before the engine; `restart: "no"`: a finished download stays finished. No container_name:
    Compose names it after the project (<project>_download_1 in 1.29, -download-1 in v2), so the
    `<name>-download` a killed script or unit run leaves behind cannot block it ("name in use")."""
    step = download_step(deployment, spec.env)
    if step is None:
        return None
    return {
        "image": spec.image,
        "entrypoint": [step.command[0]],
        "command": step.command[1:],
        "labels": dict(spec.labels),
        "volumes": [compose_volume(m.source, m.target, m.read_only) for m in spec.mounts if not m.read_only],
        # HF_TOKEN by name, from the environment of `docker compose` (token_from_file: a file instead).
        "environment": [*(f"{k}={v}" for k, v in step.env), HF_TOKEN_ENV],
        "restart": "no",
    }


def token_from_file(download: dict[str, Any]) -> dict[str, Any]:
    """The download service reading the Hugging Face token from Compose's secret (a file mounted
    at HF_TOKEN_IN_CONTAINER) instead of HF_TOKEN: `docker inspect` shows the path and `docker
    compose config` the host file's name, never the token. compose_token_secret() declares it."""
    environment = [e for e in download["environment"] if e != HF_TOKEN_ENV]
    return {
        **download,
        "environment": [*environment, f"{HF_TOKEN_PATH_ENV}={HF_TOKEN_IN_CONTAINER}"],
        "secrets": [COMPOSE_TOKEN_SECRET],
    }


def compose_token_secret() -> dict[str, Any]:
    """The top-level `secrets:` that token_from_file reads: the file M31CTL_HF_TOKEN_FILE names,
    else /dev/null, an empty token (huggingface_hub then sends none, as for a public checkpoint;
    a named file that is missing becomes a directory under docker-compose 1.29's bind mount)."""
    return {COMPOSE_TOKEN_SECRET: {"file": Interpolation(f"${{{TOKEN_FILE_VAR}:-/dev/null}}")}}


def compose_api_key_secret() -> dict[str, Any]:
    """The top-level `secrets:` entry api_key_entrypoint reads: the file M31CTL_API_KEY_FILE
    names. Required, so unset it fails closed: Compose refuses the file (no /dev/null default)."""
    message = f"the plan requires {API_KEY_ENV}: export {API_KEY_FILE_VAR}=PATH, a file holding the key"
    return {COMPOSE_API_KEY_SECRET: {"file": Interpolation(f"${{{API_KEY_FILE_VAR}:?{message}}}")}}


def compose_secrets(*, token: bool, api_key: bool) -> dict[str, Any]:
    """The top-level `secrets:` of a Compose file: the token for its download, the key for its
    engines (and a P/D router)."""
    return {**(compose_token_secret() if token else {}), **(compose_api_key_secret() if api_key else {})}


def compose_secret_notes(document: dict[str, Any]) -> list[str]:
    """What a Compose file's comments say of its secrets (the aggregated and the P/D file)."""
    secrets = document.get("secrets", {})
    return [
        f"Secrets: the API key is a file, never an environment value: export {API_KEY_FILE_VAR}=PATH (mode "
        f"600, the key alone) before `docker compose up`, which refuses the file without it. Compose mounts "
        f"it at {API_KEY_IN_CONTAINER}; the engine's start exports it as {API_KEY_ENV} and execs the "
        "image's `vllm serve` (a missing or empty file: the container exits at once, saying so), so "
        "`docker compose config` and `docker inspect` show the file's name, never the key."
        if COMPOSE_API_KEY_SECRET in secrets
        else "",
        f"The Hugging Face token is a file, never an environment value: export {TOKEN_FILE_VAR}=PATH "
        f"(mode 600) for a gated checkpoint; Compose mounts it at {HF_TOKEN_IN_CONTAINER} and "
        f"{HF_TOKEN_PATH_ENV} points the download at it (unset: /dev/null, no token)."
        if COMPOSE_TOKEN_SECRET in secrets
        else "",
    ]


def render_compose(deployment: Deployment) -> list[Artifact]:
    spec = render_spec(deployment)
    document = compose_document(deployment)
    notes = [
        *compose_secret_notes(document),
        "Liveness: Docker and Compose do not restart an unhealthy container (the healthcheck only marks "
        f"it unhealthy; restart: {spec.restart} acts on an exit, and an NCCL hang keeps the process "
        "alive): watch /health (m31ctl status, or your monitoring) and run `docker compose restart vllm`; "
        "the Kubernetes target's liveness probe does this by itself.",
    ]
    comments = [
        *header(deployment, "compose").splitlines(),
        *(f"# {line}" for note in notes if note for line in textwrap.wrap(note, 98, break_on_hyphens=False)),
        "# Create the cache directory first (a long-syntax bind mount does not): mkdir -p "
        + " ".join(in_comment(shlex.quote(d), "<runtime.hf_cache>") for d in writable_sources(spec)),
    ]
    content = yaml_file(comments, [document], explicit_start=False)
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


def render_monitoring(deployment: Deployment) -> list[Artifact]:
    """observability.py's target: scrape config, alert rules, dashboard."""
    # lazy: the monitoring files' module for --target monitoring alone (a render loads this registry)
    from m31ctl.render.observability import render_monitoring as monitoring

    return monitoring(deployment)


# The registry: a new target is a function above and one line here.
RENDERERS = {
    "script": render_script,
    "compose": render_compose,
    "k8s": render_k8s,
    "systemd": render_systemd,
    "monitoring": render_monitoring,  # observability.py: scrape config, alert rules, dashboard
}
TARGETS = tuple(RENDERERS)
# Targets that run on one host (Kubernetes spans nodes with a LeaderWorkerSet).
SINGLE_HOST = ("script", "compose", "systemd")
