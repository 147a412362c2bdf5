"""The rehearsal's one seam to the Docker Engine: the `docker` CLI, run as a subprocess.

The CLI rather than the SDK: the SDK stays in m31ctl/runtime/engine_api.py (tests/test_architecture
.py), and the rehearsal needs `docker build` and `docker exec` with a timeout, which the CLI gives
plainly. Everything created carries the session's label, so cleanup finds it all by label, even
what a Ctrl-C left half made. Secrets reach a container as `-e NAME` with the value in this
subprocess's environment only: never in argv.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from m31ctl.errors import DockerUnreachable

SESSION_LABEL = "io.m31ctl.rehearsal"


class Done(NamedTuple):
    code: int
    out: str
    err: str

    @property
    def ok(self) -> bool:
        return self.code == 0


class DockerCLI:
    def __init__(self, binary: str = "docker") -> None:
        self.binary = binary

    def run(
        self,
        args: Sequence[str],
        *,
        secrets: Mapping[str, str] | None = None,
        timeout: float = 120.0,
        stdin: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> Done:
        full_env = {**os.environ, **(env or {}), **(secrets or {})}
        try:
            done = subprocess.run(
                [self.binary, *args],
                input=stdin,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=full_env,
                check=False,
            )
        except FileNotFoundError:
            raise DockerUnreachable("the docker CLI is not installed", hint="install Docker") from None
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            return Done(124, out, f"docker {args[0]} timed out after {timeout:g} s")
        return Done(done.returncode, done.stdout, done.stderr)

    def reachable(self) -> None:
        done = self.run(["version", "--format", "{{.Server.Version}}"], timeout=20)
        if not done.ok:
            raise DockerUnreachable(
                f"the Docker Engine cannot be reached: {done.err.strip()[-300:]}",
                hint="start Docker, or check DOCKER_HOST",
            )

    def image_exists(self, image: str) -> bool:
        return self.run(["image", "inspect", image], timeout=30).ok

    def build(self, tag: str, dockerfile: str, timeout: float = 600) -> Done:
        # The classic builder: BuildKit needs buildx, which a plain Docker Engine may lack.
        return self.run(
            ["build", "--force-rm", "-q", "-t", tag, "-"],
            stdin=dockerfile,
            timeout=timeout,
            env={"DOCKER_BUILDKIT": "0"},
        )

    def logs(self, container: str, tail: int | None = None) -> str:
        args = ["logs", "--timestamps"] + (["--tail", str(tail)] if tail else []) + [container]
        done = self.run(args, timeout=60)
        return done.out + done.err

    def state(self, container: str) -> tuple[str, int, str]:
        """(status, exit code, IP on its network): status '' when the container is gone."""
        fmt = "{{.State.Status}} {{.State.ExitCode}} {{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}"
        done = self.run(["inspect", "-f", fmt, container], timeout=30)
        if not done.ok:
            return "", -1, ""
        status, code, *ip = done.out.split()
        return status, int(code), ip[0] if ip else ""

    def exec(self, container: str, command: Sequence[str], timeout: float) -> Done:
        return self.run(["exec", container, *command], timeout=timeout)

    def remove_session(self, session: str) -> list[str]:
        """Remove every container, network and volume carrying the session's label; what could
        not be removed, as messages (empty when all is gone)."""
        problems = []
        label = f"label={SESSION_LABEL}={session}"
        for kind, listing, removal in (
            ("container", ["ps", "-aq", "--filter", label], ["rm", "-f", "-v"]),
            ("network", ["network", "ls", "-q", "--filter", label], ["network", "rm"]),
            ("volume", ["volume", "ls", "-q", "--filter", label], ["volume", "rm", "-f"]),
        ):
            ids = self.run(listing, timeout=60).out.split()
            if ids:
                done = self.run([*removal, *ids], timeout=120)
                if not done.ok:
                    problems.append(f"{kind}s {' '.join(ids)}: {done.err.strip()[-300:]}")
        return problems

    def leftovers(self, session: str) -> list[str]:
        label = f"label={SESSION_LABEL}={session}"
        found = []
        for listing in (["ps", "-aq"], ["network", "ls", "-q"], ["volume", "ls", "-q"]):
            found += self.run([*listing, "--filter", label], timeout=60).out.split()
        return found
