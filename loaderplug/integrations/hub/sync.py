"""The mirror filled from a Hub download: what a call downloaded is copied to the mirror
(blobs, links, listing, then the ref) before the call returns, and a commit's listing
fetched from the Hub is kept on the mirror for the next worker."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from loaderplug.errors import TransferFailed
from loaderplug.integrations.hub import commits as hub_commits
from loaderplug.integrations.hub import mirror as hub_mirror
from loaderplug.integrations.hub.calls import Call, cache_folder, chooser, wanted
from loaderplug.integrations.hub.notices import cause
from loaderplug.integrations.upstream import huggingface_hub as seam
from loaderplug.settings import Settings

log = logging.getLogger(__name__)


def to_mirror(mirror: Path, call: Call, commit: str | None, settings: Settings) -> None:
    """Copy what the call downloaded to the mirror (blobs, links, listing, then the ref).
    A single file's download leaves no listing behind: it is fetched (once per commit
    and process) and kept beside the file, as a snapshot download would have."""
    options = call.options
    local_dir = options.get("local_dir")
    revision = hub_commits.revision(options)
    if local_dir is not None:
        source = Path(local_dir).expanduser().resolve()
        commit = commit or (revision if hub_mirror.COMMIT.match(revision) else None)
        commit = commit or hub_commits.local_dir_commit(source)
        listing_folder = source / seam.LOCAL_DIR_META
    else:
        source = cache_folder(options)
        commit = commit or hub_mirror.resolve_commit(source, revision)
        listing_folder = source
    if commit is None:
        raise RuntimeError(f"cannot tell which commit {revision!r} was downloaded")
    if call.file is not None and hub_mirror.read_listing(listing_folder, commit) is None:
        fetched, why = hub_commits.fetch_listing(commit, options)
        if fetched is None:
            raise RuntimeError(f"no file listing of commit {commit} to fill it with ({why})")
        hub_mirror.write_listing(listing_folder, commit, fetched, fsync=settings.fsync)
    choose = chooser(call) if call.file is not None else (lambda ps: wanted(ps, options))
    report = hub_mirror.sync_snapshot(
        source,
        mirror,
        commit,
        hub_commits.ref_name(options) or commit,
        choose,
        settings,
        local_dir=local_dir is not None,
    )
    if not report.ok:
        raise TransferFailed(report)


def store_listing(
    mirror: Path,
    commit: str,
    raw: dict[str, dict[str, object]],
    options: dict[str, Any],
    settings: Settings,
) -> bool:
    """Keep a listing fetched from the Hub on the mirror, so that the next worker needs no
    request; False (with a warning) where the mirror cannot take it."""
    try:
        if hub_mirror.write_listing(mirror, commit, raw, fsync=settings.fsync):
            return True
        why: object = "an entry's Xet hash is not one; huggingface_hub would not keep it"
    except OSError as exc:
        why = cause(exc)
        log.debug("loaderplug: the listing not kept on the mirror %s", mirror, exc_info=exc)
    log.warning(
        "loaderplug: the listing of %s (commit %s) could not be kept on the mirror %s (%s); "
        "every worker will ask the Hub for it again",
        options["repo_id"],
        commit,
        mirror,
        why,
    )
    return False
