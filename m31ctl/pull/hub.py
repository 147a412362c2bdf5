"""The one module that talks to the hub, through huggingface_hub (the library vLLM downloads with, so
the cache it writes is the one vLLM reads). Imported lazily: the planning commands never load it.

What is used: `HfApi.model_info(files_metadata=True)` for the listing (sizes, LFS sha256, commit),
`get_hf_file_metadata` for a file's location (the same HEAD /resolve hf_hub_download makes), its
HTTP session and headers for plain-HTTP bytes of a byte range, `hf_hub_download` for Xet transfers,
and its `_create_symlink` to link a blob into the snapshot (what hf_hub_download does once the blob
is there, without the HEAD it makes first). Its errors become m31ctl's, with exit codes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlsplit

from m31ctl.errors import HostPreconditionError, InputError, M31Error
from m31ctl.pull.records import Listing, Location, RepoFile

if TYPE_CHECKING:
    from types import TracebackType

# The watchdog speaks first: a read waits this much longer than the stall timeout before it fails
# by itself, which then only ends a transfer the watchdog has already given up on.
READ_GRACE_S = 0.5  # the watchdog looks every 0.1 s


class TransientError(Exception):
    """A transfer failed in a way a retry may mend (timeout, reset, early close, 5xx)."""


class RangeIgnored(Exception):
    """The server answered a request for part of a file with the whole file (200, not 206): this
    file comes in one piece."""


class Writer(Protocol):
    """Where plain-HTTP bytes go: one range of the partial file (partial_file.PartWriter)."""

    def write(self, data: bytes) -> int: ...
    def restart(self) -> None: ...  # the server sent the whole file: its bytes go from offset 0


class Transport(Protocol):
    """The hub as a pull sees it; tests may stand in a fake for the watchdog's own tests."""

    xet_available: bool

    def listing(self, repo: str, revision: str) -> Listing: ...
    def locate(self, repo: str, commit: str, path: str) -> Location: ...
    def fetch_http(self, location: Location, sink: Writer, first: int, end: int | None) -> None: ...
    def fetch_xet(self, repo: str, commit: str, path: str, count: Callable[[int], None]) -> None: ...
    def abort_xet(self) -> None: ...
    def link(self, blob: Path, pointer: Path) -> None: ...


