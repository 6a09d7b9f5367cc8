"""A local stand-in for the Hugging Face Hub, for tests and benchmarks running the real
``huggingface_hub`` client.

Written against huggingface_hub 2.4.0 (its HTTP client is ``httpx2``), from reading the installed
``_snapshot_download.py``, ``_tree_cache.py``, ``file_download.py``, ``hf_api.py`` (``model_info``,
``_iter_repo_tree_pages``), ``utils/_pagination.py``, ``utils/_http.py``, ``utils/_xet.py`` and
``constants.py``.

What ``snapshot_download(repo_id, revision=..., cache_dir=..., local_dir=..., allow_patterns=...,
ignore_patterns=...)`` asks of a model repo, and what this server answers:

* ``GET /api/models/{repo_id}/revision/{quote(revision, safe="")}``, only when ``revision`` is not
  already a 40-hex commit sha. The client needs ``sha`` (the resolved commit); ``id``, ``siblings``
  (``rfilename``; with ``?blobs=true`` also ``size``, ``blobId``, ``lfs``) and a few more are sent.
* ``GET /api/models/{repo_id}/tree/{commit}[/{path}]?recursive=true&expand=false``, only when
  ``<tree cache folder>/trees/<commit>.json`` is not on disk yet. A JSON list of
  ``{"type": "file", "oid": <git blob sha1>, "size": n, "path": p}`` (LFS files add
  ``"lfs": {"oid": <sha256>, "size": n, "pointerSize": m}``, their ``oid`` being the pointer blob's)
  and ``{"type": "directory", "oid": <git tree sha1>, "size": 0, "path": p}``. With
  ``announce_xet`` set, LFS files also carry a ``xetHash`` (as nearly every model file on the Hub
  does today), which the client keeps in ``trees/<commit>.json``; with ``hf_xet`` installed and
  Xet not disabled it would then download through Xet, which this server cannot serve (see
  :func:`share_blobs`), so clients keep ``HF_HUB_DISABLE_XET=1`` and fetch over HTTP.
  Paginated like the Hub: ``Link: <...&cursor=N>; rel="next"`` (``tree_page_size``).
* ``HEAD /{repo_id}/resolve/{quote(revision, safe="")}/{quote(filename)}`` per file (the client
  always passes the commit sha as revision here), sent with ``Accept-Encoding: identity`` and
  redirects not followed off-host. Needed headers: ``X-Repo-Commit`` (else ``FileMetadataError``),
  ``ETag`` (git blob sha1, quoted) and, for LFS files, ``X-Linked-Etag`` (quoted sha256, preferred
  over ``ETag``) and ``X-Linked-Size``; otherwise ``Content-Length`` gives the size. The normalised
  etag names the blob: ``blobs/<sha1>`` for regular files, ``blobs/<sha256>`` for LFS files. No
  ``X-Xet-Hash`` header unless ``announce_xet`` is set (then with ``X-Xet-Refresh-Route``; a
  client with Xet disabled takes the plain HTTP path all the same).
* ``GET`` on the same URL (no ``Range`` unless resuming; ``Range: bytes=a-b`` / ``a-`` / ``-n`` get
  a 206 with ``Content-Range``). The body size must match the HEAD size.
* Errors carry ``X-Error-Code`` the way the client maps them: ``RepoNotFound``,
  ``RevisionNotFound``, ``EntryNotFound`` (the latter with ``X-Repo-Commit``, which the client uses
  to record ``.no_exist/<commit>/<path>``).

Pointing the client at it: ``constants.ENDPOINT`` and ``constants.HUGGINGFACE_CO_URL_TEMPLATE``
are computed from ``HF_ENDPOINT`` when ``huggingface_hub`` is imported, and every caller reads
them as ``constants.X`` at call time. So a fresh process only needs ``HF_ENDPOINT`` in its
environment, and this process needs both attributes patched (the ``hub`` fixture does both).

Tests get a started server through the ``hub`` fixture of ``tests/hubserver.py``; benchmarks
start one themselves (``with HubServer() as hub:``) with :func:`client_env` for their clients.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import TracebackType
from typing import Any, cast
from urllib.parse import parse_qs, unquote, urlsplit

HUB_CLIENT_VERSION = "2.4.0"  # the huggingface_hub version this server was checked against
LFS_MIN_SIZE = 10 * 1024 * 1024  # the Hub refers files above 10 MB to LFS whatever their name
_LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n"
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob holding ``data``."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def xet_hash(data: bytes) -> str:
    """A stand-in for a file's Xet hash (64 lowercase hex digits, as the client checks).
    The real one is a Merkle hash of the file's content-defined chunks; nothing on the
    client's plain HTTP path or in its cache recomputes it."""
    return hashlib.sha256(b"xet\0" + data).hexdigest()


