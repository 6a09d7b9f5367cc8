"""Copy jobs with a bucket as the mirror: a hydrate from ``s3://``, ``gs://`` or ``az://``,
and a sync to one.

A hydrate is an ordinary plan for the runner: the objects under the URL's prefix are
its files, read by ranged GETs through :class:`~loaderplug.storage.object_source.ObjectFiles`
(each at the version listed, ``If-Match`` on its ETag), published by rename under the
local folder's lock as any hydrate's. Where the bucket has a manifest (a sync wrote it
last), only the files it names are copied, each at the ETag it recorded: a sync under
way is never half read.

A sync uploads each file whole (parallel multipart parts above one part's size: the
object appears complete or not at all), under a mark object written only where none
is (``If-None-Match: *`` where the store honours it; read back, so a store that does
not is caught too), and writes the manifest last.
"""

from __future__ import annotations

import json
import os
import posixpath
import secrets
import threading
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from loaderplug.errors import MirrorError
from loaderplug.jobs.file_sink import temps_of
from loaderplug.jobs.locks import folder_lock
from loaderplug.jobs.model_folder import (
    MANIFEST_NAME,
    SYNC_MARK_NAME,
    is_own_name,
    path_problem,
    temp_files,
    walk,
)
from loaderplug.jobs.plan import Expect, FileEntry, Listing, Plan
from loaderplug.jobs.runner import run
from loaderplug.report import TransferReport
from loaderplug.settings import Settings
from loaderplug.storage.object_source import ObjectFiles, object_policy
from loaderplug.storage.object_store import ObjectInfo, ObjectStore, store_for
from loaderplug.storage.object_urls import ObjectURL, key_problem
from loaderplug.types import FileResult, Identity

MANIFEST_VERSION = 1
# Files a sync uploads at once (each in parallel parts: see storage.object_store).
FILES_IN_FLIGHT = 4


def object_hydrate_plan(url: ObjectURL, dst: Path, settings: Settings) -> Plan:
    """The plan copying every object under ``url`` to the same path under ``dst``."""
    objects = ObjectFiles(settings.object_timeout_s)
    return Plan(
        job="hydrate",
        source=str(url),
        destination=dst,
        list_files=lambda: _listing(objects, url, dst, settings),
        locks=(folder_lock(dst),),
        leftovers=lambda: temp_files(dst),
        open_source=objects,
        source_policy=object_policy(url),
    )


def _listing(objects: ObjectFiles, url: ObjectURL, dst: Path, settings: Settings) -> Listing:
    store = objects.store(url)
    manifest = read_manifest(store, url)
    if manifest is None:  # no versions to hold to: a first sync must end first
        _wait_for_a_first_sync(store, url, settings.sync_wait_s, settings.sync_stale_s)
        manifest = read_manifest(store, url)
    found, refused = objects.list(url)
    listing = Listing(refused=refused)
    by_rel = {info.rel: info for info in found if not _is_own(info.rel)}
    if not by_rel and manifest is None:
        raise FileNotFoundError(2, "no objects under this prefix", str(url))
    if manifest is not None:
        files, incomplete = manifest
        _keep_manifest_files(by_rel, files, listing)
        for rel, why in incomplete.items():
            by_rel.pop(rel, None)
            listing.refused[rel] = f"the sync that wrote the mirror could not copy it ({why})"
    for rel, info in sorted(by_rel.items()):
        listing.files.append(FileEntry(rel, str(url.child(rel)), info.identity(), dst / rel))
    parents = {posixpath.dirname(rel) for rel in by_rel}
    listing.dirs = sorted(_with_ancestors(p for p in parents if p))
    return listing


