"""``snapshot_download`` that hydrates from the volume mirror and fills it after a download.

    from loaderplug.integrations import huggingface_hub as lp_hub
    lp_hub.install()            # every snapshot_download in this process goes through it
    path = snapshot_download("org/model")

What a call does:

1. If the mirror (``LOADERPLUG_VOLUME``/hub, or a ``loaderplug_find_mirror`` plugin) holds
   the repo at the requested revision, with every file the call's patterns select, those
   files are hydrated into the local cache (blobs, snapshot links, ref, file listing) and
   the snapshot path is returned without a single request to the Hub. A branch is
   resolved by the mirror's ref: the mirror answers for the commit it holds.
2. Otherwise the original ``snapshot_download`` runs (fetching only what is still
   missing), and what it downloaded is copied to the mirror, unless
   ``LOADERPLUG_SYNC=off``. The copy runs in the foreground, before the call returns: a
   short-lived worker that exited mid-copy would leave nothing usable, and the first
   worker pays for it once per model.
3. Any failure on the mirror path falls back to the original download with one warning,
   and a failed copy to the mirror never fails the caller's download. A mirror blob of
   the wrong size or content is refused, and that file is downloaded instead. A mirror
   that is skipped, for whatever reason, says why in one warning.

A mirror written before huggingface_hub kept listings (1.22; ``trees/`` absent) is still
used. With the Hub reachable, the commit's listing is fetched once (one ``list_repo_tree``
request, one per 1000 files), kept on the mirror for the next worker, and the call is
served as in 1. With the Hub out of reach (a failed connection, a timeout, an error
answer), ``HF_HUB_OFFLINE=1`` or ``local_files_only``, the mirror's snapshot is served as
huggingface_hub serves its own cache offline: what its links hold, by the patterns, each
blob named by a hash checked as it is copied, with one warning that completeness was
not checked.

Install it explicitly with :func:`install` (or ``with installed(): ...``); loaderplug's
vLLM plugin installs it when a mirror is configured.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import time
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loaderplug.errors import TransferFailed
from loaderplug.plugins import Plugins
from loaderplug.settings import Settings, from_env
from loaderplug.types import MirrorRequest

from . import hub_mirror
from .upstream import huggingface_hub as seam

try:
    import huggingface_hub
    from huggingface_hub import constants

    # Public (documented) API, though ``utils`` does not re-export it for type checkers.
    from huggingface_hub.utils import filter_repo_objects  # type: ignore[attr-defined]

    # Not public: see loaderplug.integrations.upstream.huggingface_hub.
    repo_folder_name = seam.repo_folder_name()
    # The function this module wraps, as huggingface_hub defines it.
    original_snapshot_download: Callable[..., Any] = seam.snapshot_download()
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "loaderplug.integrations.huggingface_hub needs huggingface_hub: "
        "pip install 'loaderplug[hf]'"
    ) from exc

log = logging.getLogger(__name__)
_SIGNATURE = inspect.signature(original_snapshot_download)
_installed: list[tuple[types.ModuleType, str]] = []


def snapshot_download(*args: Any, **kwargs: Any) -> Any:
    """``huggingface_hub.snapshot_download``, served from the mirror when it can be."""
    call = _SIGNATURE.bind(*args, **kwargs)  # the original's TypeError for a bad call
    call.apply_defaults()
    options = call.arguments
    if options.get("dry_run") or options.get("force_download"):
        _say_bypassed(options)
        return original_snapshot_download(*args, **kwargs)
    mirror: Path | None = None
    try:
        settings = from_env()
        mirror = _mirror_for(options, settings)
        served = _from_mirror(mirror, options, settings) if mirror is not None else None
    except Exception as exc:
        log.warning(
            "loaderplug: the mirror %s could not serve %s (%s); downloading it instead",
            mirror or "(not found)",
            options["repo_id"],
            exc,
        )
        return original_snapshot_download(*args, **kwargs)
    if served is not None:
        return served
    result = original_snapshot_download(*args, **kwargs)
    if mirror is not None and settings.sync and not _offline(options):
        try:
            _to_mirror(mirror, options, settings)
        except Exception as exc:
            log.warning(
                "loaderplug: copying %s to the mirror %s failed (%s); the download itself "
                "is complete",
                options["repo_id"],
                mirror,
                exc,
            )
    return result


snapshot_download.__signature__ = _SIGNATURE  # type: ignore[attr-defined]
snapshot_download.__doc__ = (
    (snapshot_download.__doc__ or "") + "\n\n" + (original_snapshot_download.__doc__ or "")
)


# -- where things are ----------------------------------------------------------------


def _repo_type(options: dict[str, Any]) -> str:
    return str(options.get("repo_type") or "model")


def _revision(options: dict[str, Any]) -> str:
    revision = options.get("revision") or constants.DEFAULT_REVISION
    # huggingface_hub's ResolvedRevision carries the commit it was resolved to.
    return str(getattr(revision, "resolved", None) or revision)


def _cache_folder(options: dict[str, Any]) -> Path:
    """The repo's folder in the local cache, resolved as the original resolves it."""
    cache_dir = Path(options.get("cache_dir") or constants.HF_HUB_CACHE).expanduser().resolve()
    name = repo_folder_name(repo_id=options["repo_id"], repo_type=_repo_type(options))
    return cache_dir / name


