"""What the native runtime keeps about its servers: one JSON record per server name in the state
directory (pid, the process's identity, plan, port, log), standing in for a container's labels.

Three rules keep the records honest:
- A pid is trusted only while its identity is confirmed: the boot, the kernel's start time and the
  command line recorded when m31ctl started it must all match the live process. A record missing
  any of them, or a process that cannot be read, is *unconfirmed*: never signalled, reported with
  the way to remove the record (`liveness`).
- Load, decide and save happen under a per-name lock (`claim`, fcntl), so concurrent launches of
  one name start one engine; each writer has its own temporary file, renamed into place
  (m31ctl/atomic.py: written whole, fsynced, renamed, the directory flushed).
- The directory is checked before anything starts: `claim` creates and locks in it and reserves
  the record's space on disk (posix_fallocate), so a full disk is one error line before an engine
  runs, and `save` writes into that reservation. A save that still fails removes its temporary
  file and raises: the caller stops what it started. The lock file goes when the claim ends, and
  so does an unused reservation: a failed launch leaves no file behind.

Test seam: every record's bytes are written by `_write_record(fd, data)`; tests replace it with a
write to /dev/full to meet a real ENOSPC from the kernel at the moment of saving, after the
reservation (a real full disk, a tmpfs, meets the reservation: tests/runtime/test_native_faults.py).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path

from m31ctl import atomic, interrupt
from m31ctl.errors import HostPreconditionError
from m31ctl.names import check_name, name_problem
from m31ctl.netaddr import local_url
from m31ctl.resources import state_root

# A record is a few kilobytes (the plan's settings); anything far larger is not ours.
MAX_RECORD_BYTES = 1 << 20
# What claim reserves for the record: it holds the plan's settings as JSON (5-10 KiB for the
# recipes here); a record larger than the reservation is still written, without the guarantee.
RECORD_RESERVE_BYTES = 64 * 1024


def state_dir() -> Path:
    return state_root() / "native"


class Liveness(Enum):
    RUNNING = "running"  # the process m31ctl started, confirmed
    GONE = "exited"  # no such process, or the pid now belongs to another process
    UNCONFIRMED = "unconfirmed"  # a live pid the record cannot prove is ours: never signalled


@dataclass(frozen=True)
class NativeServer:
    name: str
    pid: int
    plan_hash: str
    recipe: str
    variant: str
    profile: str
    bind: str
    port: int
    log: str
    argv: tuple[str, ...]
    started_at: float
    stop_timeout: int
    # Which process the pid meant when m31ctl started it ('BOOT:STARTTIME:CMDLINE-SHA256',
    # process_identity); None where /proc could not tell.
    identity: str | None = None
    # The plan it was launched with (runtime/planrecord.py, as JSON): verify re-resolves it.
    plan: str | None = None
    # A P/D group (issue 36): the group's record is its router's and names the role engines'
    # records in `parts`; each role engine's record names its group.
    parts: tuple[str, ...] = ()
    group: str | None = None
    # The host GPU indices it was pinned to (its vendor's visibility variable); () where it
    # took what it inherited (launch --blue-green places the next server beside them).
    gpus: tuple[str, ...] = ()

    @property
    def base(self) -> str:
        return local_url(self.bind, self.port)

    @property
    def path(self) -> Path:
        return record_path(self.name)

    def liveness(self) -> Liveness:
        if not _exists(self.pid):
            return Liveness.GONE
        now = process_identity(self.pid)
        if not _complete(self.identity) or now is None:
            return Liveness.UNCONFIRMED
        return Liveness.RUNNING if now == self.identity else Liveness.GONE

    def alive(self) -> bool:
        """Running and confirmed ours (what may be waited on, followed and signalled)."""
        return self.liveness() is Liveness.RUNNING

    def orphans(self) -> bool:
        """The server's process is gone but processes of its group still run: vLLM's engine core
        and its workers outlive an API server killed with SIGKILL, holding their memory (and on
        a GPU host the GPUs). The group is the server's: while a group has members its id stays
        allocated, so no other process can have been given the server's pid meanwhile."""
        return not _exists(self.pid) and group_runs(self.pid)


def _complete(identity: str | None) -> bool:
    return identity is not None and len(identity.split(":")) == 3 and all(identity.split(":"))


# A process fresh from exec shows an empty command line for a moment: the kernel closes the
# close-on-exec pipe that tells Popen the exec succeeded before it sets up the new argv.
_ARGV_SETTLE_S = 1.0


def process_identity(pid: int) -> str | None:
    """'BOOT_ID:STARTTIME:CMDLINE_SHA256' of a live process. The kernel's start time (clock ticks
    since boot, field 22 of /proc/PID/stat) is fixed for the life of a process and differs for a
    reused pid; the boot id tells boots apart; the command line tells a pid reused within one
    clock tick, or a record written by hand, from the process m31ctl started. None when /proc
    cannot tell (no /proc, a zombie, a kernel thread)."""
    deadline = time.monotonic() + _ARGV_SETTLE_S
    while True:
        try:
            boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) <= 19 or fields[0] == "Z":
            return None
        if cmdline:
            return f"{boot}:{fields[19]}:{hashlib.sha256(cmdline).hexdigest()}"
        if time.monotonic() >= deadline:
            return None  # a kernel thread: no command line to confirm
        time.sleep(0.005)