def _wait_for_a_first_sync(
    store: ObjectStore, url: ObjectURL, wait_s: float, stale_s: float
) -> None:
    """Wait while a sync's mark (not stale) is under ``url`` and no manifest is: the
    objects there are then half a model. A mark still there after ``wait_s`` fails the
    hydrate, saying so."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            mark = store.head(url.key(SYNC_MARK_NAME))
        except FileNotFoundError:
            return
        age_s = time.time() - mark.mtime_ns / 1e9
        if age_s >= stale_s:
            return  # a dead sync's: what it left is listed, and checked as it is read
        if time.monotonic() >= deadline:
            raise MirrorError(
                f"a sync is writing {url} and has written no manifest yet (its mark is "
                f"{age_s:.0f} s old); run again once it ends"
            )
        if read_manifest(store, url) is not None:
            return
        time.sleep(1.0)


def _keep_manifest_files(
    by_rel: dict[str, ObjectInfo], manifest: dict[str, dict[str, object]], listing: Listing
) -> None:
    """Narrow ``by_rel`` to the manifest's files at the versions it recorded."""
    for rel in list(by_rel):
        if rel not in manifest:
            del by_rel[rel]  # written after the manifest: the next sync's
    for rel, entry in manifest.items():
        info = by_rel.get(rel)
        if info is None:
            listing.refused[rel] = "listed in the mirror's manifest but missing in the bucket"
        elif (info.size, info.etag) != (entry.get("size"), entry.get("etag")):
            listing.refused[rel] = (
                f"changed since the mirror's manifest was written (size {info.size}, ETag "
                f"{info.etag}; the manifest says {entry.get('size')}, {entry.get('etag')}); "
                f"a sync may be under way: retry when it finishes"
            )
            del by_rel[rel]


def _with_ancestors(folders: Iterable[str]) -> set[str]:
    out: set[str] = set()
    for folder in folders:
        while folder:
            out.add(folder)
            folder = posixpath.dirname(folder)
    return out


def _is_own(rel: str) -> bool:
    return any(is_own_name(part) for part in rel.split("/"))


def read_manifest(
    store: ObjectStore, url: ObjectURL
) -> tuple[dict[str, dict[str, object]], dict[str, str]] | None:
    """The files the bucket's manifest names, and those its sync could not copy, with
    why (None: it has none)."""
    try:
        raw = store.get_bytes(url.key(MANIFEST_NAME))
    except FileNotFoundError:
        return None
    try:
        data = json.loads(raw)
        files, incomplete = data["files"], data.get("incomplete", {})
        if data.get("version") != MANIFEST_VERSION or not isinstance(files, dict):
            raise ValueError("unknown version")
        if not isinstance(incomplete, dict):
            raise ValueError("its incomplete files are not a mapping")
    except (ValueError, KeyError, TypeError) as exc:
        raise MirrorError(
            f"{url.child(MANIFEST_NAME)} cannot be read ({exc}); run a sync to rewrite it"
        ) from exc
    return files, {str(k): str(v) for k, v in incomplete.items()}


# -- sync ---------------------------------------------------------------------------


def sync_to_objects(local: Path, url: ObjectURL, settings: Settings) -> TransferReport:
    """Upload the model folder ``local`` under ``url``, the manifest last."""
    if not local.is_dir():
        raise MirrorError(f"sync source {local} is not a folder; check the path")
    started = time.monotonic()
    store = store_for(url, settings.object_timeout_s)
    tree = walk(local)
    with ObjectSyncMark(store, url, settings.sync_stale_s):
        with ThreadPoolExecutor(FILES_IN_FLIGHT, thread_name_prefix="loaderplug-upload") as pool:
            uploads = [
                pool.submit(_upload, store, url, local, rel, st)
                for rel, st in sorted(tree.files.items())
            ]
            results = [u.result() for u in uploads]
        results += [
            FileResult(rel, "failed", reason=why) for rel, why in sorted(tree.refused.items())
        ]
        _write_manifest(store, url, results, tree.symlinks)
    return TransferReport(
        job="sync",
        source=str(local),
        destination=str(url),
        readers=FILES_IN_FLIGHT,
        span_bytes=0,
        results=results,
        bytes_copied=sum(r.size for r in results if r.status == "restored"),
        seconds=time.monotonic() - started,
    )


def _upload(
    store: ObjectStore, url: ObjectURL, local: Path, rel: str, st: os.stat_result
) -> FileResult:
    path = local / rel
    try:
        store.put_file(url.key(rel), str(path))
        now = os.stat(path)
    except OSError as exc:
        return FileResult(rel, "failed", reason=exc.strerror or str(exc), errno=exc.errno)
    if not Identity.of(now).matches(Identity.of(st)):
        return FileResult(rel, "failed", reason="changed while being uploaded; sync again")
    return FileResult(rel, "restored", st.st_size)


def _write_manifest(
    store: ObjectStore, url: ObjectURL, results: list[FileResult], symlinks: dict[str, str]
) -> None:
    files: dict[str, dict[str, object]] = {}
    for result in results:
        if result.status == "restored":
            info = store.head(url.key(result.path))
            files[result.path] = {"size": info.size, "etag": info.etag}
    payload = {
        "version": MANIFEST_VERSION,
        "files": files,
        "symlinks": dict(sorted(symlinks.items())),
        "incomplete": {r.path: r.reason for r in results if r.status == "failed"},
    }
    store.put_bytes(url.key(MANIFEST_NAME), json.dumps(payload, indent=1).encode())