def _mirror_for(options: dict[str, Any], settings: Settings) -> Path | None:
    """The mirror's folder for this repo (``<hub root>/models--org--name``), or None,
    also when the local cache is the mirror itself (``HF_HOME`` on the volume)."""
    request = MirrorRequest("hub", options["repo_id"], _revision(options))
    root = Plugins(settings).find_mirror(request)
    if root is None:
        return None
    name = repo_folder_name(repo_id=options["repo_id"], repo_type=_repo_type(options))
    mirror = root / name
    if options.get("local_dir") is None and mirror.resolve() == _cache_folder(options):
        return None
    return mirror


def _offline(options: dict[str, Any]) -> bool:
    return bool(options.get("local_files_only")) or bool(constants.HF_HUB_OFFLINE)


def _wanted(paths: Iterable[str], options: dict[str, Any]) -> list[str]:
    """The repo paths the call's allow/ignore patterns select."""
    return list(
        filter_repo_objects(
            items=list(paths),
            allow_patterns=options.get("allow_patterns"),
            ignore_patterns=options.get("ignore_patterns"),
        )
    )


# -- mirror -> local -----------------------------------------------------------------


@dataclass
class _Served:
    """What the mirror can give a call: the selection, and how it was made."""

    selection: hub_mirror.Selection
    listed: bool  # a listing backs the selection (the mirror's, or the Hub's)
    fetched: dict[str, dict[str, object]] | None = None  # a listing fetched from the Hub
    stored: bool = True  # the mirror holds the listing (the hydrate copies it)
    unchecked: str = ""  # why the snapshot is served with no listing to check it against


def _from_mirror(mirror: Path, options: dict[str, Any], settings: Settings) -> str | None:
    """Hydrate what the mirror holds for this call; the snapshot path if that was all the
    call asked for, else None (the original then fetches the rest)."""
    served = _what_the_mirror_serves(mirror, options, settings)
    if served is None:
        return None
    selection = served.selection
    commit = selection.commit
    local_dir = options.get("local_dir")
    listing = served.listed and served.stored
    if local_dir is not None:
        target = Path(local_dir).expanduser().resolve()
        report = hub_mirror.hydrate_local_dir(mirror, target, selection, settings, listing=listing)
        listing_folder = target / seam.LOCAL_DIR_META
    else:
        target = _cache_folder(options)
        report = hub_mirror.hydrate_cache(mirror, target, selection, settings, listing=listing)
        listing_folder = target
    if served.fetched is not None and not served.stored:
        # The mirror could not keep the listing: the local cache still gets it.
        hub_mirror.write_listing(listing_folder, commit, served.fetched, fsync=settings.fsync)
    if not report.ok:
        failed = {r.path: r.reason for r in report.failed}
        for f in list(selection.usable):
            reason = failed.get(f"blobs/{f.blob}") or failed.get(f.path)
            if reason:
                selection.refused[f.path] = reason
                selection.usable.remove(f)
    if served.unchecked:
        refused = selection.refused
        left_out = f"; left out {len(refused)} file(s) ({_some(refused)})" if refused else ""
        log.warning(
            "loaderplug: the mirror %s has no file listing of %s@%s (commit %s) and %s: "
            "served the %d file(s) its snapshot holds; completeness was not checked%s",
            mirror,
            options["repo_id"],
            _revision(options),
            commit,
            served.unchecked,
            len(selection.usable),
            left_out,
        )
    elif selection.refused:
        log.warning(
            "loaderplug: the mirror could not serve %d file(s) of %s (%s); downloading them",
            len(selection.refused),
            options["repo_id"],
            _some(selection.refused),
        )
        return None
    if local_dir is not None:
        _record_local_dir_downloads(target, selection)
        return os.path.realpath(target)
    snapshot = target / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)  # a selection of nothing: an empty one
    if not hub_mirror.COMMIT.match(_revision(options)):
        hub_mirror.write_ref(target, _revision(options), commit)
    return str(snapshot)


