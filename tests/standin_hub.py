"""A stand-in Hugging Face Hub on 127.0.0.1, for tests that run the real `huggingface_hub` against it
(through HF_ENDPOINT) without reaching the network.

It serves one model repo made on the spot with the endpoints `huggingface_hub` calls for a download,
and the headers it reads (huggingface_hub 2.x, file_download.py and hf_api.py):

- `GET /api/models/{repo}[/revision/{rev}]?blobs=true`: the model info, `sha` (the commit) and
  `siblings` with `rfilename`, `size`, `blobId` and, for LFS files, `lfs: {size, sha256, pointerSize}`;
- `GET /api/models/{repo}/tree/{rev}[?recursive=true]`: the tree `snapshot_download` lists (hf_api.py
  `list_repo_tree`): `{type, path, oid, size, lfs: {oid, size, pointerSize}}` per file, folders as
  `{type: "directory", path, oid, size: 0}`;
- `HEAD|GET /{repo}/resolve/{rev}/{file}`: a regular file answers 200 with `ETag` (its git blob id),
  `X-Repo-Commit`, `Content-Length` and the bytes; an LFS file answers 302 with `Location` on another
  origin (the "CDN", so the client stops there and does not forward its token, as with the real
  hub's signed URLs), `X-Linked-Etag` (the sha256), `X-Linked-Size` and `X-Repo-Commit`;
- `HEAD|GET {cdn}/blobs/{sha256}`: the LFS bytes, with `Range: bytes=N-` or `bytes=N-M` (206 and
  `Content-Range`), as a CDN answers them.

A repo's hashes are computed once per file (a file's bytes never change; a new commit replaces
files: `Repo.commit_files`), so a request costs what it would on a real hub, not a re-hash of the repo.

Errors carry `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound) as the hub's do, so
`huggingface_hub` raises its typed errors. Knobs make failures on purpose: `rate` throttles every
body (bytes/s), `stall_after[file] = n` hangs a response after n bytes of that file (the connection
stays open and silent), for `stalls_left` responses; `ranges=False` ignores `Range` (200, the whole
body), as some mirrors do. Every body byte sent is counted per file, and the most bodies sent at once.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit


def git_blob_id(data: bytes) -> str:
    """The id git (and the hub's `blobId`, and a regular file's ETag) gives these bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass(frozen=True)
class RepoFile:
    data: bytes
    lfs: bool

    @cached_property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @cached_property
    def pointer(self) -> bytes:
        """The git LFS pointer file an LFS file is stored as in git (its blobId is this one's)."""
        return (
            f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {len(self.data)}\n"
        ).encode()

    @cached_property
    def blob_id(self) -> str:
        return git_blob_id(self.pointer if self.lfs else self.data)

    @property
    def etag(self) -> str:
        """What huggingface_hub names the blob in its cache: the sha256 for LFS, the git id otherwise."""
        return self.sha256 if self.lfs else self.blob_id


@dataclass
class Repo:
    repo_id: str
    files: dict[str, RepoFile]
    branch: str = "main"

    @property
    def commit(self) -> str:
        """The tree's id: from the files' cached blob ids, so cheap to compute on every request."""
        digest = hashlib.sha1()
        for path in sorted(self.files):
            digest.update(path.encode() + b"\0" + self.files[path].blob_id.encode())
        return digest.hexdigest()

    def commit_files(self, changes: Mapping[str, RepoFile]) -> str:
        """A new commit on the branch that replaces (or adds) these files; the others keep their
        blobs, as a commit that touches only config.json does on the hub. Returns the new commit."""
        self.files = {**self.files, **changes}
        return self.commit

    def size(self, prefix: str = "") -> int:
        return sum(len(f.data) for p, f in self.files.items() if p.startswith(prefix))


def _weights(seed: int, size: int) -> bytes:
    """Deterministic bytes that do not compress (a corrupted byte anywhere changes the hash)."""
    return random.Random(seed).randbytes(size)


