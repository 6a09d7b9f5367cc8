"""Hub downloads served from a bucket (``LOADERPLUG_MIRROR=s3://bucket/prefix``).

The bucket is laid out as a volume mirror is (:mod:`loaderplug.integrations.hub.mirror`),
under ``<prefix>/hub/models--org--name/``: ``refs/<branch>``, ``trees/<commit>.json``
(the commit's complete listing) and ``blobs/<etag>``; a sync of a Hub cache or of a
volume mirror fills it (``loaderplug sync --from $HF_HOME/hub --to s3://bucket/prefix/hub``;
the snapshots' links are not needed: the listing says which blob each path is). A call
is served when the bucket holds every file it selects, at the listing's sizes: its blobs
copied by ranged GETs into the local cache (or ``local_dir``), each checked against the
hash that names it before it is published, then the snapshot's links and the ref, as a
download from the Hub leaves them. Anything less (no ref or listing, a blob missing or
of another size, a file not in the commit): the original downloads it, as without
loaderplug. Downloads are not written back to a bucket.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from loaderplug.integrations.hub import commits as hub_commits
from loaderplug.integrations.hub import mirror as hub_mirror
from loaderplug.integrations.hub.calls import Call, cache_folder, chooser
from loaderplug.integrations.upstream import huggingface_hub as seam
from loaderplug.jobs.object_copies import select_objects
from loaderplug.report import TransferReport
from loaderplug.settings import Settings, from_env
from loaderplug.storage.object_store import ObjectStore, store_for
from loaderplug.storage.object_urls import ObjectURL

log = logging.getLogger(__name__)


def repo_in_bucket(root: ObjectURL, options: dict[str, Any]) -> ObjectURL:
    """The repo's folder in the bucket: ``<prefix>/hub/models--org--name``."""
    name = seam.repo_folder_name()(
        repo_id=options["repo_id"], repo_type=hub_commits.repo_type(options)
    )
    return root.child(f"hub/{name}")


# How long an answer of bucket_holds stands (a yes for good).
HOLDS_TTL_S = 60.0
_held: dict[tuple[str, str, str], tuple[bool, float]] = {}


def bucket_holds(root: ObjectURL, repo_type: str, repo_id: str) -> bool:
    """Whether the bucket holds a ref of the repo, so that a Hub out of reach is no
    reason to wait. Asked once (one attempt: it runs before Hub requests); a yes kept
    for the process, a no (or a bucket out of reach) for HOLDS_TTL_S."""
    key = (str(root), repo_type, repo_id)
    known = _held.get(key)
    if known is not None and (known[0] or time.monotonic() - known[1] < HOLDS_TTL_S):
        return known[0]
    repo = repo_in_bucket(root, {"repo_id": repo_id, "repo_type": repo_type})
    try:
        store = store_for(repo, from_env().object_timeout_s)
        holds = bool(store.list(repo.key("refs"), retried=False))
    except OSError:
        holds = False
    _held[key] = (holds, time.monotonic())
    return holds


def commit_for(root: ObjectURL, call: Call, settings: Settings) -> str | None:
    """The commit the call uses, learned as for a volume mirror (the Hub's word where it
    answers, else the bucket's ref; a bucket out of reach is no ref); None where neither
    can say. ``RevisionNotFoundError`` where the Hub says the revision does not exist."""
    repo = repo_in_bucket(root, call.options)
    store = store_for(repo, settings.object_timeout_s)
    return hub_commits.pinned(
        call.options, None, settings, mirror_ref=lambda revision: _commit(store, repo, revision)
    )