def _what_the_mirror_serves(
    mirror: Path, options: dict[str, Any], settings: Settings
) -> _Served | None:
    """The files of this call the mirror holds, or None (said why) where it cannot serve
    it. A snapshot without a listing (a mirror written before huggingface_hub 1.22 kept
    them) gets its listing from the Hub, with one request, kept on the mirror for the
    next worker; where the Hub cannot give it, the snapshot is served as it is."""
    revision = _revision(options)
    if not mirror.is_dir():
        _skip(mirror, options, f"it holds no {mirror.name}")
        return None
    commit = hub_mirror.resolve_commit(mirror, revision)
    if commit is None:
        _skip(mirror, options, f"it holds no ref {revision!r} (refs/{revision})")
        return None
    listing, problem = hub_mirror.inspect_listing(mirror, commit)
    if listing is not None:
        wanted = _wanted(listing, options)
        return _Served(hub_mirror.check_selection(mirror, commit, wanted, listing), listed=True)
    if problem != hub_mirror.NO_LISTING:
        _skip(mirror, options, f"commit {commit}: {problem}")
        return None
    if not (mirror / "snapshots" / commit).is_dir():
        _skip(mirror, options, f"it holds no snapshot of commit {commit}")
        return None
    fetched, unchecked = _fetch_listing(commit, options)
    if fetched is not None:
        listing, problem = hub_mirror.parse_listing(
            {"format_version": seam.LISTING_FORMAT, "files": fetched}
        )
        if listing is None:
            _skip(mirror, options, f"the Hub's listing of commit {commit} {problem}")
            return None
        stored = _store_listing(mirror, commit, fetched, options, settings)
        selection = hub_mirror.check_selection(mirror, commit, _wanted(listing, options), listing)
        return _Served(selection, listed=True, fetched=fetched, stored=stored)
    selection = hub_mirror.snapshot_selection(mirror, commit, lambda ps: _wanted(ps, options))
    if selection.refused and not selection.usable:
        why = f"no file it selects is usable ({_some(selection.refused)})"
        _skip(mirror, options, f"commit {commit}, with no listing and {unchecked}: {why}")
        return None
    return _Served(selection, listed=False, unchecked=unchecked)


def _say_bypassed(options: dict[str, Any]) -> None:
    """A ``dry_run`` or ``force_download`` goes to the Hub: say so where a mirror is set."""
    try:
        mirror = _mirror_for(options, from_env())
    except Exception as exc:  # the call itself does not need the mirror
        log.debug("loaderplug: no mirror for %s (%s)", options["repo_id"], exc)
        return
    if mirror is not None:
        asked = "dry_run" if options.get("dry_run") else "force_download"
        _skip(mirror, options, f"{asked} asks the Hub itself")


def _skip(mirror: Path, options: dict[str, Any], why: str) -> None:
    """Say why the mirror is not used for this call (the original then runs)."""
    then = "huggingface_hub's own cache answers" if _offline(options) else "downloading it"
    log.warning(
        "loaderplug: not using the mirror %s for %s@%s: %s; %s",
        mirror,
        options["repo_id"],
        _revision(options),
        why,
        then,
    )


def _some(refused: dict[str, str]) -> str:
    """The first few refused files and why, for a message that gives their number."""
    some = "; ".join(f"{p}: {why}" for p, why in list(refused.items())[:3])
    return some + (f"; and {len(refused) - 3} more" if len(refused) > 3 else "")


def _fetch_listing(
    commit: str, options: dict[str, Any]
) -> tuple[dict[str, dict[str, object]] | None, str]:
    """The commit's listing from the Hub, with one ``list_repo_tree`` (one request per
    1000 files), as huggingface_hub fetches it for ``trees/<commit>.json``: entries and
    "", or None and why the Hub could not give it (offline, unreachable, an error answer:
    where stock ``snapshot_download`` would serve its own cache unchecked). A proxy error
    and an unknown commit are raised: the mirror is then not used. A Hub found out of
    reach is not asked again for a minute."""
    if options.get("local_files_only"):
        return None, "local_files_only is set"
    if constants.HF_HUB_OFFLINE:
        return None, "HF_HUB_OFFLINE is set"
    endpoint = str(options.get("endpoint") or constants.ENDPOINT)
    last = _outages.get(endpoint)
    if last is not None and time.monotonic() - last < _OUTAGE_S:
        # Each request to a Hub out of reach costs huggingface_hub's retries (some 23 s).
        return None, f"the Hub could not be reached {time.monotonic() - last:.0f} s ago"
    api = huggingface_hub.HfApi(
        library_name=options.get("library_name"),
        library_version=options.get("library_version"),
        user_agent=options.get("user_agent"),
        endpoint=options.get("endpoint"),
        headers=options.get("headers"),
        token=options.get("token"),
    )
    try:
        files = api.list_repo_tree(
            options["repo_id"], recursive=True, revision=commit, repo_type=_repo_type(options)
        )
        return {
            f.path: hub_mirror.listing_entry(
                size=f.size,
                blob_id=f.blob_id,
                lfs_sha256=f.lfs.sha256 if f.lfs is not None else None,
                lfs_size=f.lfs.size if f.lfs is not None else None,
                xet_hash=f.xet_hash,
            )
            for f in files
            if isinstance(f, huggingface_hub.RepoFile)
        }, ""
    except (seam.proxy_error(), seam.revision_not_found_error()):
        raise
    except seam.unreachable_errors() as exc:
        _outages[endpoint] = time.monotonic()
        return None, f"the Hub could not be reached ({type(exc).__name__}: {exc})"
    except seam.hub_http_error() as exc:
        if getattr(getattr(exc, "response", None), "status_code", 0) >= 500:
            _outages[endpoint] = time.monotonic()
        return None, f"the Hub did not give the listing ({type(exc).__name__}: {exc})"