class HubTransport:
    """huggingface_hub against `endpoint` (HF_ENDPOINT; None: the library's default), with the token
    handed over in memory (None: the library's own lookup, HF_TOKEN or the stored login)."""

    def __init__(self, cache_dir: Path, endpoint: str | None, token: str | None, stall_timeout_s: float):
        self.cache_dir = cache_dir
        self.endpoint = endpoint.rstrip("/") if endpoint else None
        self.token = token
        self.stall_timeout_s = stall_timeout_s
        self.xet_available = _xet_available()
        self._level = logging.NOTSET

    def __enter__(self) -> HubTransport:
        logger = logging.getLogger("huggingface_hub")
        self._level = logger.level
        logger.setLevel(logging.ERROR)  # its retry warnings would repeat what the pull reports
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        logging.getLogger("huggingface_hub").setLevel(self._level)

    def listing(self, repo: str, revision: str) -> Listing:
        # lazy: huggingface_hub costs start-up and reads HF_ENDPOINT once, at import
        from huggingface_hub import HfApi

        with hub_errors(repo, revision, self.endpoint):
            info = HfApi(endpoint=self.endpoint, token=self.token).model_info(
                repo, revision=revision, files_metadata=True, timeout=self.stall_timeout_s
            )
        if not info.sha or info.siblings is None:
            raise HostPreconditionError(f"the hub's answer for {repo}@{revision} has no commit or file list")
        files = tuple(
            RepoFile(s.rfilename, int(s.size or 0), s.lfs.sha256 if s.lfs else None, s.blob_id)
            for s in info.siblings
        )
        return Listing(repo, revision, info.sha, files)

    def locate(self, repo: str, commit: str, path: str) -> Location:
        # lazy: huggingface_hub costs start-up and reads HF_ENDPOINT once, at import
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        url = hf_hub_url(repo, path, revision=commit, endpoint=self.endpoint)
        with hub_errors(repo, commit, self.endpoint, path):
            meta = get_hf_file_metadata(url, token=self.token, endpoint=self.endpoint, retry_on_errors=True)
        if meta.commit_hash != commit or not meta.etag:
            raise HostPreconditionError(
                f"{repo}/{path}: the hub answered for commit {meta.commit_hash}, not the pinned {commit}"
            )
        return Location(meta.location, meta.etag, meta.size, meta.xet_file_data is not None)

    def fetch_http(self, location: Location, sink: Writer, first: int, end: int | None) -> None:
        """Bytes [first, end) of the file (end None: to its end), over plain HTTP, into `sink`: one
        GET through huggingface_hub's session (its proxies, certificates, user agent, connection
        pool, which the pull's parallel transfers share) and its error mapping. Not its http_get:
        that one retries internally, resuming, up to five times after every chunk it receives, each
        retry waiting out a read timeout, so a stall would never reach the watchdog."""
        # lazy: huggingface_hub costs start-up and reads HF_ENDPOINT once, at import
        from huggingface_hub import get_session, hf_raise_for_status
        from huggingface_hub.utils._headers import build_hf_headers

        headers = build_hf_headers(token=self.token)
        if _origin(location.url) != _origin(self.endpoint or "https://huggingface.co"):
            headers.pop("authorization", None)  # a signed CDN URL: the token stays with the hub
        headers["Accept-Encoding"] = "identity"  # offsets count the file's bytes, not a compressed body
        if first or end is not None:
            headers["Range"] = f"bytes={first}-" + ("" if end is None else str(end - 1))
        received, expected = first, end if end is not None else location.size
        timeout = self.stall_timeout_s + READ_GRACE_S  # a stalled read ends its thread by itself
        stream = get_session().stream(
            "GET", location.url, headers=headers, timeout=timeout, follow_redirects=True
        )
        with _transfer_errors(), stream as response:
            hf_raise_for_status(response)
            if "Range" in headers and response.status_code == 200:  # the Range was ignored
                if end is not None:
                    raise RangeIgnored(location.url)
                sink.restart()  # one piece from the start: the whole file again
                received, expected = 0, location.size
            elif response.status_code == 206 and _range_start(response) != first:
                raise TransientError(
                    f"asked for bytes from {first}, the server sent {_range_start(response)}"
                )
            # Written as it arrives (not in huggingface_hub's 10 MiB chunks): the watchdog counts
            # every byte, and a stop keeps all that reached the disk.
            for chunk in response.iter_bytes():
                if expected is not None and received + len(chunk) > expected:
                    chunk = chunk[: max(expected - received, 0)]  # a server that sends past the range
                received += sink.write(chunk)
        if expected is not None and received != expected:
            raise TransientError(f"the connection closed at byte {received} of {expected}")

    def fetch_xet(self, repo: str, commit: str, path: str, count: Callable[[int], None]) -> None:
        """hf_hub_download through Xet (it writes the blob and the link); `count` hears its bytes."""
        self._download(repo, commit, path, _counting_bar(count))

    def abort_xet(self) -> None:
        """Stop a stalled Xet transfer (its thread cannot be killed otherwise)."""
        try:
            # lazy: huggingface_hub costs start-up and reads HF_ENDPOINT once, at import
            from huggingface_hub.utils._xet import abort_xet_session

            abort_xet_session()  # type: ignore[no-untyped-call]
        except (ImportError, AttributeError):
            pass

    def link(self, blob: Path, pointer: Path) -> None:
        """The snapshot's link to a blob that is in place, made as hf_hub_download makes it (a
        relative symlink; a copy where the file system has no symlinks)."""
        # lazy: huggingface_hub costs start-up and reads HF_ENDPOINT once, at import
        from huggingface_hub.file_download import _create_symlink

        try:
            pointer.parent.mkdir(parents=True, exist_ok=True)
            _create_symlink(str(blob), str(pointer), new_blob=False)
        except OSError as exc:
            raise HostPreconditionError(f"cannot link {pointer}: {exc.strerror or exc}") from None

    def _download(self, repo: str, commit: str, path: str, bar: Any) -> None:
        # lazy: huggingface_hub costs start-up and reads HF_ENDPOINT once, at import
        from huggingface_hub import hf_hub_download

        with hub_errors(repo, commit, self.endpoint, path), _transfer_errors():
            hf_hub_download(
                repo,
                path,
                revision=commit,
                cache_dir=self.cache_dir,
                endpoint=self.endpoint,
                token=self.token,
                tqdm_class=bar,
            )


def _xet_available() -> bool:
    """hf_xet installed and not switched off (HF_HUB_DISABLE_XET=1)."""
    try:
        # lazy: huggingface_hub costs start-up and reads HF_ENDPOINT once, at import
        from huggingface_hub.utils._runtime import is_xet_available
    except ImportError:
        return False
    return bool(is_xet_available())