def from_bucket(root: ObjectURL, call: Call, settings: Settings, commit: str) -> str | None:
    """Hydrate the call's files of ``commit`` from the bucket: the path the original
    would return, or None (said why) where the bucket cannot serve the whole call."""
    options = call.options
    repo = repo_in_bucket(root, options)
    store = store_for(repo, settings.object_timeout_s)
    selection, why = _selection(store, repo, call, commit)
    if selection is None:
        log.info("loaderplug: %s not served from %s: %s", options["repo_id"], repo, why)
        return None
    target, report = _hydrate(repo, options, selection, settings)
    if not report.ok:
        log.warning(
            "loaderplug: %s not served from %s: %s", options["repo_id"], repo, report.summary()
        )
        return None
    if options.get("local_dir") is not None:
        write_download_metadata = seam.write_download_metadata()
        for f in selection.usable:
            write_download_metadata(target, f.path, commit, f.blob)
        where = Path(os.path.realpath(target))
    else:
        where = target / "snapshots" / commit
        where.mkdir(parents=True, exist_ok=True)
        hub_commits.keep_local_ref(target, options, commit, fsync=settings.fsync)
    return str(where / call.file) if call.file is not None else str(where)


def _selection(
    store: ObjectStore, repo: ObjectURL, call: Call, commit: str
) -> tuple[hub_mirror.Selection | None, str]:
    """What the call selects of ``commit`` in the bucket, every file's blob there at the
    listing's size; or None and why not."""
    try:
        raw = store.get_bytes(repo.key(hub_mirror.listing_rel(commit)))
        listing, problem = hub_mirror.parse_listing(json.loads(raw))
    except FileNotFoundError:
        return None, f"it holds no listing of commit {commit}"
    except ValueError as exc:
        listing, problem = None, f"is malformed ({exc})"
    if listing is None:
        return None, f"its listing of commit {commit} {problem}"
    if call.file is not None and call.file not in listing:
        return None, f"{call.file} is not a file of commit {commit}"
    blobs = {info.rel: info.size for info in store.list(repo.key("blobs"))}
    selection = hub_mirror.Selection(commit, [], {})
    for path in chooser(call)(listing):
        entry = listing[path]
        if blobs.get(entry.blob) != entry.size:
            return None, f"{path}: its blob is not in the bucket at {entry.size} bytes"
        selection.use(entry, f"blobs/{entry.blob}")
    return selection, ""


def _commit(store: ObjectStore, repo: ObjectURL, revision: str) -> str | None:
    if hub_mirror.COMMIT.match(revision):
        return revision
    try:
        commit = store.get_bytes(repo.key(f"refs/{revision}")).decode().strip()
    except (OSError, UnicodeDecodeError) as exc:
        if not isinstance(exc, FileNotFoundError):  # out of reach: no ref, the Hub says
            log.info("loaderplug: the bucket's ref %s of %s: %s", revision, repo, exc)
        return None
    return commit if hub_mirror.COMMIT.match(commit) else None


def _hydrate(
    repo: ObjectURL, options: dict[str, Any], selection: hub_mirror.Selection, settings: Settings
) -> tuple[Path, TransferReport]:
    """Copy the selection and its listing into the call's cache folder or local_dir."""
    commit, usable = selection.commit, selection.usable
    listing = hub_mirror.listing_rel(commit)
    local_dir = options.get("local_dir")
    if local_dir is not None:
        target = Path(local_dir).expanduser().resolve()
        files = {f.path: f"blobs/{f.blob}" for f in usable}
        files[f"{seam.LOCAL_DIR_META}/{listing}"] = listing
        expect = hub_mirror.expectations({f.path: f for f in usable})
        links: dict[str, str] = {}
        lock_in = seam.LOCAL_DIR_META
    else:
        target = cache_folder(options)
        files = {f"blobs/{f.blob}": f"blobs/{f.blob}" for f in usable}
        files[listing] = listing
        expect = hub_mirror.expectations({f"blobs/{f.blob}": f for f in usable})
        links = {
            f"snapshots/{commit}/{f.path}": hub_mirror.link_target(f.path, f.blob) for f in usable
        }
        lock_in = ""
    report = select_objects(
        "hydrate", repo, target, files, links, settings, expect=expect, lock_in=lock_in
    )
    return target, report
