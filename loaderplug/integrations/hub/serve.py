"""A Hub call served from the mirror: the files it selects at the pinned commit hydrated
into the local cache (or the call's ``local_dir``), and what the mirror could not serve
said once, so that the original fetches only that.

Anyone who can write the volume can write the mirror, so where the Hub answers, what a
commit holds is the Hub's word: its listing of the commit (one request per commit and
process) chooses the files and names each one's blob, whose hash the copy checks as it
reads (an LFS file's sha256, any other file's git blob id), and a mirror listing that
departs from it is said and replaced. Where the Hub cannot be asked, the mirror's own
listing is served, said to be unverified."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from huggingface_hub import constants

from loaderplug.integrations.hub import commits as hub_commits
from loaderplug.integrations.hub import mirror as hub_mirror
from loaderplug.integrations.hub import sync as hub_sync
from loaderplug.integrations.hub.calls import Call, cache_folder, chooser, mirror_for
from loaderplug.integrations.hub.notices import note_once, say_once, skip, some
from loaderplug.integrations.upstream import huggingface_hub as seam
from loaderplug.settings import Settings, from_env

log = logging.getLogger(__name__)


class NotInCommit(Exception):
    """The listing of the pinned commit (the Hub's, or offline the mirror's) has no such
    file: the Hub would answer 404, so the call is answered so without asking it."""

    def __init__(self, call: Call, commit: str, listing: str) -> None:
        super().__init__(call.file)
        self.call, self.commit, self.listing = call, commit, listing  # which listing says so

    def error(self) -> BaseException:
        """What stock ``hf_hub_download`` raises for a 404, with ``.no_exist/`` recorded
        as it records it (transformers then skips the file without a call)."""
        import httpx2  # huggingface_hub's HTTP client

        options, file = self.call.options, str(self.call.file)
        if options.get("local_dir") is None:
            marker = cache_folder(options) / ".no_exist" / self.commit / file
            with contextlib.suppress(OSError):
                marker.parent.mkdir(parents=True, exist_ok=True)
                marker.touch()
        url = constants.HUGGINGFACE_CO_URL_TEMPLATE.format(
            repo_id=options["repo_id"], revision=self.commit, filename=file
        )
        response = httpx2.Response(
            404,
            headers={"X-Error-Code": "EntryNotFound", "X-Repo-Commit": self.commit},
            request=httpx2.Request("HEAD", url),
        )
        message = (
            f"{file} is not a file of {options['repo_id']} at commit {self.commit} "
            f"({self.listing} says so)"
        )
        return seam.remote_entry_not_found_error()(message, response=response)


@dataclass
class _Served:
    """What the mirror can give a call: the selection, and how it was made."""

    selection: hub_mirror.Selection
    listed: bool  # a listing backs the selection (the mirror's, or the Hub's)
    fetched: dict[str, dict[str, object]] | None = None  # a listing fetched from the Hub
    stored: bool = True  # the hydrate copies the mirror's listing (else writes `fetched`)
    unchecked: str = ""  # why the snapshot is served with no listing to check it against


def from_mirror(mirror: Path, call: Call, commit: str, settings: Settings) -> str | None:
    """Hydrate what the mirror holds of this call at ``commit``; the path the original
    would return if that was all the call asked for, else None (the original then
    fetches the rest)."""
    options = call.options
    served = _what_the_mirror_serves(mirror, call, commit, settings)
    if served is None:
        return None
    selection = served.selection
    if call.file is not None and not selection.usable:
        return None  # not a file of the commit, or not usable: the original says which
    local_dir = options.get("local_dir")
    target = _hydrate_served(mirror, options, served, commit, settings)
    if not _say_what_is_left_out(mirror, options, served, commit):
        return None
    if call.file is not None and not selection.usable:
        return None
    if served.listed and settings.sync and not call.lookup:
        _complete_mirror_snapshot(mirror, selection)
    if local_dir is not None:
        _record_local_dir_downloads(target, selection)
        where = Path(os.path.realpath(target))
    else:
        where = target / "snapshots" / commit
        where.mkdir(parents=True, exist_ok=True)  # a selection of nothing: an empty one
        hub_commits.keep_local_ref(target, options, commit, fsync=settings.fsync)
    return str(where / call.file) if call.file is not None else str(where)


def _hydrate_served(
    mirror: Path, options: dict[str, Any], served: _Served, commit: str, settings: Settings
) -> Path:
    """Hydrate the served selection into the call's local folder or cache (the folder
    returned); a file that fails is moved from usable to refused."""
    selection, local_dir = served.selection, options.get("local_dir")
    listing = served.listed and served.stored
    if local_dir is not None:
        target = Path(local_dir).expanduser().resolve()
        report = hub_mirror.hydrate_local_dir(mirror, target, selection, settings, listing=listing)
        listing_folder = target / seam.LOCAL_DIR_META
    else:
        target = cache_folder(options)
        report = hub_mirror.hydrate_cache(mirror, target, selection, settings, listing=listing)
        listing_folder = target
    if served.fetched is not None and not served.stored:
        # The mirror could not keep the listing: the local cache still gets it.
        hub_mirror.write_listing(listing_folder, commit, served.fetched, fsync=settings.fsync)
    failed = {r.path: r.reason for r in report.failed}
    for f in list(selection.usable):
        reason = failed.get(f"blobs/{f.blob}") or failed.get(f.path)
        if reason:
            selection.refused[f.path] = reason
            selection.usable.remove(f)
    return target


def _say_what_is_left_out(
    mirror: Path, options: dict[str, Any], served: _Served, commit: str
) -> bool:
    """Log, once, what the mirror could not serve; False when the original must fetch
    it (a snapshot with no listing to check it against is served as it is)."""
    selection = served.selection
    if served.unchecked:
        refused = selection.refused
        left_out = f"; left out {len(refused)} file(s) ({some(refused)})" if refused else ""
        say_once(
            mirror,
            options,
            f"no file listing of commit {commit}",
            "loaderplug: the mirror %s has no file listing of %s (commit %s) and %s: "
            "served the %d file(s) its snapshot holds; completeness was not checked%s",
            mirror,
            hub_commits.RepoRevision.of(options),
            commit,
            served.unchecked,
            len(selection.usable),
            left_out,
        )
    elif selection.refused:
        say_once(
            mirror,
            options,
            "could not serve",
            "loaderplug: the mirror could not serve %d file(s) of %s (%s); downloading them",
            len(selection.refused),
            options["repo_id"],
            some(selection.refused),
        )
        return False
    return True


def _complete_mirror_snapshot(mirror: Path, selection: hub_mirror.Selection) -> None:
    """A commit whose files the mirror's blobs already held (most of them, when a new
    commit changed a config) gets its snapshot links there too; best effort."""
    try:
        hub_mirror.link_snapshot(mirror, selection.commit, selection.usable)
    except OSError as exc:
        log.debug("loaderplug: snapshot links on the mirror %s not made: %s", mirror, exc)


def _what_the_mirror_serves(
    mirror: Path, call: Call, commit: str, settings: Settings
) -> _Served | None:
    """The files of this call the mirror holds at ``commit``, or None (said why) where it
    cannot serve it. Where the Hub answers, what the commit holds is the Hub's word (its
    listing, asked once per commit and process) and the mirror's listing is only checked
    against it; where it cannot be asked (offline, out of reach, or a cache lookup, which
    asks it nothing), the mirror's listing is taken as it is, and a snapshot without one
    (written before huggingface_hub 1.22 kept them) is served as it is."""
    options = call.options
    if not mirror.is_dir():
        skip(mirror, options, f"it holds no {mirror.name}")
        return None
    listing, problem = hub_mirror.inspect_listing(mirror, commit)
    if listing is None and problem != hub_mirror.NO_LISTING:
        skip(mirror, options, f"commit {commit}: {problem}")
        return None
    if listing is None and not (mirror / "snapshots" / commit).is_dir():
        skip(mirror, options, _why_no_snapshot(mirror, options, commit))
        return None
    fetched, why_not = _the_hubs_listing(call, commit)
    if fetched is not None:
        return _served_as_the_hub_lists(mirror, call, commit, listing, fetched, settings)
    if listing is not None:
        return _served_as_the_mirror_lists(mirror, call, commit, listing, why_not)
    selection = hub_mirror.snapshot_selection(mirror, commit, chooser(call))
    if selection.refused and not selection.usable:
        why = f"no file it selects is usable ({some(selection.refused)})"
        skip(mirror, options, f"commit {commit}, with no listing and {why_not}: {why}")
        return None
    return _Served(selection, listed=False, unchecked=why_not)


def _the_hubs_listing(call: Call, commit: str) -> tuple[dict[str, dict[str, object]] | None, str]:
    """The Hub's listing of ``commit`` and "", or None and why the Hub was not asked or
    could not answer. A cache lookup asks the Hub nothing: it has the listing only where
    this process got it already."""
    if call.lookup:
        known = hub_commits.known_listing(commit, call.options)
        return (known, "") if known is not None else (None, "a cache lookup asks the Hub nothing")
    return hub_commits.fetch_listing(commit, call.options)


def _served_as_the_hub_lists(
    mirror: Path,
    call: Call,
    commit: str,
    on_mirror: dict[str, hub_mirror.RepoFile] | None,
    fetched: dict[str, dict[str, object]],
    settings: Settings,
) -> _Served | None:
    """What the mirror can give the call of the commit as the Hub lists it: each file by
    the blob the Hub names, whose hash the copy checks. A mirror listing that departs
    from the Hub's is said once and replaced there (the next worker offline then reads
    the Hub's); the local cache always gets the Hub's, from memory."""
    options = call.options
    hub, problem = hub_mirror.parse_listing(
        {"format_version": seam.LISTING_FORMAT, "files": fetched}
    )
    if hub is None:
        skip(mirror, options, f"the Hub's listing of commit {commit} {problem}")
        return None
    if on_mirror != hub and not call.lookup:  # a lookup writes nothing to the mirror
        hub_sync.store_listing(mirror, commit, fetched, options, settings)
    if on_mirror is not None and on_mirror != hub:
        differences = hub_mirror.listing_differences(on_mirror, hub)
        say_once(
            mirror,
            options,
            f"listing of commit {commit} departs from the Hub's",
            "loaderplug: the mirror %s lists commit %s of %s otherwise than the Hub does "
            "(%d file(s): %s); serving the commit as the Hub lists it",
            mirror,
            commit,
            options["repo_id"],
            len(differences),
            some(differences),
        )
    if call.file is not None and call.file not in hub:
        raise NotInCommit(call, commit, "the Hub's file listing of that commit")
    selection = hub_mirror.check_selection(mirror, commit, chooser(call)(hub), hub)
    return _Served(selection, listed=True, fetched=fetched, stored=False)


def _served_as_the_mirror_lists(
    mirror: Path, call: Call, commit: str, listing: dict[str, hub_mirror.RepoFile], why_not: str
) -> _Served:
    """What the mirror can give the call by its own listing, where the Hub could not be
    asked (``why_not``): served as ever, and said (at info: offline is an ordinary day)
    to be unverified. Each blob is still checked against the hash that names it."""
    note_once(
        mirror,
        call.options,
        f"listing of commit {commit} not verified",
        "loaderplug: serving %s (commit %s) by the mirror's file listing, not verified "
        "against the Hub's: %s",
        call.options["repo_id"],
        commit,
        why_not,
    )
    if call.file is not None and call.file not in listing:
        raise NotInCommit(call, commit, f"the file listing of that commit on {mirror}")
    selection = hub_mirror.check_selection(mirror, commit, chooser(call)(listing), listing)
    return _Served(selection, listed=True)


def _why_no_snapshot(mirror: Path, options: dict[str, Any], commit: str) -> str:
    """Why the mirror has no snapshot of ``commit`` for the call's revision."""
    revision = hub_commits.revision(options)
    held = hub_mirror.resolve_commit(mirror, revision)
    if held is None:
        return f"it holds no ref {revision!r} (refs/{revision}) nor commit {commit}"
    return f"it holds no snapshot of commit {commit}" + (
        f" (its {revision} is {held})" if held != commit else ""
    )


def _record_local_dir_downloads(local_dir: Path, selection: hub_mirror.Selection) -> None:
    """Write the per-file metadata huggingface_hub keeps for a ``local_dir`` download, so
    it later finds these files current instead of downloading them again."""
    write_download_metadata = seam.write_download_metadata()
    for f in selection.usable:
        write_download_metadata(local_dir, f.path, selection.commit, f.blob)


def say_bypassed(options: dict[str, Any]) -> None:
    """A ``dry_run`` or ``force_download`` goes to the Hub: say so where a mirror is set."""
    try:
        mirror = mirror_for(options, from_env())
    except Exception as exc:  # the call itself does not need the mirror
        log.debug("loaderplug: no mirror for %s (%s)", options["repo_id"], exc)
        return
    if mirror is not None:
        asked = "dry_run" if options.get("dry_run") else "force_download"
        skip(mirror, options, f"{asked} asks the Hub itself")