def small_checkpoint(repo_id: str = "standin/tiny-m31", shard_bytes: int = 1 << 20) -> Repo:
    """A checkpoint shaped like the real one: config, tokenizer, a safetensors index naming its
    shards, the shards (LFS), and a dspark/ draft with its own index and shard."""
    shards = {f"model-0000{i}-of-00003.safetensors": _weights(i, shard_bytes + 1000 * i) for i in (1, 2, 3)}
    index = {
        "metadata": {"total_size": sum(len(d) for d in shards.values())},
        "weight_map": {f"layers.{i}.weight": name for i, name in enumerate(sorted(shards))},
    }
    draft = _weights(9, shard_bytes // 2)
    draft_index = {
        "metadata": {"total_size": len(draft)},
        "weight_map": {"draft.weight": "model.safetensors"},
    }
    files = {
        ".gitattributes": RepoFile(b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n", False),
        "config.json": RepoFile(json.dumps({"architectures": ["MiniMaxM3ForCausalLM"]}).encode(), False),
        "tokenizer.json": RepoFile(json.dumps({"model": {"vocab": {"a": 0}}}).encode() * 50, False),
        "model.safetensors.index.json": RepoFile(json.dumps(index, indent=2).encode(), False),
        **{name: RepoFile(data, True) for name, data in shards.items()},
        "dspark/config.json": RepoFile(b'{"architectures": ["DSparkDraft"]}', False),
        "dspark/model.safetensors.index.json": RepoFile(json.dumps(draft_index).encode(), False),
        "dspark/model.safetensors": RepoFile(draft, True),
    }
    return Repo(repo_id, files)


@dataclass
class Knobs:
    rate: float | None = None  # bytes per second for every body (each response); None: as fast as it goes
    ranges: bool = True  # False: Range is ignored, every GET answers 200 with the whole body
    gather: int = 0  # each body waits (up to stall_hold_s) until this many are being sent at once
    stall_after: dict[str, int] = field(default_factory=dict)  # file -> bytes sent before hanging
    stalls_left: int = 1_000_000  # how many responses may still hang
    stall_hold_s: float = 30.0  # how long a hung response stays open at most


class StandinHub:
    """The stand-in hub: `endpoint` for HF_ENDPOINT, `cdn` for LFS bytes; `bytes_sent` per file and
    `requests` (method, file, first byte asked) record what the client fetched."""

    def __init__(self, repo: Repo, host: str = "127.0.0.1", advertise: str | None = None) -> None:
        """`host`: where it listens; `advertise`: the address its URLs (endpoint, the CDN's
        redirects) name, for clients in containers that reach this host at another address."""
        self.repo = repo
        self.host = host
        self.advertise = advertise or host
        self.knobs = Knobs()
        self.bytes_sent: Counter[str] = Counter()
        self.requests: list[tuple[str, str, int]] = []
        self.authorization: list[tuple[str, str | None]] = []  # (server, Authorization header)
        self._lock = threading.Lock()
        self._sending = 0  # bodies being sent now
        self._open = 0  # bodies whose last bytes have not been handed to the socket yet
        self.most_sending = 0  # the most bodies sent at once since the last reset_counts
        self._closing = threading.Event()
        self._hub = self._serve("hub")
        self._cdn = self._serve("cdn")

    @property
    def endpoint(self) -> str:
        return f"http://{self.advertise}:{self._hub.server_address[1]}"

    @property
    def cdn(self) -> str:
        return f"http://{self.advertise}:{self._cdn.server_address[1]}"

    def reset_counts(self) -> None:
        """Start the counts afresh, once the bodies being sent have been counted: a client can have
        read a body's last bytes before the server's thread counts them."""
        self.wait_idle()
        with self._lock:
            self.bytes_sent.clear()
            self.requests.clear()
            self.authorization.clear()
            self.most_sending = 0

    def gets(self, path: str) -> list[int]:
        """The first byte of every GET of `path` (0: from the start; more: a resumed range), sorted:
        transfers run in parallel, so the order they arrive in is not the order they were asked in."""
        return sorted(start for method, p, start in self.requests if method == "GET" and p == path)

    def close(self) -> None:
        self._closing.set()
        for server in (self._hub, self._cdn):
            server.shutdown()
            server.server_close()

    def _serve(self, role: str) -> ThreadingHTTPServer:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out at once, as a real server's do

            def log_message(self, format: str, *args: object) -> None:  # quiet test output
                pass

            def do_HEAD(self) -> None:
                hub._route(self, role, head=True)

            def do_GET(self) -> None:
                hub._route(self, role, head=False)

        server = ThreadingHTTPServer((self.host, 0), Handler)
        server.daemon_threads = True
        serve = lambda: server.serve_forever(poll_interval=0.05)  # noqa: E731 (a quick shutdown)
        threading.Thread(target=serve, name=f"standin-{role}", daemon=True).start()
        return server

    # --- routing -----------------------------------------------------------------------------------
    def _route(self, h: BaseHTTPRequestHandler, role: str, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        with self._lock:
            self.authorization.append((role, h.headers.get("Authorization")))
        try:
            if role == "cdn":
                self._cdn_blob(h, path, head)
            elif path.startswith("/api/models/") and "/tree/" in path:
                self._tree(h, path[len("/api/models/") :], urlsplit(h.path).query)
            elif path.startswith("/api/models/"):
                self._model_info(h, path[len("/api/models/") :])
            elif "/resolve/" in path:
                self._resolve(h, path, head)
            else:
                self._error(h, 404, "RepoNotFound")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away (a killed pull, a timeout): nothing to answer

    def _model_info(self, h: BaseHTTPRequestHandler, rest: str) -> None:
        repo_id, _, revision = rest.partition("/revision/")
        if repo_id != self.repo.repo_id:
            return self._error(h, 404, "RepoNotFound")
        if revision and revision not in (self.repo.branch, self.repo.commit):
            return self._error(h, 404, "RevisionNotFound")
        siblings = []
        for name, f in sorted(self.repo.files.items()):
            entry: dict[str, object] = {"rfilename": name, "size": len(f.data), "blobId": f.blob_id}
            if f.lfs:
                entry["lfs"] = {"size": len(f.data), "sha256": f.sha256, "pointerSize": len(f.pointer)}
            siblings.append(entry)
        self._json(h, {"id": self.repo.repo_id, "sha": self.repo.commit, "siblings": siblings})
        return None

    def _tree(self, h: BaseHTTPRequestHandler, rest: str, query: str) -> None:
        repo_id, _, revision = rest.partition("/tree/")
        revision, _, folder = revision.partition("/")  # the client quotes a revision's own slashes
        if repo_id != self.repo.repo_id:
            return self._error(h, 404, "RepoNotFound")
        if revision not in (self.repo.branch, self.repo.commit):
            return self._error(h, 404, "RevisionNotFound")
        recursive = "recursive=true" in query.lower() or "recursive=1" in query
        prefix = f"{folder.strip('/')}/" if folder else ""
        entries: list[dict[str, object]] = []
        folders: set[str] = set()
        for name, f in sorted(self.repo.files.items()):
            if not name.startswith(prefix):
                continue
            inner = name[len(prefix) :]
            if "/" in inner:
                folders.add(prefix + inner.split("/", 1)[0])
                if not recursive:
                    continue
            entry: dict[str, object] = {"type": "file", "path": name, "oid": f.blob_id, "size": len(f.data)}
            if f.lfs:
                entry["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": len(f.pointer)}
            entries.append(entry)
        tree_id = lambda path: hashlib.sha1(path.encode()).hexdigest()  # noqa: E731 (stable, unchecked)
        entries += [{"type": "directory", "path": p, "oid": tree_id(p), "size": 0} for p in sorted(folders)]
        self._json(h, entries)
        return None

    def _json(self, h: BaseHTTPRequestHandler, payload: object) -> None:
        body = json.dumps(payload).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _resolve(self, h: BaseHTTPRequestHandler, path: str, head: bool) -> None:
        repo_id, _, rest = path.lstrip("/").partition("/resolve/")
        revision, _, name = rest.partition("/")
        if repo_id != self.repo.repo_id:
            return self._error(h, 404, "RepoNotFound")
        if revision not in (self.repo.branch, self.repo.commit):
            return self._error(h, 404, "RevisionNotFound")
        f = self.repo.files.get(name)
        if f is None:
            return self._error(h, 404, "EntryNotFound")
        common = {"X-Repo-Commit": self.repo.commit, "Accept-Ranges": "bytes"}
        if f.lfs:
            h.send_response(302)
            for key, value in {
                **common,
                "Location": f"{self.cdn}/blobs/{f.sha256}?file={name}",
                "ETag": f'"{f.blob_id}"',
                "X-Linked-Etag": f'"{f.sha256}"',
                "X-Linked-Size": str(len(f.data)),
                "Content-Length": "0",
            }.items():
                h.send_header(key, value)
            h.end_headers()
            return None
        self._body(h, name, f.data, head, {**common, "ETag": f'"{f.blob_id}"'})
        return None

    def _cdn_blob(self, h: BaseHTTPRequestHandler, path: str, head: bool) -> None:
        sha = path.rsplit("/", 1)[-1]
        found = [(n, f) for n, f in self.repo.files.items() if f.lfs and f.sha256 == sha]
        if not found:
            return self._error(h, 404, "EntryNotFound")
        name, f = found[0]
        self._body(h, name, f.data, head, {"ETag": f'"{sha}"', "Accept-Ranges": "bytes"})
        return None

    # --- bodies ------------------------------------------------------------------------------------
    def _body(
        self, h: BaseHTTPRequestHandler, name: str, data: bytes, head: bool, headers: dict[str, str]
    ) -> None:
        asked = _byte_range(h.headers.get("Range")) if self.knobs.ranges else None
        start, last = asked if asked else (0, None)
        with self._lock:
            self.requests.append(("HEAD" if head else "GET", name, start))
        if start >= len(data) and len(data) > 0:
            h.send_response(416)
            h.send_header("Content-Range", f"bytes */{len(data)}")
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        end = len(data) if last is None else min(last + 1, len(data))
        h.send_response(206 if asked else 200)
        for key, value in headers.items():
            h.send_header(key, value)
        if asked:
            h.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        h.send_header("Content-Length", str(end - start))
        h.end_headers()
        if not head:
            self._send(h, name, memoryview(data)[:end], start)

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Until no body is being sent: a killed client's response may still be counting bytes
        until the server notices the closed connection."""
        deadline = time.monotonic() + timeout
        while self._sending and time.monotonic() < deadline:
            time.sleep(0.01)

    def _send(self, h: BaseHTTPRequestHandler, name: str, data: memoryview, start: int) -> None:
        with self._lock:
            self._sending += 1
            self._open += 1
            self.most_sending = max(self.most_sending, self._open)
        deadline = time.monotonic() + self.knobs.stall_hold_s
        while self.most_sending < self.knobs.gather and time.monotonic() < deadline:
            time.sleep(0.01)  # a client that fetches one body at a time never gets past this
        closed = [False]

        def last_chunk() -> None:
            # A body stops counting as open before its last bytes leave: the client can start its
            # next request only after them, so most_sending never counts this one and that one.
            with self._lock:
                if not closed[0]:
                    closed[0] = True
                    self._open -= 1

        try:
            self._send_body(h, name, data, start, last_chunk)
        finally:
            last_chunk()
            with self._lock:
                self._sending -= 1

    def _send_body(
        self,
        h: BaseHTTPRequestHandler,
        name: str,
        data: memoryview,
        start: int,
        last_chunk: Callable[[], None],
    ) -> None:
        chunk = 256 * 1024  # what a file server writes at a time; the stall point is still exact
        stall_at = self._stall_point(name)
        position = start
        began = time.monotonic()
        while position < len(data):
            if stall_at is not None and position >= stall_at:
                # Hang: the connection stays open and silent, as a stuck CDN or a dead route does.
                # It sends nothing more, so wait_idle does not wait for it.
                with self._lock:
                    self._sending -= 1
                self._closing.wait(self.knobs.stall_hold_s)
                with self._lock:
                    self._sending += 1
                h.close_connection = True  # the body is short: this connection cannot serve another
                return
            end = min(len(data), position + chunk)
            if stall_at is not None and position < stall_at:
                end = min(end, stall_at)
            if end == len(data):
                last_chunk()
            h.wfile.write(data[position:end])
            with self._lock:
                self.bytes_sent[name] += end - position
            position = end
            if self.knobs.rate:
                ahead = (position - start) / self.knobs.rate - (time.monotonic() - began)
                if ahead > 0:
                    time.sleep(ahead)

    def _stall_point(self, name: str) -> int | None:
        with self._lock:
            if name in self.knobs.stall_after and self.knobs.stalls_left > 0:
                self.knobs.stalls_left -= 1
                return self.knobs.stall_after[name]
        return None

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str) -> None:
        body = json.dumps({"error": code}).encode()
        h.send_response(status)
        h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if h.command != "HEAD":  # a HEAD's body would be read as the next response on the connection
            h.wfile.write(body)


def _byte_range(header: str | None) -> tuple[int, int | None] | None:
    """(first, last or None) of `Range: bytes=N-` (what huggingface_hub sends to resume) or
    `bytes=N-M` (one part of a file); None for no Range or a form this server does not serve."""
    if not header or not header.startswith("bytes="):
        return None
    first, _, last = header[len("bytes=") :].partition("-")
    if not first.isdigit() or not (last.isdigit() or last == ""):
        return None
    return int(first), int(last) if last else None


@contextmanager
def standin_hub(repo: Repo | None = None) -> Iterator[StandinHub]:
    hub = StandinHub(repo or small_checkpoint())
    try:
        yield hub
    finally:
        hub.close()