def _range_start(response: Any) -> int | None:
    """The first byte of a 206's `Content-Range: bytes N-M/T`."""
    value = response.headers.get("Content-Range", "")
    first = value.removeprefix("bytes ").split("-", 1)[0]
    return int(first) if first.isdigit() else None


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


def _silent_bar() -> Any:
    """A tqdm class that draws nothing: the pull reports progress itself."""
    # lazy: huggingface_hub costs start-up and reads HF_ENDPOINT once, at import
    from huggingface_hub.utils.tqdm import tqdm

    class Silent(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]

    return Silent


def _counting_bar(count: Callable[[int], None]) -> Any:
    """A silent tqdm class that passes on the bytes a Xet transfer reports. Such a class has
    `update_transfer`, so the library's Xet reporter sends network bytes there and bytes written to
    disk to `update`: whichever total is ahead is what has moved."""
    base = _silent_bar()
    seen = {"disk": 0, "net": 0, "told": 0}

    def tell() -> None:
        moved = max(seen["disk"], seen["net"])
        if moved > seen["told"]:
            count(moved - seen["told"])
            seen["told"] = moved

    class Counting(base):  # type: ignore[misc,valid-type]
        def update(self, n: float | None = 1) -> bool | None:
            seen["disk"] += int(n or 0)
            tell()
            return None

        def update_transfer(self, n: int) -> None:
            seen["net"] += int(n)
            tell()

    return Counting


@contextmanager
def _transfer_errors() -> Iterator[None]:
    """Network failures, early closes and 5xx answers are worth a retry; everything else is not."""
    # lazy: huggingface_hub costs start-up and reads HF_ENDPOINT once, at import
    import httpx2
    from huggingface_hub.errors import HfHubHTTPError

    try:
        yield
    except httpx2.TransportError as exc:
        raise TransientError(f"{type(exc).__name__}: {exc}") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else 0
        if status == 429 or status >= 500:
            raise TransientError(f"HTTP {status}") from None
        raise
    except OSError as exc:
        if exc.errno is None:  # http_get's size check: the server closed before the end
            raise TransientError(str(exc).splitlines()[0]) from None
        raise HostPreconditionError(f"cannot write the download: {exc.strerror or exc}") from None


@contextmanager
def hub_errors(repo: str, revision: str, endpoint: str | None, path: str | None = None) -> Iterator[None]:
    """The hub's refusals as m31ctl errors: what is wrong, and what to do."""
    # lazy: huggingface_hub costs start-up and reads HF_ENDPOINT once, at import
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        OfflineModeIsEnabled,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo}/{path}" if path else repo
    hub = endpoint or "the Hugging Face hub"
    try:
        yield
    except M31Error:
        raise
    except GatedRepoError:
        raise HostPreconditionError(
            f"{repo} is gated: this token has no access", hint="accept its terms on the hub, export HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise InputError(
            f"{repo} is not on {hub} (or is private)",
            hint="check model.path (--set model.path=ORG/NAME) and export HF_TOKEN for a private repo",
        ) from None
    except RevisionNotFoundError:
        raise InputError(f"{repo} has no revision {revision}", hint="--revision BRANCH|TAG|COMMIT") from None
    except RemoteEntryNotFoundError:
        raise HostPreconditionError(f"{where} is listed by the hub but not served at {revision}") from None
    except OfflineModeIsEnabled:
        raise InputError("HF_HUB_OFFLINE is set: a pull needs the hub", hint="unset HF_HUB_OFFLINE") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else 0
        if status in (401, 403):
            raise HostPreconditionError(
                f"{hub} refused {where} (HTTP {status})", hint="export a valid HF_TOKEN"
            ) from None
        raise HostPreconditionError(f"{hub} answered HTTP {status} for {where}") from None
    except httpx2.TransportError as exc:
        raise HostPreconditionError(
            f"cannot reach {hub} for {where}: {type(exc).__name__}",
            hint="check the network, HF_ENDPOINT and proxy settings",
        ) from None
    except OSError as exc:
        # huggingface_hub reads its token and writes its cache under HF_HOME (by default
        # $XDG_CACHE_HOME/huggingface): a file there, or no permission, fails before any request.
        raise HostPreconditionError(
            f"huggingface_hub cannot use {exc.filename or 'its files'} for {where}: {exc.strerror or exc}",
            hint="point HF_HOME (or XDG_CACHE_HOME) at a directory this user can write",
        ) from None