def share_blobs(cache_dir: Path) -> int:
    """Lay the cache ``cache_dir`` out as huggingface_hub >= 2.x leaves it after Xet
    downloads: every blob whose listing entry has a Xet hash moves into the cache-wide
    store (``blobs/<2 hex>/<xet hash>``, its ``.refs`` manifest, the store's marker),
    and the repo's ``blobs/<etag>`` becomes a relative link to it. Done by huggingface_hub's
    own ``publish_blob_to_shared_store``, the function its Xet download path calls.

    This server cannot serve the Xet path itself: the client's ``hf_xet`` fetches content
    from a CAS service (a reconstruction API, then xorbs of compressed chunks), not from
    ``/resolve/``. Returns how many blobs were shared."""
    from huggingface_hub.utils._shared_blobs import publish_blob_to_shared_store

    shared = 0
    for repo in sorted(cache_dir.glob("*--*")):
        for tree in sorted((repo / "trees").glob("*.json")):
            for entry in json.loads(tree.read_text())["files"].values():
                xet = entry.get("xet_hash")
                blob = repo / "blobs" / str(entry.get("lfs_sha256") or entry["blob_id"])
                if not xet or not blob.is_file() or blob.is_symlink():
                    continue
                size = entry.get("lfs_size") or entry["size"]
                assert publish_blob_to_shared_store(
                    blob_path=str(blob), xet_hash=xet, cache_dir=cache_dir, expected_size=size
                ), f"huggingface_hub did not share {blob}"
                shared += 1
    return shared


def _git_object_sha1(kind: bytes, body: bytes) -> str:
    return hashlib.sha1(kind + b" %d\0" % len(body) + body).hexdigest()


@dataclass(frozen=True)
class _File:
    path: str
    data: bytes
    oid: str  # git blob sha1: of the content, or of the LFS pointer
    sha256: str | None = None  # LFS files only
    pointer_size: int | None = None

    @property
    def lfs(self) -> bool:
        return self.sha256 is not None


@dataclass(frozen=True)
class _Commit:
    sha: str
    files: dict[str, _File]
    dirs: dict[str, str]  # folder path -> git tree sha1 (the root excluded)
    date: str


@dataclass
class _Repo:
    branches: dict[str, str] = field(default_factory=dict)
    commits: dict[str, _Commit] = field(default_factory=dict)


class _HubError(Exception):
    """An error answer: status, ``X-Error-Code`` (may be empty), message, extra headers."""

    def __init__(
        self, status: int, code: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = headers or {}


def _make_file(path: str, data: bytes, lfs: bool) -> _File:
    if not lfs:
        return _File(path, data, git_blob_sha1(data))
    sha256 = hashlib.sha256(data).hexdigest()
    pointer = _LFS_POINTER.format(sha256=sha256, size=len(data)).encode()
    return _File(path, data, git_blob_sha1(pointer), sha256, len(pointer))


def _git_trees(files: dict[str, _File]) -> tuple[str, dict[str, str]]:
    """The root tree sha1 and every folder's tree sha1, computed the way git does."""
    children: dict[str, dict[str, tuple[bool, str]]] = {"": {}}  # folder -> name -> (is_dir, oid)
    for path in files:
        parts = path.split("/")
        for depth in range(1, len(parts)):
            children.setdefault("/".join(parts[:depth]), {})
    dirs: dict[str, str] = {}

    def tree(folder: str) -> str:
        entries = dict(children[folder])
        prefix = f"{folder}/" if folder else ""
        for sub in children:
            if sub and sub.rpartition("/")[0] == folder:
                entries[sub.rpartition("/")[2]] = (True, tree(sub))
        for path, f in files.items():
            if path.rpartition("/")[0] == folder:
                entries[path[len(prefix) :]] = (False, f.oid)
        # git orders entries by name, a folder's name compared as if it ended with "/"
        order = sorted(entries, key=lambda n: n + "/" if entries[n][0] else n)
        body = b"".join(
            (b"40000 " if entries[n][0] else b"100644 ")
            + n.encode()
            + b"\0"
            + bytes.fromhex(entries[n][1])
            for n in order
        )
        oid = _git_object_sha1(b"tree", body)
        if folder:
            dirs[folder] = oid
        return oid

    return tree(""), dirs


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: HubServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as httpx2 pools connections
    timeout = 30  # an idle keep-alive connection does not hold its thread forever

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._serve(head=False)

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def _serve(self, head: bool) -> None:
        hub = cast(_Server, self.server).hub
        hub._record(self.command, self.path)
        if hub.failing == "hang":  # accepts, reads the request, never answers
            hub._released.wait()
            self.close_connection = True
            return
        if not head and hub._delays_download(self.path):
            hub._released.wait(hub.download_delay_s)
        try:
            if hub.failing in ("500", "503", "429"):
                raise _HubError(int(hub.failing), "", f"the test Hub answers {hub.failing}")
            status, headers, body = hub._respond(self.path, self.headers.get("Range"))
        except _HubError as e:
            body = json.dumps({"error": e.message}).encode()
            status = e.status
            headers = {"Content-Type": "application/json", "X-Error-Message": e.message}
            if e.code:
                headers["X-Error-Code"] = e.code
            headers.update(e.headers)
        self.send_response(status)
        headers.setdefault("Content-Length", str(len(body)))
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)