def _exists(pid: int) -> bool:
    """A process with this pid exists and is not a zombie (signal 0 sends nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def group_runs(pgid: int) -> bool:
    """A live (not zombie) process in the process group: a zombie (a leader waiting for its
    parent to reap it) runs nothing."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue  # gone meanwhile
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def record_path(name: str) -> Path:
    # Names are checked at plan time; checked again here because this one becomes a file path.
    return state_dir() / f"{check_name(name, 'server name')}.json"


def load(name: str) -> NativeServer | None:
    """The recorded server, or None (a missing, unreadable or malformed record records nothing)."""
    try:
        with record_path(name).open("rb") as handle:
            data = json.loads(handle.read(MAX_RECORD_BYTES + 1)[:MAX_RECORD_BYTES])
        data["argv"] = tuple(data["argv"])
        data["parts"] = tuple(data.get("parts", ()))
        data["gpus"] = tuple(str(g) for g in data.get("gpus", ()))
        server = NativeServer(**data)
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        return None
    return server if isinstance(server.pid, int) and server.pid > 0 else None


def recorded() -> list[NativeServer]:
    directory = state_dir()
    if not directory.is_dir():
        return []
    found = [load(p.stem) for p in sorted(directory.glob("*.json")) if name_problem(p.stem) is None]
    return [s for s in found if s is not None]


def _state_error(exc: OSError, directory: Path) -> HostPreconditionError:
    why = exc.strerror or str(exc)
    if exc.errno in (errno.EEXIST, errno.ENOTDIR):
        why = "it is not a directory"
    return HostPreconditionError(
        f"cannot keep native server state in {directory}: {why}",
        hint="point M31CTL_STATE_DIR (or XDG_STATE_HOME) at a writable directory, or free space there",
    )


# The record reservations of the claims this process holds, by server name (save writes into
# its name's reservation). Claims of one name in one process are serialised by the flock.
_RESERVED: dict[str, atomic.Slot] = {}
_RESERVED_LOCK = threading.Lock()


@contextlib.contextmanager
def claim(name: str) -> Iterator[None]:
    """Hold the per-name lock for a load-decide-save: a second launch of the name waits here until
    the first has recorded what it started, then finds it. Creating the directory and the lock
    file and reserving the record's space is also the check that the state directory can hold
    the record, before anything starts. When the claim ends the lock file is removed (a waiter
    that then gets the lock on the removed file sees it and takes the lock anew) and so is an
    unused reservation."""
    directory = state_dir()
    lock = directory / f"{check_name(name, 'server name')}.lock"
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _state_error(exc, directory) from None
    fd = _lock(lock, directory)
    try:
        with _reservation(name, directory):
            yield
    finally:
        lock.unlink(missing_ok=True)  # under the lock: nobody else holds it now
        os.close(fd)  # releases the lock


def _lock(path: Path, directory: Path) -> int:
    """An exclusive flock on `path`, as the file that path names now: a lock taken on a file that
    its holder removed meanwhile locks nothing anyone else will look at, so it is taken again."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise _state_error(exc, directory) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return fd
        except FileNotFoundError:
            pass  # removed by the holder we waited for
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


@contextlib.contextmanager
def _reservation(name: str, directory: Path) -> Iterator[None]:
    try:
        reserved = atomic.reserve(record_path(name), RECORD_RESERVE_BYTES)
        slot = reserved.__enter__()
    except OSError as exc:
        raise _state_error(exc, directory) from None
    with _RESERVED_LOCK:
        _RESERVED[name] = slot
    try:
        yield
    finally:
        with _RESERVED_LOCK:
            _RESERVED.pop(name, None)
        reserved.__exit__(None, None, None)


def _write_record(fd: int, data: bytes) -> None:
    """The one write of a record's bytes (the test seam for a full disk, see the module's doc)."""
    atomic.write_all(fd, data)


def save(server: NativeServer) -> None:
    """Write the record atomically (m31ctl/atomic.py), into the space the name's claim reserved
    when there is one. On any failure the temporary file is removed and the error raised (a
    HostPreconditionError naming the directory for an OSError)."""
    directory = state_dir()
    data = (
        json.dumps(
            {
                **asdict(server),
                "argv": list(server.argv),
                "parts": list(server.parts),
                "gpus": list(server.gpus),
            },
            indent=1,
            sort_keys=True,
        )
        + "\n"
    )
    with _RESERVED_LOCK:
        slot = _RESERVED.pop(server.name, None)
    try:
        if slot is not None:
            slot.commit(data.encode(), lambda fd, payload: _write_record(fd, payload))
        else:
            atomic.write_atomic(server.path, data, 0o600, lambda fd, payload: _write_record(fd, payload))
    except OSError as exc:
        raise _state_error(exc, directory) from None


def forget(server: NativeServer) -> None:
    server.path.unlink(missing_ok=True)


def follow_logs(server: NativeServer, logs: list[tuple[str, str]], write: Callable[[str], None]) -> None:
    """`tail -f` of `logs` while the server lives, from their ends: what each adds, under a
    `==> label <==` header whenever the writer changes (as tail -f of several files does)."""
    with contextlib.ExitStack() as files:
        opened = [(label, files.enter_context(open(path, "rb"))) for label, path in logs]
        for _, log in opened:
            log.seek(0, os.SEEK_END)
        last = ""
        while server.alive():
            wrote = False
            for label, log in opened:
                chunk = log.read()
                if chunk:
                    if label and label != last:
                        write(f"==> {label} <==\n")
                    last, wrote = label, True
                    write(chunk.decode("utf-8", "replace"))
            if not wrote:
                interrupt.sleep(0.3)  # Ctrl-C ends the follow here