# A Hub endpoint that a listing request found out of reach, and when (time.monotonic()):
# for _OUTAGE_S after, a mirror snapshot without a listing is served without asking again.
_OUTAGE_S = 60.0
_outages: dict[str, float] = {}


def _store_listing(
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
        why = exc
    log.warning(
        "loaderplug: the listing of %s (commit %s) could not be kept on the mirror %s (%s); "
        "every worker will ask the Hub for it again",
        options["repo_id"],
        commit,
        mirror,
        why,
    )
    return False


def _record_local_dir_downloads(local_dir: Path, selection: hub_mirror.Selection) -> None:
    """Write the per-file metadata huggingface_hub keeps for a ``local_dir`` download, so
    it later finds these files current instead of downloading them again."""
    write_download_metadata = seam.write_download_metadata()
    for f in selection.usable:
        write_download_metadata(local_dir, f.path, selection.commit, f.blob)


# -- local -> mirror -----------------------------------------------------------------


def _to_mirror(mirror: Path, options: dict[str, Any], settings: Settings) -> None:
    local_dir = options.get("local_dir")
    revision = _revision(options)
    if local_dir is not None:
        source = Path(local_dir).expanduser().resolve()
        commit = _local_dir_commit(source) if not hub_mirror.COMMIT.match(revision) else revision
    else:
        source = _cache_folder(options)
        commit = hub_mirror.resolve_commit(source, revision)
    if commit is None:
        raise RuntimeError(f"cannot tell which commit {revision!r} was downloaded")
    report = hub_mirror.sync_snapshot(
        source,
        mirror,
        commit,
        revision,
        lambda paths: _wanted(paths, options),
        settings,
        local_dir=local_dir is not None,
    )
    if not report.ok:
        raise TransferFailed(report)


def _local_dir_commit(local_dir: Path) -> str | None:
    """The commit of the file a ``local_dir`` download recorded last: huggingface_hub
    writes ``download/<path>.metadata`` (commit, etag, time) for every file it places."""
    download = local_dir / seam.LOCAL_DIR_DOWNLOADS
    records = sorted(download.rglob("*.metadata"), key=lambda p: p.stat().st_mtime)
    for record in reversed(records):
        commit = record.read_text().split("\n", 1)[0].strip()
        if hub_mirror.COMMIT.match(commit):
            return commit
    return None


# -- install -------------------------------------------------------------------------


def install() -> None:
    """Route ``snapshot_download`` through loaderplug in every namespace holding the
    original: the ``huggingface_hub`` package, its ``_snapshot_download`` module (which
    ``HfApi.snapshot_download`` calls), and modules that imported the name earlier
    (vLLM's ``weight_utils``, for one). Idempotent; :func:`uninstall` undoes it."""
    if _installed:
        return
    huggingface_hub.snapshot_download  # noqa: B018 - resolve the lazy attribute first
    for module in list(sys.modules.values()):
        if module is sys.modules[__name__]:  # our own reference to the original stays
            continue
        for name in _names_holding_original(module):
            setattr(module, name, snapshot_download)
            _installed.append((module, name))
    if (huggingface_hub, "snapshot_download") not in _installed:
        setattr(huggingface_hub, "snapshot_download", snapshot_download)  # noqa: B010
        _installed.append((huggingface_hub, "snapshot_download"))


def _names_holding_original(module: Any) -> list[str]:
    try:
        namespace = vars(module)
    except TypeError:
        return []
    return [n for n, v in list(namespace.items()) if v is original_snapshot_download]


def uninstall() -> None:
    """Put the original ``snapshot_download`` back wherever :func:`install` replaced it."""
    while _installed:
        module, name = _installed.pop()
        if getattr(module, name, None) is snapshot_download:
            setattr(module, name, original_snapshot_download)


def is_installed() -> bool:
    return bool(_installed)


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """``install()`` for the duration of a ``with`` block (no-op if already installed)."""
    owner = not _installed
    install()
    try:
        yield
    finally:
        if owner:
            uninstall()
