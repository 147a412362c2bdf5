"""The one module that talks to the hub, through huggingface_hub (the library vLLM downloads with, so
the cache it writes is the one vLLM reads). Imported lazily: the planning commands never load it.

What is used: `HfApi.model_info(files_metadata=True)` for the listing (sizes, LFS sha256, commit),
`get_hf_file_metadata` for a file's location (the same HEAD /resolve hf_hub_download makes),
`file_download.http_get` for plain-HTTP bytes with a resume offset, and `hf_hub_download` for Xet
transfers and to link a blob into the snapshot. Its errors become m31ctl's, with exit codes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol
from urllib.parse import urlsplit

from m31ctl.errors import HostPreconditionError, InputError, M31Error
from m31ctl.pull.model import Listing, Location, RepoFile

if TYPE_CHECKING:
    from types import TracebackType

# Bytes per write during a plain-HTTP transfer. huggingface_hub reads 10 MiB per chunk and writes
# nothing until a chunk is full: on a slow link that is a long silence for the stall watchdog, and
# up to 10 MiB lost to an interruption. 1 MiB keeps progress fine-grained at ~1000 writes/s at 1 GB/s.
CHUNK_BYTES = 1 << 20


class TransientError(Exception):
    """A transfer failed in a way a retry may mend (timeout, reset, early close, 5xx)."""


class Transport(Protocol):
    """The hub as a pull sees it; tests may stand in a fake for the watchdog's own tests."""

    xet_available: bool

    def listing(self, repo: str, revision: str) -> Listing: ...
    def locate(self, repo: str, commit: str, path: str) -> Location: ...
    def fetch_http(self, location: Location, sink: BinaryIO, resume_from: int) -> None: ...
    def fetch_xet(self, repo: str, commit: str, path: str, count: Callable[[int], None]) -> None: ...
    def abort_xet(self) -> None: ...
    def link(self, repo: str, commit: str, path: str) -> None: ...


class HubTransport:
    """huggingface_hub against `endpoint` (HF_ENDPOINT; None: the library's default), with the token
    handed over in memory (None: the library's own lookup, HF_TOKEN or the stored login)."""

    def __init__(self, cache_dir: Path, endpoint: str | None, token: str | None, stall_timeout_s: float):
        self.cache_dir = cache_dir
        self.endpoint = endpoint.rstrip("/") if endpoint else None
        self.token = token
        self.stall_timeout_s = stall_timeout_s
        self.xet_available = _xet_available()
        self._saved: dict[str, Any] = {}

    # The library reads these module constants at call time: set for the pull, restored after.
    def __enter__(self) -> HubTransport:
        from huggingface_hub import constants

        self._saved = {
            "HF_HUB_DOWNLOAD_TIMEOUT": constants.HF_HUB_DOWNLOAD_TIMEOUT,
            "DOWNLOAD_CHUNK_SIZE": constants.DOWNLOAD_CHUNK_SIZE,
        }
        # A read that waits longer than the stall timeout fails inside the library, so a stalled
        # transfer ends by itself and the watchdog's retry starts on a clean connection.
        constants.HF_HUB_DOWNLOAD_TIMEOUT = self.stall_timeout_s  # type: ignore[assignment]
        constants.DOWNLOAD_CHUNK_SIZE = CHUNK_BYTES
        logger = logging.getLogger("huggingface_hub")
        self._saved["level"] = logger.level
        logger.setLevel(logging.ERROR)  # its retry warnings would repeat what the pull reports
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        from huggingface_hub import constants

        logging.getLogger("huggingface_hub").setLevel(self._saved.pop("level", logging.NOTSET))
        for name, saved in self._saved.items():
            setattr(constants, name, saved)

    def listing(self, repo: str, revision: str) -> Listing:
        from huggingface_hub import HfApi

        with _hub_errors(repo, revision, self.endpoint):
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
        from huggingface_hub import get_hf_file_metadata, hf_hub_url

        url = hf_hub_url(repo, path, revision=commit, endpoint=self.endpoint)
        with _hub_errors(repo, commit, self.endpoint, path):
            meta = get_hf_file_metadata(url, token=self.token, endpoint=self.endpoint, retry_on_errors=True)
        if meta.commit_hash != commit or not meta.etag:
            raise HostPreconditionError(
                f"{repo}/{path}: the hub answered for commit {meta.commit_hash}, not the pinned {commit}"
            )
        return Location(meta.location, meta.etag, meta.size, meta.xet_file_data is not None)

    def fetch_http(self, location: Location, sink: BinaryIO, resume_from: int) -> None:
        from huggingface_hub.file_download import http_get
        from huggingface_hub.utils._headers import build_hf_headers

        headers = build_hf_headers(token=self.token)
        if _origin(location.url) != _origin(self.endpoint or "https://huggingface.co"):
            headers.pop("authorization", None)  # a signed CDN URL: the token stays with the hub
        with _transfer_errors():
            # _nb_retries=0: the library's own retries would hide stalls from the watchdog.
            http_get(
                location.url,
                sink,
                resume_size=resume_from,
                headers=headers,
                expected_size=location.size,
                tqdm_class=_silent_bar(),
                _nb_retries=0,
            )

    def fetch_xet(self, repo: str, commit: str, path: str, count: Callable[[int], None]) -> None:
        """hf_hub_download through Xet (it writes the blob and the link); `count` hears its bytes."""
        self._download(repo, commit, path, _counting_bar(count))

    def abort_xet(self) -> None:
        """Stop a stalled Xet transfer (its thread cannot be killed otherwise)."""
        try:
            from huggingface_hub.utils._xet import abort_xet_session

            abort_xet_session()  # type: ignore[no-untyped-call]
        except (ImportError, AttributeError):
            pass

    def link(self, repo: str, commit: str, path: str) -> None:
        """The blob is in place: hf_hub_download finds it and only adds the snapshot's link."""
        self._download(repo, commit, path, _silent_bar())

    def _download(self, repo: str, commit: str, path: str, bar: Any) -> None:
        from huggingface_hub import hf_hub_download

        with _hub_errors(repo, commit, self.endpoint, path), _transfer_errors():
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
        from huggingface_hub.utils._runtime import is_xet_available
    except ImportError:
        return False
    return bool(is_xet_available())


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or "").lower(), parts.port


def _silent_bar() -> Any:
    """A tqdm class that draws nothing: the pull reports progress itself."""
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
def _hub_errors(repo: str, revision: str, endpoint: str | None, path: str | None = None) -> Iterator[None]:
    """The hub's refusals as m31ctl errors: what is wrong, and what to do."""
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
