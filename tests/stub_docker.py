"""A stand-in `docker` that reads `docker run` as the Docker CLI and daemon do, for the options the
rendered script and unit use, and records the container it would create (JSON, one line a run).

The rules are the Docker CLI's and daemon's own, ported:
- `-p`: go-connections nat.ParsePortSpec (splitParts, an IP literal or [IPv6], numeric ports);
- `-v`: the daemon's linux volume spec parser (at most two colons; SRC:DST[:MODE]);
- `--mount`: docker/cli opts/mount.go (one record of Go's encoding/csv; key=value fields; a bind
  source must exist, the daemon says);
- `--env-file`: docker/cli opts/file.go parseKeyValueFile (values kept verbatim, quotes too);
- `-e NAME`: docker/cli opts/env.go ValidateEnv (the value from this environment, if set).

Environment: STUB_DOCKER_OUT (where records go), STUB_READY_AFTER (`exec` succeeds from that
call on; never when unset), STUB_DIR (the exec counter's directory).
"""

from __future__ import annotations

import ipaddress
import json
import os
import posixpath
import sys
from pathlib import Path

VALUED = {
    "--restart", "--name", "--label", "-l", "--gpus", "--device", "--group-add", "--cap-add",
    "--security-opt", "--ipc", "--shm-size", "--ulimit", "--log-driver", "--log-opt",
    "--stop-timeout", "--publish", "-p", "--volume", "-v", "--mount", "--env", "-e", "--env-file",
    "--entrypoint",
}  # fmt: skip
BOOLEAN = {"--detach", "-d", "--rm"}
_MODES = {"ro", "rw", "z", "Z", "shared", "rshared", "slave", "rslave", "private", "rprivate", "nocopy"}


class DockerError(Exception):
    pass


def parse_port(raw: str) -> dict[str, str]:
    parts = raw.split(":")
    if len(parts) == 1:
        ip, host, container = "", "", parts[0]
    elif len(parts) == 2:
        ip, host, container = "", parts[0], parts[1]
    elif len(parts) == 3:
        ip, host, container = parts
    else:
        ip, host, container = ":".join(parts[:-2]), parts[-2], parts[-1]
    if ip.startswith("["):
        if not ip.endswith("]"):
            raise DockerError(f"Invalid ip address {ip}: missing ']' in address")
        ip = ip[1:-1]
    if ip:
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise DockerError(f"Invalid ip address: {ip}") from None
    container = container.split("/", 1)[0]
    for port in (host, container):
        if port and not port.isdigit():
            raise DockerError(
                f"Invalid containerPort: {port}" if port == container else f"Invalid hostPort: {port}"
            )
    return {"ip": ip, "host_port": host, "container_port": container}


def parse_volume(raw: str) -> dict[str, object]:
    if raw.count(":") > 2 or raw.startswith(":"):
        raise DockerError(
            f"invalid spec: {raw}: too many colons" if raw.count(":") > 2 else f"invalid spec: {raw}"
        )
    arr = raw.split(":", 2)
    mode = ""
    if len(arr) == 1:
        source, target = "", arr[0]
    elif len(arr) == 2:
        if set(arr[1].split(",")) <= _MODES:
            raise DockerError(f"invalid spec: {raw}")
        source, target = arr
    else:
        source, target, mode = arr
    if mode and not set(mode.split(",")) <= _MODES:
        raise DockerError(f"invalid mode: {mode}")
    if not posixpath.isabs(target):
        raise DockerError(f"invalid mount config: invalid mount path: '{target}' mount path must be absolute")
    return {"type": "bind" if posixpath.isabs(source) else "volume", "source": source, "target": target,
            "readonly": "ro" in mode.split(",")}  # fmt: skip


def go_csv_record(text: str) -> list[str]:
    """encoding/csv Reader.Read (Comma ',', LazyQuotes false): the first record only."""
    fields: list[str] = []
    i, n = 0, len(text)
    while True:
        if i < n and text[i] == '"':
            value, i = [], i + 1
            while True:
                if i >= n:
                    raise DockerError('extraneous or missing " in quoted-field')
                if text[i] == '"':
                    if i + 1 < n and text[i + 1] == '"':
                        value.append('"')
                        i += 2
                        continue
                    i += 1
                    break
                value.append(text[i])
                i += 1
            if i < n and text[i] not in ",\n":
                raise DockerError('extraneous or missing " in quoted-field')
            fields.append("".join(value))
        else:
            end = i
            while end < n and text[end] not in ",\n":
                if text[end] == '"':
                    raise DockerError('bare " in non-quoted-field')
                end += 1
            fields.append(text[i:end].removesuffix("\r"))
            i = end
        if i >= n or text[i] == "\n":
            return fields
        i += 1  # the comma


