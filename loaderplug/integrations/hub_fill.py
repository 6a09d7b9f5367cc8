"""The mirror filled from what a worker already has: a local Hugging Face cache that holds
a commit the mirror lacks (a warm node, a cache baked into an image) is published to the
mirror, with no request to the Hub for a file.

A warm worker makes no download: transformers finds each file with
``try_to_load_from_cache`` and reads it where it is, so a mirror filled only after
downloads would never hear of it, and every other worker would keep downloading. So the
hook's lookups and its downloads answered from the local cache :func:`offer` the commit
they saw; a thread of its own then publishes it (:func:`fill`) while the worker goes on
loading: the lookup itself stays a lookup, as quick as stock's.

The publish is the mirror's usual sync (:func:`.hub_mirror.sync_snapshot`): blobs first,
each hashed against its name, the commit's file listing, the snapshot's links, the ref
last, under the mirror's sync mark: a worker killed midway leaves no half snapshot, and
the next one resumes. Only files the local cache holds are published, against the
commit's listing from the local cache (or, where the cache lacks one and the Hub can be
asked, one ``list_repo_tree`` request); with neither, nothing is published, said once.
A process that exits while a publish runs finishes it first (Ctrl-C leaves it, as any
sync).
"""

from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loaderplug.settings import from_env

from . import hub_commits, hub_mirror
from .hub_calls import cache_folder, mirror_for

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalCommit:
    """A commit a worker's local cache holds: the repo's cache folder, the mirror's folder
    for the repo, and the commit."""

    cache: Path
    mirror: Path
    commit: str


_offered: set[tuple[Path, str]] = set()
_pending: list[LocalCommit] = []
_busy = False  # the fill thread is publishing one
_cond = threading.Condition()
_worker: threading.Thread | None = None


def offer_from(options: dict[str, Any], found: Path | None) -> None:
    """Have the mirror filled from the local cache, in the background, with the commit a
    lookup found (``found``, a file of its snapshot) or the call's revision names in the
    cache. Never fails the call."""
    try:
        settings = from_env()
        mirror = mirror_for(options, settings)
        if mirror is None or not settings.sync:
            return
        cache = cache_folder(options)
        revision = hub_commits.revision(options)
        commit = (
            hub_commits.snapshot_commit(cache, found)
            if found
            else hub_mirror.resolve_commit(cache, revision)
        )
        if commit is not None:
            offer(LocalCommit(cache, mirror, commit))
    except Exception as exc:  # the call was answered: the mirror's fill is a bonus
        log.warning("loaderplug: the mirror will not be filled from the local cache: %s", exc)


def offer(commit: LocalCommit) -> None:
    """Publish ``commit`` to the mirror on the fill thread, once per process, unless the
    mirror holds it already. Returns at once."""
    global _worker
    with _cond:
        if (commit.mirror, commit.commit) in _offered:
            return
        _offered.add((commit.mirror, commit.commit))
        _pending.append(commit)
        _cond.notify_all()
        if _worker is None:
            _worker = threading.Thread(target=_fill_offered, name="loaderplug-fill", daemon=True)
            _worker.start()
            atexit.register(wait)


def wait() -> None:
    """Until every commit offered so far is published (or has failed)."""
    with _cond:
        while _pending or _busy:
            _cond.wait(0.1)  # timed: the waiting thread stays able to take Ctrl-C


def _fill_offered() -> None:
    global _busy
    while True:
        with _cond:
            while not _pending:
                _cond.wait()
            commit = _pending.pop(0)
            _busy = True
        try:
            fill(commit)
        except Exception as exc:
            log.warning(
                "loaderplug: the mirror %s was not filled from the local cache %s (commit %s): %s",
                commit.mirror,
                commit.cache,
                commit.commit,
                exc,
            )
        finally:
            with _cond:
                _busy = False
                _cond.notify_all()


def fill(commit: LocalCommit) -> bool:
    """Publish the files of ``commit`` the local cache holds that the mirror lacks; True
    if something was published."""
    settings = from_env()
    listing = hub_mirror.read_listing(commit.cache, commit.commit)
    if listing is None:
        listing = _listing_from_the_hub(commit)
        if listing is None:
            return False
    held = _held_locally(commit, listing)
    on_mirror = hub_mirror.read_listing(commit.mirror, commit.commit)
    if on_mirror is not None:
        have = hub_mirror.check_selection(commit.mirror, commit.commit, held, on_mirror)
        if not have.refused:
            return False  # the mirror holds all of it already
    ref = _ref_to_publish(commit)
    report = hub_mirror.sync_snapshot(
        commit.cache, commit.mirror, commit.commit, ref, set(held).intersection, settings
    )
    if report.ok:
        log.info(
            "loaderplug: filled the mirror %s with %d file(s) of commit %s from the local cache",
            commit.mirror,
            len(held),
            commit.commit,
        )
    else:
        log.warning("loaderplug: filling the mirror from the local cache: %s", report.summary())
    return report.ok


def _ref_to_publish(commit: LocalCommit) -> str:
    """A branch or tag of the local cache that names the commit and that the mirror has no
    ref of yet (a local ref may be older than the mirror's: it never replaces one); else
    the commit itself, which publishes no ref."""
    refs = commit.cache / "refs"
    for ref in sorted(refs.rglob("*")) if refs.is_dir() else []:
        name = ref.relative_to(refs).as_posix()
        if not ref.is_file() or (commit.mirror / "refs" / name).exists():
            continue
        if ref.read_text().strip() == commit.commit:
            return name
    return commit.commit


def _held_locally(commit: LocalCommit, listing: dict[str, hub_mirror.RepoFile]) -> list[str]:
    """The paths of the listing whose blob the local cache holds, at the listed size."""
    selection = hub_mirror.check_selection(commit.cache, commit.commit, sorted(listing), listing)
    return [f.path for f in selection.usable]


def _listing_from_the_hub(commit: LocalCommit) -> dict[str, hub_mirror.RepoFile] | None:
    """The commit's listing, kept in the local cache, where the Hub can give it now (one
    request, not for a file); None (said) where it cannot."""
    kind, repo_id = _repo_of(commit.cache)
    options = {"repo_id": repo_id, "repo_type": kind, "revision": commit.commit}
    raw, why = hub_commits.fetch_listing(commit.commit, options)
    if raw is not None:
        hub_mirror.write_listing(commit.cache, commit.commit, raw, fsync=False)
        listing = hub_mirror.read_listing(commit.cache, commit.commit)
        if listing is not None:
            return listing
        why = "the Hub's listing is not one huggingface_hub would keep"
    log.info(
        "loaderplug: the local cache %s holds commit %s but no file listing of it, and the "
        "Hub cannot give one (%s): the mirror is not filled from it",
        commit.cache,
        commit.commit,
        why,
    )
    return None


def _repo_of(cache: Path) -> tuple[str, str]:
    """The repo type and id of a cache folder (``models--org--name``: model, org/name)."""
    kind, *name = cache.name.split("--")
    return kind.removesuffix("s"), "/".join(name)
