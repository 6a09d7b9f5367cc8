"""The mirror filled from what a worker already has: a local Hugging Face cache that holds
a commit the mirror lacks (a warm node, a cache baked into an image) is published to the
mirror, with no request to the Hub.

A warm worker makes no download: transformers finds each file with
``try_to_load_from_cache`` and reads it where it is, so a mirror filled only after
downloads would never hear of it, and every other worker would keep downloading. So the
hook's lookups and its downloads answered from the local cache :func:`offer` what they
saw; a thread of its own then finds the mirror and the commit and publishes it
(:func:`fill`) while the worker goes on loading: the lookup itself stays a lookup, as
quick as stock's, and does nothing in the caller's thread but hand the offer over.

The publish is the mirror's usual sync (:func:`.hub_mirror.sync_snapshot`): blobs first,
each hashed against its name, the commit's file listing, the snapshot's links, the ref
last, under the mirror's sync mark: a worker killed midway leaves no half snapshot, and
the next one resumes. Only files the local cache holds are published, checked against
the commit's listing in the local cache. A cache without that listing (huggingface_hub
writes it for a snapshot download, not always for single files) publishes nothing: a
lookup never asks the Hub, so the fill is left to the next download of the repo, which
may ask it for the listing (said at debug).

A process that exits while the fill runs waits for it up to
``LOADERPLUG_FILL_EXIT_WAIT_S`` (0: not at all; Ctrl-C ends the wait, as it ends any
sync): a slow volume can hold a worker's exit for that long, after which the fill's
thread, a daemon, is left behind. What is left unpublished then (the repo, the commit,
its files) is said in a warning and left to the next worker. No file on the mirror is
ever partial (each is published whole, by a rename), and the commit's ref, published
last, is not there until every file is. A forked child (``os.fork``, multiprocessing,
vLLM's workers) inherits none of it: not the parent's offers, nor its exit wait, which
would wait there for a thread that does not exist.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loaderplug.errors import SettingsError
from loaderplug.integrations.hub import commits as hub_commits
from loaderplug.integrations.hub import mirror as hub_mirror
from loaderplug.integrations.hub.calls import cache_folder, mirror_for
from loaderplug.integrations.hub.notices import cause, failed
from loaderplug.settings import Settings, from_env

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalCommit:
    """A commit a worker's local cache holds: the repo's cache folder, the mirror's folder
    for the repo, and the commit."""

    cache: Path
    mirror: Path
    commit: str


@dataclass(frozen=True)
class _Offer:
    """What a call saw in the local cache: its options, and the file a lookup found there
    (None: the commit the call's revision names in the cache)."""

    options: dict[str, Any]
    found: Path | None


@dataclass(frozen=True)
class _Publishing:
    """The commit the fill thread is publishing (of the offer it took), for a process
    that exits before it is done to say what it left."""

    local: LocalCommit
    files: tuple[str, ...]


_seen: set[tuple[str, ...]] = set()  # offers handed over (one per repo, cache, commit)
_offered: set[tuple[Path, str]] = set()  # commits taken up by the fill thread
_pending: list[_Offer] = []
_taking: _Offer | None = None  # the offer the fill thread is working on
_publishing: _Publishing | None = None
_cond = threading.Condition()
_worker: threading.Thread | None = None


def offer(options: dict[str, Any], found: Path | None = None) -> None:
    """Have the mirror filled from the local cache with what a call saw there: the commit
    of ``found`` (a file of a snapshot a lookup found), or the commit the call's revision
    names in the cache. Returns at once: the mirror is found, and the commit published,
    on the fill thread (once per commit and process, unless the mirror holds it)."""
    global _worker
    key = _offer_key(options, found)
    with _cond:
        if key in _seen:
            return
        _seen.add(key)
        _pending.append(_Offer(dict(options), found))
        _cond.notify_all()
        if _worker is None:
            _worker = threading.Thread(target=_fill_offered, name="loaderplug-fill", daemon=True)
            _worker.start()
            atexit.register(_wait_at_exit)


def _offer_key(options: dict[str, Any], found: Path | None) -> tuple[str, ...]:
    """What tells two offers apart, cheap enough for a lookup: the repo, the cache, the
    revision, and the snapshot folder of the file found."""
    snapshot = str(found).partition("/snapshots/")[2].split("/", 1)[0] if found else ""
    return (
        str(options.get("cache_dir")),
        hub_commits.repo_type(options),
        str(options["repo_id"]),
        hub_commits.revision(options),
        snapshot,
    )


def wait(timeout_s: float | None = None) -> bool:
    """Until every commit offered so far is published (or has failed), or ``timeout_s``
    passed; whether it is all done."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    with _cond:
        while _pending or _taking is not None:
            left = 0.1 if deadline is None else min(0.1, deadline - time.monotonic())
            if left <= 0:
                return False
            _cond.wait(left)  # at most 0.1 s: the waiting thread stays able to take Ctrl-C
    return True


def _wait_at_exit() -> None:
    """At exit, the fill given ``LOADERPLUG_FILL_EXIT_WAIT_S`` to finish; what it has not
    published by then is said, and left to the next worker."""
    try:
        wait_s: float = from_env().fill_exit_wait_s
    except SettingsError as exc:  # said by whatever read the settings first; not here
        wait_s = Settings.fill_exit_wait_s  # the default
        log.debug("loaderplug: the fill's exit wait: %s; waiting %g s", exc, wait_s)
    if wait(wait_s):
        return
    with _cond:
        publishing, taking = _publishing, _taking
        pending = [o.options["repo_id"] for o in _pending]
    log.warning(
        "loaderplug: exiting before the mirror was filled from the local cache "
        "(waited %g s, LOADERPLUG_FILL_EXIT_WAIT_S): %s; no file of it is published "
        "partially, and the next worker that finds it in its cache fills it",
        wait_s,
        _left_unpublished(taking, publishing, pending),
    )


def _left_unpublished(
    taking: _Offer | None, publishing: _Publishing | None, pending: list[str]
) -> str:
    """What an exit leaves unpublished, for the warning that says so."""
    parts = []
    if taking is not None:
        repo_id = taking.options["repo_id"]
        if publishing is None:
            parts.append(f"{repo_id} is not published (still being looked at)")
        else:
            files = list(publishing.files)
            shown = ", ".join(files[:5]) + (f" and {len(files) - 5} more" if len(files) > 5 else "")
            parts.append(
                f"{repo_id} at commit {publishing.local.commit} to {publishing.local.mirror} "
                f"is not (wholly) published ({len(files)} file(s): {shown})"
            )
    if pending:
        parts.append(f"{len(pending)} offer(s) not looked at ({', '.join(map(str, pending))})")
    return "; ".join(parts)


def _forget_in_child() -> None:
    """In a forked child: none of the parent's fill. Its thread is not there; its offers
    and exit wait are the parent's, and waiting at the child's exit for that thread would
    wait for good. The lock may have been held by a parent's thread at the fork: a new one."""
    global _cond, _publishing, _taking, _worker
    _pending.clear()
    _publishing, _taking, _worker = None, None, None
    _cond = threading.Condition()
    atexit.unregister(_wait_at_exit)


os.register_at_fork(after_in_child=_forget_in_child)


def _fill_offered() -> None:
    global _taking
    while True:
        with _cond:
            while not _pending:
                _cond.wait()
            offered = _pending.pop(0)
            _taking = offered
        try:
            _take_up(offered)
        except Exception as exc:  # the call was answered: the mirror's fill is a bonus
            failed(
                "fill",
                offered.options,
                exc,
                "loaderplug: the mirror was not filled with %s from the local cache %s (%s)",
                offered.options["repo_id"],
                offered.options.get("cache_dir") or "(the default cache)",
                cause(exc),
            )
        finally:
            with _cond:
                _taking = None
                _cond.notify_all()


def _take_up(offered: _Offer) -> None:
    """Find the mirror and the commit of an offer, and publish the commit once."""
    settings = from_env()
    mirror = mirror_for(offered.options, settings)
    if mirror is None or not settings.sync:
        return
    cache = cache_folder(offered.options)
    if offered.found is not None:
        commit = hub_commits.snapshot_commit(cache, offered.found)
    else:
        commit = hub_mirror.resolve_commit(cache, hub_commits.revision(offered.options))
    if commit is None:
        return
    with _cond:
        if (mirror, commit) in _offered:
            return
        _offered.add((mirror, commit))
    local = LocalCommit(cache, mirror, commit)
    if hub_mirror.read_listing(cache, commit) is None:
        with _cond:
            _offered.discard((mirror, commit))  # a later offer may find a listing
        log.debug(
            "loaderplug: the local cache %s holds commit %s but no file listing of it: the "
            "mirror is not filled from it here (a lookup asks the Hub nothing); the next "
            "download of %s fills it, asking the Hub for the listing",
            cache,
            commit,
            offered.options["repo_id"],
        )
        return
    fill(local)


def fill(commit: LocalCommit) -> bool:
    """Publish the files of ``commit`` the local cache holds that the mirror lacks; True
    if something was published."""
    global _publishing
    settings = from_env()
    listing = hub_mirror.read_listing(commit.cache, commit.commit)
    if listing is None:
        return False  # nothing can be checked: see the module doc
    held = _held_locally(commit, listing)
    on_mirror = hub_mirror.read_listing(commit.mirror, commit.commit)
    if on_mirror is not None:
        have = hub_mirror.check_selection(commit.mirror, commit.commit, held, on_mirror)
        if not have.refused:
            return False  # the mirror holds all of it already
    ref = _ref_to_publish(commit)
    with _cond:
        _publishing = _Publishing(commit, tuple(held))
    try:
        report = hub_mirror.sync_snapshot(
            commit.cache, commit.mirror, commit.commit, ref, set(held).intersection, settings
        )
    finally:
        with _cond:
            _publishing = None
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