def parse_mount(raw: str) -> dict[str, object]:
    mount: dict[str, object] = {"type": "", "source": "", "target": "", "readonly": False}
    for field in go_csv_record(raw):
        key, has_value, value = field.partition("=")
        key = key.lower()
        if not has_value:
            if key in ("readonly", "ro"):
                mount["readonly"] = True
                continue
            raise DockerError(f"invalid field '{field}' must be a key=value pair")
        if key == "type":
            mount["type"] = value.lower()
        elif key in ("source", "src"):
            mount["source"] = value
        elif key in ("target", "dst", "destination"):
            mount["target"] = value
        elif key in ("readonly", "ro"):
            if value.lower() not in ("1", "t", "true", "0", "f", "false"):
                raise DockerError(f"invalid value for {key}: {value}")
            mount["readonly"] = value.lower() in ("1", "t", "true")
        else:
            raise DockerError(f"unexpected key '{key}' in '{field}'")
    if not mount["type"]:
        raise DockerError("type is required")
    if not mount["target"]:
        raise DockerError("target is required")
    if not posixpath.isabs(str(mount["target"])):
        raise DockerError(f"invalid mount config: invalid mount path: '{mount['target']}' must be absolute")
    if mount["type"] == "bind" and not os.path.exists(str(mount["source"])):
        raise DockerError(
            f'invalid mount config for type "bind": bind source path does not exist: {mount["source"]}'
        )
    return mount


def parse_env_file(path: str) -> dict[str, str]:
    env: dict[str, str] = {}
    with open(path, "rb") as handle:
        data = handle.read()
    for number, raw in enumerate(data.split(b"\n"), start=1):
        raw = raw.removesuffix(b"\r")  # bufio.ScanLines drops a trailing \r
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DockerError(f"env file {path} contains invalid utf8 bytes at line {number}") from None
        if number == 1:
            text = text.removeprefix("\ufeff")
        line = text.lstrip()
        if not line or line.startswith("#"):
            continue
        variable, has_value, value = line.partition("=")
        variable = variable.lstrip(" \t")
        if any(c in variable for c in " \t"):
            raise DockerError(f"variable '{variable}' contains whitespaces")
        if not variable:
            raise DockerError(f"no variable name on line '{line}'")
        if has_value:
            env[variable] = value  # passed through: no trimming, quotes kept
        elif variable in os.environ:
            env[variable] = os.environ[variable]
    return env


def parse_run(argv: list[str]) -> dict[str, object]:
    record: dict[str, object] = {"ports": [], "mounts": [], "env": {}, "devices": [], "flags": []}
    env: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        name, has_inline, inline = argv[i].partition("=")
        if name in BOOLEAN:
            record["flags"].append(name)  # type: ignore[attr-defined]
            i += 1
            continue
        if name not in VALUED:
            raise DockerError(f"unknown flag: {name}")
        if has_inline:
            value, i = inline, i + 1
        else:
            if i + 1 >= len(argv):
                raise DockerError(f"flag needs an argument: {name}")
            value, i = argv[i + 1], i + 2
        if name in ("--publish", "-p"):
            record["ports"].append(parse_port(value))  # type: ignore[attr-defined]
        elif name in ("--volume", "-v"):
            record["mounts"].append(parse_volume(value))  # type: ignore[attr-defined]
        elif name == "--mount":
            record["mounts"].append(parse_mount(value))  # type: ignore[attr-defined]
        elif name == "--env-file":
            env.update(parse_env_file(value))
        elif name in ("--env", "-e"):
            key, has_value, val = value.partition("=")
            if has_value:
                env[key] = val
            elif key in os.environ:
                env[key] = os.environ[key]
        elif name == "--device":
            record["devices"].append(value)  # type: ignore[attr-defined]
        elif name == "--name":
            record["name"] = value
        elif name == "--entrypoint":
            record["entrypoint"] = value
    if i >= len(argv):
        raise DockerError('"docker run" requires at least 1 argument')
    record["env"] = env
    record["image"] = argv[i]
    record["command"] = argv[i + 1 :]
    return record


def main(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    if command == "container":
        return 1  # `container inspect`: no such container
    if command == "run":
        try:
            record = parse_run(argv[1:])
        except DockerError as exc:
            print(f"docker: {exc}.", file=sys.stderr)
            return 125
        with open(os.environ["STUB_DOCKER_OUT"], "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")
        return 0
    if command == "exec":
        counter = Path(os.environ.get("STUB_DIR", ".")) / "exec-count"
        calls = int(counter.read_text()) + 1 if counter.exists() else 1
        counter.write_text(str(calls))
        after = os.environ.get("STUB_READY_AFTER")
        return 0 if after is not None and calls >= int(after) else 1
    if command == "inspect":
        print("true")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
