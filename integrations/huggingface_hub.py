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
   the wrong size or content is refused, and that file is downloaded instead.

Install it explicitly with :func:`install` (or ``with installed(): ...``); loaderplug's
vLLM plugin installs it when a mirror is configured.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import sys
import types
from collections.abc import Callable, Iterable, Iterator
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


def _from_mirror(mirror: Path, options: dict[str, Any], settings: Settings) -> str | None:
    """Hydrate what the mirror holds for this call; the snapshot path if that was all the
    call asked for, else None (the original then fetches the rest)."""
    revision = _revision(options)
    commit = hub_mirror.resolve_commit(mirror, revision)
    listing = hub_mirror.read_listing(mirror, commit) if commit else None
    if commit is None or listing is None:
        log.debug("loaderplug: %s@%s is not on the mirror %s", options["repo_id"], revision, mirror)
        return None
    selection = hub_mirror.check_selection(mirror, commit, _wanted(listing, options), listing)
    local_dir = options.get("local_dir")
    if local_dir is not None:
        target = Path(local_dir).expanduser().resolve()
        report = hub_mirror.hydrate_local_dir(mirror, target, selection, settings)
    else:
        target = _cache_folder(options)
        report = hub_mirror.hydrate_cache(mirror, target, selection, settings)
    if not report.ok:
        failed = {r.path: r.reason for r in report.failed}
        for f in selection.usable:
            reason = failed.get(f"blobs/{f.blob}") or failed.get(f.path)
            if reason:
                selection.refused[f.path] = reason
    if selection.refused:
        some = "; ".join(f"{p}: {why}" for p, why in list(selection.refused.items())[:3])
        log.warning(
            "loaderplug: the mirror could not serve %d file(s) of %s (%s); downloading them",
            len(selection.refused),
            options["repo_id"],
            some,
        )
        return None
    if local_dir is not None:
        _record_local_dir_downloads(target, selection)
        return os.path.realpath(target)
    if not hub_mirror.COMMIT.match(revision):
        hub_mirror.write_ref(target, revision, commit)
    return str(target / "snapshots" / commit)


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
