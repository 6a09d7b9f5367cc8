"""Which commit a load uses: one per repo, revision and process, whoever asks.

A load reads several files of one repo through several calls (transformers: the config,
the tokenizer, each weight shard; vLLM: the config, then the weights), and each may be
answered by the mirror or the Hub. Were each call to resolve ``main`` on its own, a
branch that moved between two of them would give a config of one commit and weights of
another. So the first call in a process that names a branch pins it to a commit, and
every later call for that repo and branch uses the pin:

* The Hub is asked once (``HfApi.repo_info``, the request stock ``snapshot_download``
  makes), as stock huggingface_hub asks it. The mirror then serves that commit if it
  holds it; otherwise the file is downloaded at that commit and the mirror filled.
* With ``LOADERPLUG_TRUST_MIRROR_REF=1`` the mirror's ``refs/<branch>`` is taken without
  asking (no request at all; a branch that moved on the Hub is not seen).
* With the Hub out of reach (a failed connection, a timeout, a 5xx, ``HF_HUB_OFFLINE``,
  ``local_files_only``, or an answer that the repo is not there for this token), the
  mirror's ref is used, with one warning saying so; failing that, the call is left to
  huggingface_hub's own cache.

A commit's file listing (what ``trees/<commit>.json`` holds) is asked of the Hub here
too, once per commit and process (:func:`fetch_listing`): the Hub's word on what a
commit holds, which a listing on the mirror (anyone who can write the volume can write
it) is checked against, and which a mirror or a local cache that lacks one is given.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import huggingface_hub
from huggingface_hub import constants

from loaderplug.integrations.hub import mirror as hub_mirror
from loaderplug.integrations.upstream import huggingface_hub as seam
from loaderplug.settings import Settings

log = logging.getLogger(__name__)

# A Hub endpoint found out of reach, and when (time.monotonic()): for OUTAGE_S after, it
# is not asked again (each request to a Hub out of reach costs huggingface_hub's retries).
OUTAGE_S = 60.0
_outages: dict[str, float] = {}


@dataclass(frozen=True)
class RepoRevision:
    """One repo at one revision, as a call names it, on one Hub endpoint."""

    endpoint: str
    repo_type: str
    repo_id: str
    revision: str

    @classmethod
    def of(cls, options: dict[str, Any]) -> RepoRevision:
        return cls(
            endpoint=str(options.get("endpoint") or constants.ENDPOINT),
            repo_type=repo_type(options),
            repo_id=str(options["repo_id"]),
            revision=revision(options),
        )

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.revision}"


def repo_type(options: dict[str, Any]) -> str:
    return str(options.get("repo_type") or "model")


def revision(options: dict[str, Any]) -> str:
    """The revision a call names: a branch, a tag or a commit (a ``ResolvedRevision``'s
    commit, as huggingface_hub itself reads one)."""
    named = options.get("revision") or constants.DEFAULT_REVISION
    return str(getattr(named, "resolved", None) or named)


def ref_name(options: dict[str, Any]) -> str | None:
    """The branch or tag a call names (a ``ResolvedRevision`` names the one it was
    resolved from), whose ref a cache keeps; None for a commit."""
    named = str(options.get("revision") or constants.DEFAULT_REVISION)
    return None if hub_mirror.COMMIT.match(named) else named


def offline(options: dict[str, Any]) -> bool:
    return bool(options.get("local_files_only")) or bool(constants.HF_HUB_OFFLINE)


_pins: dict[RepoRevision, str] = {}
_pins_lock = threading.Lock()


def pinned(
    options: dict[str, Any],
    mirror: Path | None,
    settings: Settings,
    *,
    mirror_ref: Callable[[str], str | None] | None = None,
) -> str | None:
    """The commit this process uses for the call's repo and revision: learned once (see
    the module doc), or None where neither the Hub nor the mirror can say (the call is
    then left to huggingface_hub). ``RevisionNotFoundError`` where the Hub says the
    revision does not exist. ``mirror_ref`` reads the mirror's ref of a revision where
    the mirror is no folder (a bucket)."""
    key = RepoRevision.of(options)
    if hub_mirror.COMMIT.match(key.revision):
        return key.revision
    with _pins_lock:  # one request per repo and process, even from threads
        if key in _pins:
            return _pins[key]
        if mirror_ref is None and mirror is not None:
            folder = mirror
            mirror_ref = lambda revision: hub_mirror.resolve_commit(folder, revision)  # noqa: E731
        commit = _learn(key, options, mirror_ref, settings)
        if commit is not None:
            _pins[key] = commit
        return commit


def known(options: dict[str, Any], mirror: Path) -> str | None:
    """The commit a cache lookup takes for the call's repo and revision, learned from no
    one: the revision if it is a commit, this process's pin, else the mirror's ref (not
    pinned: the next download still asks the Hub, as :func:`pinned` says)."""
    key = RepoRevision.of(options)
    if hub_mirror.COMMIT.match(key.revision):
        return key.revision
    with _pins_lock:
        commit = _pins.get(key)
    return commit or hub_mirror.resolve_commit(mirror, key.revision)


def forget_pins() -> None:
    """Forget every pin, outage and listing (a long-lived process that wants the Hub's
    news: a commit's listing never changes, but asking again costs one request)."""
    with _pins_lock:
        _pins.clear()
    _outages.clear()
    _listings.clear()


def _learn(
    key: RepoRevision,
    options: dict[str, Any],
    mirror_ref: Callable[[str], str | None] | None,
    settings: Settings,
) -> str | None:
    on_mirror = mirror_ref(key.revision) if mirror_ref is not None else None
    if settings.trust_mirror_ref and on_mirror is not None:
        return on_mirror
    commit, why_not = ask_hub(key, options)
    if commit is not None:
        return commit
    if on_mirror is not None:
        log.warning(
            "loaderplug: the Hub could not say which commit %s names (%s); using the mirror's, %s",
            key,
            why_not,
            on_mirror,
        )
    return on_mirror


def ask_hub(key: RepoRevision, options: dict[str, Any]) -> tuple[str | None, str]:
    """The commit the Hub says ``key`` names, and ""; or None and why the Hub could not
    say (where stock huggingface_hub would fall back on its cache). A proxy error and an
    unknown revision are raised, as stock raises them."""
    why_not = not_to_be_asked(options, key.endpoint)
    if why_not:
        return None, why_not
    try:
        info = hub_api(options).repo_info(
            key.repo_id, revision=key.revision, repo_type=key.repo_type
        )
    except (seam.proxy_error(), seam.revision_not_found_error()):
        raise
    except seam.unreachable_errors() as exc:
        return None, outage(key.endpoint, exc)
    except seam.hub_http_error() as exc:
        status = getattr(getattr(exc, "response", None), "status_code", 0) or 0
        if status >= 500:
            return None, outage(key.endpoint, exc)
        return None, f"the Hub answered {type(exc).__name__}: {exc}"
    sha = getattr(info, "sha", None)
    return (str(sha), "") if sha and hub_mirror.COMMIT.match(str(sha)) else (None, "no sha")


def not_to_be_asked(options: dict[str, Any], endpoint: str) -> str:
    """Why the Hub may not be asked for this call now ("" where it may): the call is
    local, the process offline, or the Hub out of reach a moment ago."""
    if options.get("local_files_only"):
        return "local_files_only is set"
    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    return recent_outage(endpoint)


def hub_api(options: dict[str, Any]) -> Any:
    """An ``HfApi`` with the call's endpoint, token and headers."""
    return huggingface_hub.HfApi(
        library_name=options.get("library_name"),
        library_version=options.get("library_version"),
        user_agent=options.get("user_agent"),
        endpoint=options.get("endpoint"),
        headers=options.get("headers"),
        token=options.get("token"),
    )


def recent_outage(endpoint: str) -> str:
    """Why not to ask ``endpoint`` now ("" where it may be asked)."""
    last = _outages.get(endpoint)
    if last is None or time.monotonic() - last >= OUTAGE_S:
        return ""
    return f"the Hub could not be reached {time.monotonic() - last:.0f} s ago"


def outage(endpoint: str, exc: BaseException) -> str:
    """Remember that ``endpoint`` is out of reach; the reason, for a message."""
    _outages[endpoint] = time.monotonic()
    return f"the Hub could not be reached ({type(exc).__name__}: {exc})"


# -- the commit a local cache or folder holds ------------------------------------------


def keep_local_ref(folder: Path, options: dict[str, Any], commit: str, *, fsync: bool) -> None:
    """Point ``refs/<branch>`` of the repo's local cache ``folder`` at the commit a download
    was pinned to (the original writes no ref for a pinned revision), so huggingface_hub's
    own lookups by branch find it offline."""
    ref = ref_name(options)
    if options.get("local_dir") is not None or ref is None:
        return
    if (folder / "snapshots" / commit).is_dir():
        hub_mirror.write_ref(folder, ref, commit, fsync=fsync)


def snapshot_commit(cache: Path, found: Path) -> str | None:
    """The commit of a file found in ``cache/snapshots/<commit>/``."""
    try:
        commit = found.relative_to(cache / "snapshots").parts[0]
    except (ValueError, IndexError):
        return None
    return commit if hub_mirror.COMMIT.match(commit) else None


def local_dir_commit(local_dir: Path) -> str | None:
    """The commit of the file a ``local_dir`` download recorded last: huggingface_hub
    writes ``download/<path>.metadata`` (commit, etag, time) for every file it places."""
    download = local_dir / seam.LOCAL_DIR_DOWNLOADS
    records = sorted(download.rglob("*.metadata"), key=lambda p: p.stat().st_mtime)
    for record in reversed(records):
        commit = record.read_text().split("\n", 1)[0].strip()
        if hub_mirror.COMMIT.match(commit):
            return commit
    return None


# -- a commit's file listing ----------------------------------------------------------

_listings: dict[tuple[str, str, str, str], dict[str, dict[str, object]]] = {}


def known_listing(commit: str, options: dict[str, Any]) -> dict[str, dict[str, object]] | None:
    """The commit's listing this process already has from the Hub, or None; asks nothing."""
    key = RepoRevision.of(options)
    return _listings.get((key.endpoint, key.repo_type, key.repo_id, commit))


def fetch_listing(
    commit: str, options: dict[str, Any]
) -> tuple[dict[str, dict[str, object]] | None, str]:
    """The commit's listing from the Hub, with one ``list_repo_tree`` (one request per
    1000 files) per commit and process, as huggingface_hub fetches it for
    ``trees/<commit>.json``: entries and "", or None and why the Hub could not give it
    (offline, unreachable, an error answer: where stock ``snapshot_download`` would serve
    its own cache unchecked). A proxy error and an unknown commit are raised."""
    key = RepoRevision.of(options)
    known = known_listing(commit, options)
    if known is not None:
        return known, ""
    why_not = not_to_be_asked(options, key.endpoint)
    if why_not:
        return None, why_not
    try:
        files = hub_api(options).list_repo_tree(
            key.repo_id, recursive=True, revision=commit, repo_type=key.repo_type
        )
        listing = {
            f.path: hub_mirror.listing_entry(
                size=f.size,
                blob_id=f.blob_id,
                lfs_sha256=f.lfs.sha256 if f.lfs is not None else None,
                lfs_size=f.lfs.size if f.lfs is not None else None,
                xet_hash=f.xet_hash,
            )
            for f in files
            if isinstance(f, huggingface_hub.RepoFile)
        }
    except (seam.proxy_error(), seam.revision_not_found_error()):
        raise
    except seam.unreachable_errors() as exc:
        return None, outage(key.endpoint, exc)
    except seam.hub_http_error() as exc:
        if (getattr(getattr(exc, "response", None), "status_code", 0) or 0) >= 500:
            outage(key.endpoint, exc)
        return None, f"the Hub did not give the listing ({type(exc).__name__}: {exc})"
    _listings[(key.endpoint, key.repo_type, key.repo_id, commit)] = listing
    return listing, ""