@dataclass
class ObjectSyncMark:
    """The bucket's mark that a sync writes under ``url``: written only where none is,
    and read back (a store that ignores ``If-None-Match`` lets the last writer win: the
    loser finds another's token). A mark older than ``stale_s`` is a dead sync's and
    is taken over."""

    store: ObjectStore
    url: ObjectURL
    stale_s: float

    def __post_init__(self) -> None:
        self.key = self.url.key(SYNC_MARK_NAME)
        self.token = secrets.token_hex(16)
        self._done = threading.Event()
        self._refresh = threading.Thread(
            target=self._keep_fresh, name="loaderplug-sync-mark", daemon=True
        )

    def _mark(self) -> bytes:
        return json.dumps({"token": self.token, "pid": os.getpid(), "at": time.time()}).encode()

    def __enter__(self) -> ObjectSyncMark:
        created = self.store.put_bytes(self.key, self._mark(), if_absent=True)
        # Not created: another's, or ours where a retried write had landed already.
        if not created and self._holder() != self.token:
            self._take_over_if_stale(self._mark())
        if self._holder() != self.token:
            raise MirrorError(f"another sync is writing {self.url}; run again once it ends")
        self._refresh.start()
        return self

    def _holder(self) -> object:
        return json.loads(self.store.get_bytes(self.key)).get("token")

    def _keep_fresh(self) -> None:
        """Rewrite the mark every quarter of ``stale_s`` while the sync runs: a long
        sync's mark never looks like a dead one's (another sync would take it over,
        a hydrate would read half a model)."""
        while not self._done.wait(max(1.0, self.stale_s / 4)):
            try:
                if self._holder() == self.token:
                    self.store.put_bytes(self.key, self._mark())
            except (OSError, ValueError):
                continue  # a store that fails once: the next round tries again

    def _take_over_if_stale(self, mark: bytes) -> None:
        info = self.store.head(self.key)
        age_s = time.time() - info.mtime_ns / 1e9
        if age_s < self.stale_s:
            raise MirrorError(
                f"another sync is writing {self.url} (its mark is {age_s:.0f} s old; "
                f"taken over after {self.stale_s:.0f} s); run again once it ends"
            )
        self.store.put_bytes(self.key, mark)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._done.set()
        if self._refresh.is_alive():
            # A refresh stuck on a store that stopped answering does not hold the sync's
            # end: the mark is deleted below only if it is still this sync's.
            self._refresh.join(timeout=self.stale_s)
        try:
            held = self._holder()
        except (OSError, ValueError):
            return
        if held == self.token:
            self.store.delete(self.key)


# -- chosen objects ---------------------------------------------------------------------


def select_objects(
    job: str,
    source: ObjectURL,
    dst: Path,
    files: dict[str, str],
    symlinks: dict[str, str],
    settings: Settings,
    *,
    expect: Expect | None = None,
    lock_in: str = "",
) -> TransferReport:
    """:func:`loaderplug.jobs.copies.select` with a bucket as the source: ``files`` maps
    each destination path to the key of its object under ``source`` (both relative)."""
    objects = ObjectFiles(settings.object_timeout_s)

    def list_files() -> Listing:
        chosen = Listing(symlinks=dict(symlinks))
        for rel, origin in sorted(files.items()):
            problem = path_problem(rel) or key_problem(origin)
            if problem:
                chosen.refused[rel] = problem
                continue
            try:
                info = objects.head(source.child(origin))
            except OSError as exc:
                chosen.refused[rel] = f"cannot read {origin} in the bucket: {exc.strerror or exc}"
                continue
            chosen.files.append(
                FileEntry(rel, str(source.child(origin)), info.identity(), dst / rel)
            )
        parents = {posixpath.dirname(r) for r in [*files, *symlinks]}
        chosen.dirs = sorted(_with_ancestors(p for p in parents if p))
        return chosen

    plan = Plan(
        job=job,
        source=str(source),
        destination=dst,
        list_files=list_files,
        locks=(folder_lock(dst / lock_in),),
        leftovers=lambda: [t for rel in files for t in temps_of(dst / rel)],
        expect=expect,
        open_source=objects,
        source_policy=object_policy(source),
    )
    return run(plan, settings)