class _HubApi:
    """The Hub's API over the repos in memory: what each request is answered with.
    :class:`HubServer` adds the HTTP server, the repos' making and the request counts."""

    endpoint: str
    tree_page_size: int
    announce_xet: bool
    _lock: threading.Lock
    _repos: dict[str, _Repo]

    # -- routing ---------------------------------------------------------------------------

    def _respond(self, raw: str, range_header: str | None) -> tuple[int, dict[str, str], bytes]:
        url = urlsplit(raw)
        query = parse_qs(url.query)
        if url.path.startswith("/api/models/"):
            repo_id, rest = self._split_repo(url.path[len("/api/models/") :])
            parts = rest.split("/") if rest else []
            if not parts:
                return self._info(repo_id, "main", query)
            if parts[0] == "revision" and len(parts) == 2:
                return self._info(repo_id, unquote(parts[1]), query)
            if parts[0] == "tree" and len(parts) >= 2:
                folder = unquote("/".join(parts[2:])).strip("/")
                return self._tree(repo_id, unquote(parts[1]), folder, query, url.path)
            raise _HubError(404, "", f"Unknown API route {url.path}")
        repo_id, rest = self._split_repo(url.path[1:])
        parts = rest.split("/")
        if len(parts) >= 3 and parts[0] == "resolve":
            return self._resolve(
                repo_id, unquote(parts[1]), unquote("/".join(parts[2:])), range_header
            )
        raise _HubError(404, "", f"Unknown route {url.path}")

    def _split_repo(self, rest: str) -> tuple[str, str]:
        with self._lock:
            known = sorted(self._repos, key=len, reverse=True)
        for repo_id in known:
            if rest == repo_id or rest.startswith(repo_id + "/"):
                return repo_id, rest[len(repo_id) + 1 :]
        raise _HubError(404, "RepoNotFound", "Repository not found")

    def _commit(self, repo_id: str, revision: str) -> _Commit:
        with self._lock:
            repo = self._repos[repo_id]
            sha = repo.branches.get(revision, revision)
            commit = repo.commits.get(sha)
        if commit is None:
            raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return commit

    def _info(
        self, repo_id: str, revision: str, query: dict[str, list[str]]
    ) -> tuple[int, dict[str, str], bytes]:
        commit = self._commit(repo_id, revision)
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings: list[dict[str, Any]] = []
        for f in commit.files.values():
            sibling: dict[str, Any] = {"rfilename": f.path}
            if blobs:
                sibling.update(size=len(f.data), blobId=f.oid)
                if f.lfs:
                    sibling["lfs"] = {
                        "sha256": f.sha256,
                        "size": len(f.data),
                        "pointerSize": f.pointer_size,
                    }
            siblings.append(sibling)
        author = repo_id.split("/")[0] if "/" in repo_id else None
        info = {
            "_id": commit.sha[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": author,
            "sha": commit.sha,
            "lastModified": commit.date,
            "createdAt": commit.date,
            "private": False,
            "disabled": False,
            "gated": False,
            "downloads": 0,
            "likes": 0,
            "tags": [],
            "siblings": siblings,
            "spaces": [],
            "usedStorage": sum(len(f.data) for f in commit.files.values()),
        }
        return 200, {"Content-Type": "application/json"}, json.dumps(info).encode()

    def _tree(
        self,
        repo_id: str,
        revision: str,
        folder: str,
        query: dict[str, list[str]],
        path: str,
    ) -> tuple[int, dict[str, str], bytes]:
        commit = self._commit(repo_id, revision)
        if folder and folder not in commit.dirs:
            raise _HubError(404, "EntryNotFound", f"{folder} does not exist on {revision}")
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        prefix = f"{folder}/" if folder else ""

        def wanted(p: str) -> bool:
            return p.startswith(prefix) and (recursive or "/" not in p[len(prefix) :])

        entries: list[dict[str, Any]] = [
            {"type": "directory", "oid": oid, "size": 0, "path": d}
            for d, oid in commit.dirs.items()
            if wanted(d)
        ]
        for f in commit.files.values():
            if wanted(f.path):
                entry: dict[str, Any] = {"type": "file", "oid": f.oid, "size": len(f.data)}
                if f.lfs:
                    entry["lfs"] = {
                        "oid": f.sha256,
                        "size": len(f.data),
                        "pointerSize": f.pointer_size,
                    }
                    if self.announce_xet:
                        entry["xetHash"] = xet_hash(f.data)
                entry["path"] = f.path
                entries.append(entry)
        entries.sort(key=lambda e: str(e["path"]))
        cursor = int(query.get("cursor", ["0"])[0])
        end = cursor + max(1, self.tree_page_size)
        headers = {"Content-Type": "application/json"}
        if end < len(entries):
            more = f"recursive={str(recursive).lower()}&expand=false&cursor={end}"
            headers["Link"] = f'<{self.endpoint}{path}?{more}>; rel="next"'
        return 200, headers, json.dumps(entries[cursor:end]).encode()

    def _resolve(
        self, repo_id: str, revision: str, filename: str, range_header: str | None
    ) -> tuple[int, dict[str, str], bytes]:
        commit = self._commit(repo_id, revision)
        f = commit.files.get(filename)
        if f is None:
            raise _HubError(
                404, "EntryNotFound", f"{filename} does not exist", {"X-Repo-Commit": commit.sha}
            )
        size = len(f.data)
        headers = {
            "Content-Type": "application/octet-stream",
            "Accept-Ranges": "bytes",
            "ETag": f'"{f.oid}"',
            "X-Repo-Commit": commit.sha,
        }
        if f.lfs:
            headers["X-Linked-Etag"] = f'"{f.sha256}"'
            headers["X-Linked-Size"] = str(size)
            if self.announce_xet:
                headers["X-Xet-Hash"] = xet_hash(f.data)
                headers["X-Xet-Refresh-Route"] = f"/api/models/{repo_id}/xet-read-token/{revision}"
        match = _RANGE.fullmatch(range_header.strip()) if range_header else None
        if match is None or match.group(1) == match.group(2) == "":
            return 200, headers, f.data
        first, last = match.group(1), match.group(2)
        if first:
            start, stop = int(first), min(int(last) + 1 if last else size, size)
        else:
            start, stop = max(size - int(last), 0), size
        if start >= size or start >= stop:
            raise _HubError(
                416, "", "Requested range not satisfiable", {"Content-Range": f"bytes */{size}"}
            )
        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{size}"
        return 206, headers, f.data[start:stop]


class HubServer(_HubApi):
    """A Hub serving model repos from memory over plain HTTP on 127.0.0.1 (see the module doc)."""

    def __init__(self) -> None:
        self.endpoint = ""  # "http://127.0.0.1:PORT" once started
        self.requests: list[tuple[str, str]] = []  # (method, raw request path with query)
        self.tree_page_size = 1000  # entries per /tree page, as on the Hub
        self.announce_xet = False  # LFS files carry a Xet hash (listings, HEAD answers)
        # An outage: "hang" (every request accepted and never answered, until stop()),
        # or a status every request gets ("500", "503", "429"); None: answering.
        self.failing: str | None = None
        # Slow downloads (see slow_downloads): how long, and how many more.
        self.download_delay_s = 0.0
        self.delayed_downloads = 0
        self._released = threading.Event()  # lets hung or delayed requests go at stop()
        self._lock = threading.Lock()
        self._repos: dict[str, _Repo] = {}
        self._commits = 0
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- repos -----------------------------------------------------------------------------

    def add_repo(
        self,
        repo_id: str,
        files: dict[str, bytes],
        *,
        branch: str = "main",
        lfs_patterns: Sequence[str] = ("*.safetensors", "*.bin"),
        lfs_min_size: int = LFS_MIN_SIZE,
    ) -> str:
        """Commit ``files`` (the whole tree of the new commit) on ``branch``; return its sha.

        The parent is the branch's head, or ``main``'s for a new branch. Files whose path matches
        one of ``lfs_patterns`` (fnmatch on the full path) or of ``lfs_min_size`` bytes or more are
        stored in LFS.
        """
        built = {
            path: _make_file(
                path,
                data,
                len(data) >= lfs_min_size or any(fnmatch.fnmatch(path, p) for p in lfs_patterns),
            )
            for path, data in sorted(files.items())
        }
        tree, dirs = _git_trees(built)
        with self._lock:
            repo = self._repos.setdefault(repo_id, _Repo())
            parent = repo.branches.get(branch) or repo.branches.get("main")
            self._commits += 1
            when = 1_700_000_000 + self._commits
            ident = f"HubServer <hub@localhost> {when} +0000"
            body = f"tree {tree}\n" + (f"parent {parent}\n" if parent else "")
            body += f"author {ident}\ncommitter {ident}\n\ncommit {self._commits}\n"
            sha = _git_object_sha1(b"commit", body.encode())
            date = datetime.fromtimestamp(when, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.000Z")
            repo.commits[sha] = _Commit(sha, built, dirs, date)
            repo.branches[branch] = sha
        return sha

    # -- requests --------------------------------------------------------------------------

    def _record(self, method: str, path: str) -> None:
        with self._lock:
            self.requests.append((method, path))

    def file_requests(self) -> int:
        """How many requests (HEAD or GET) went to a ``/resolve/`` URL."""
        with self._lock:
            return sum(_is_file_url(path) for _, path in self.requests)

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()

    def slow_downloads(self, delay_s: float, times: int = 1) -> None:
        """The next ``times`` GETs of a file's content (a ``/resolve/`` URL; a HEAD is
        answered at once) wait ``delay_s`` before they are answered, as a CDN slow to
        start sending a large file."""
        with self._lock:
            self.download_delay_s, self.delayed_downloads = delay_s, times

    def _delays_download(self, path: str) -> bool:
        with self._lock:
            if self.delayed_downloads <= 0 or not _is_file_url(path):
                return False
            self.delayed_downloads -= 1
            return True

    def become(self, state: str) -> dict[str, str]:
        """Put the Hub in ``state`` as the next client finds it: ``up``, ``offline`` (the
        client's ``HF_HUB_OFFLINE``), ``hang``, ``500``/``503``/``429`` (see
        :attr:`failing`) or ``stopped`` (connections refused); the environment the
        client needs for it."""
        if state == "offline":
            return {"HF_HUB_OFFLINE": "1"}
        if state == "stopped":
            self.stop()
        elif state != "up":
            self.failing = state
        return {}

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> HubServer:
        if self._server is not None:
            return self
        self._released.clear()
        server = _Server(("127.0.0.1", 0), _Handler)
        server.hub = self
        self._server = server
        self.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        self._thread = threading.Thread(
            target=server.serve_forever, args=(0.05,), name="hubserver", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._released.set()
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.shutdown()
            server.server_close()
        if thread is not None:
            thread.join(timeout=10)

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _is_file_url(path: str) -> bool:
    """Whether a request's path (and query) is a file's URL: ``/resolve/``."""
    return "/resolve/" in urlsplit(path).path


def client_env(endpoint: str, home: Path) -> dict[str, str]:
    """The environment that points a fresh huggingface_hub client at ``endpoint``, with
    ``home`` as its private HF_HOME: plain HTTP (no Xet), no telemetry, no token."""
    return {
        "HF_ENDPOINT": endpoint,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
        "HF_HOME": str(home),
        "HF_HUB_CACHE": str(home / "hub"),
        "NO_PROXY": "127.0.0.1,localhost",
    }
