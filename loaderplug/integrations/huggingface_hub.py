"""Hub downloads served from the volume mirror, and the mirror filled after a download.

    from loaderplug.integrations import huggingface_hub as lp_hub
    lp_hub.install()    # every snapshot_download and hf_hub_download in this process
    path = snapshot_download("org/model")

``install()`` routes both download functions through loaderplug wherever a library can
reach them: the ``huggingface_hub`` package, the modules ``HfApi``'s methods import them
from at call time, and names other modules imported earlier (transformers' and vLLM's).
So transformers' ``from_pretrained`` (configs, tokenizers, weights), diffusers'
``snapshot_download(allow_patterns=...)`` and vLLM's config, tokenizer and weight
lookups all meet the mirror. Each wrapper takes exactly what its original takes (its
``validate_hf_hub_args`` decorator's tolerance of legacy arguments such as ``proxies``
included) and returns what it returns.

What a call does:

1. Its branch is pinned to one commit for the whole process (:mod:`.hub_commits`): one
   ``repo_info`` request per repo, as stock huggingface_hub makes; the mirror's ref where
   the Hub is out of reach or offline (one warning), or with
   ``LOADERPLUG_TRUST_MIRROR_REF=1``. So a load never mixes two commits.
2. If the mirror (``LOADERPLUG_MIRROR``/hub, or a ``loaderplug_find_mirror`` plugin)
   holds that commit with every file the call selects, those files are hydrated into
   the local cache (blobs, snapshot links, ref, file listing) and the path is returned
   with no request to the Hub for a file. A call whose patterns select nothing (vLLM's
   path lookup, ``ignore_patterns="*"``) gets the repo's files other than weights, so
   the snapshot it returns is one a loader can read a config from.
3. Otherwise the original runs at the pinned commit (fetching only what is missing),
   and what it downloaded is copied to the mirror, unless ``LOADERPLUG_SYNC=off``. The
   copy runs before the call returns: a short-lived worker that exited mid-copy would
   leave nothing usable, and the first worker pays for it once per model.
4. Any failure on the mirror path falls back to the original with one warning, and a
   failed copy to the mirror never fails the caller's download. A mirror blob of the
   wrong size or content is refused, and that file is downloaded instead. A mirror that
   is skipped says why in one warning.

The mirror is a Hub cache as huggingface_hub writes it, the shared Xet store of
huggingface_hub >= 2.x included (:mod:`.hub_mirror`). A mirror written before
huggingface_hub kept listings (``trees/`` absent) is still used: with the Hub reachable,
the commit's listing is fetched once (one ``list_repo_tree`` request, one per 1000
files) and kept on the mirror; with the Hub out of reach, offline or
``local_files_only``, its snapshot is served as huggingface_hub serves its own cache
offline: what its links hold, each blob named by a hash checked as it is copied, with
one warning that completeness was not checked.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import sys
import threading
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loaderplug.errors import TransferFailed
from loaderplug.plugins.manager import Plugins
from loaderplug.settings import Settings, from_env
from loaderplug.types import MirrorRequest

from . import hub_commits, hub_fill, hub_mirror, hub_outage
from .hub_commits import offline as _offline
from .hub_commits import revision as _revision
from .upstream import huggingface_hub as seam

try:
    import huggingface_hub
    from huggingface_hub import constants

    # Public (documented) API, though ``utils`` does not re-export it for type checkers.
    from huggingface_hub.utils import filter_repo_objects  # type: ignore[attr-defined]

    # Not public: see loaderplug.integrations.upstream.huggingface_hub.
    repo_folder_name = seam.repo_folder_name()
    # The functions this module wraps, as huggingface_hub defines them.
    original_snapshot_download: Callable[..., Any] = seam.snapshot_download()
    original_hf_hub_download: Callable[..., Any] = seam.hf_hub_download()
    original_try_to_load_from_cache: Callable[..., Any] = seam.try_to_load_from_cache()
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "loaderplug.integrations.huggingface_hub needs huggingface_hub: "
        "pip install 'loaderplug[hf]'"
    ) from exc

log = logging.getLogger(__name__)
_installed: list[tuple[types.ModuleType, str, Callable[..., Any]]] = []

# What a call that selects no file is still given: every file but the weights.
WEIGHT_PATTERNS = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.ckpt",
    "*.gguf",
    "*.h5",
    "*.msgpack",
    "*.onnx",
    "*.onnx_data",
    "*.npz",
)


@dataclass(frozen=True)
class _Call:
    """One download call, bound to its original's parameters."""

    original: Callable[..., Any]
    bound: inspect.BoundArguments
    file: str | None  # hf_hub_download's repo path; None for a snapshot

    @property
    def options(self) -> dict[str, Any]:
        return self.bound.arguments

    def run_original(self, commit: str | None = None) -> Any:
        """The original, pinned to ``commit`` where one is known (so that it downloads
        the commit the rest of the load uses, without asking the Hub again)."""
        bound = self.bound
        named = self.options.get("revision")
        if commit is not None and _revision(self.options) != commit:
            pinned = seam.resolved_revision()(
                commit,
                named,
                self.options["repo_id"],
                self.options.get("repo_type"),
            )
            bound = inspect.BoundArguments(bound.signature, {**bound.arguments})
            bound.arguments["revision"] = pinned
        return self.original(*bound.args, **bound.kwargs)


def _wrap(original: Callable[..., Any], file_call: bool) -> Callable[..., Any]:
    """A function with ``original``'s name, signature and decorator, that serves the call
    from the mirror when it can."""
    signature = inspect.signature(original)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)  # the original's TypeError for a bad call
        bound.apply_defaults()
        file = None
        if file_call:
            subfolder = bound.arguments.get("subfolder")
            name = str(bound.arguments["filename"])
            file = _repo_path(f"{subfolder}/{name}" if subfolder else name)
        return _download(_Call(original, bound, file))

    functools.update_wrapper(wrapper, original)
    del wrapper.__wrapped__  # type: ignore[attr-defined]  # its signature is set below
    wrapper.__signature__ = signature  # type: ignore[attr-defined]
    wrapper.__module__ = __name__
    # The originals' own decorator: repo ids checked, legacy arguments (proxies, ...)
    # dropped with its warning, before the call is bound.
    validated = seam.validate_hf_hub_args()(wrapper)
    return validated


def _repo_path(path: str) -> str:
    """The file's path in the repo as the Hub reads the URL that names it: without the
    ``.`` segments and empty parts (sentence-transformers asks for ``subfolder="."``)."""
    return "/".join(part for part in path.split("/") if part not in ("", "."))


snapshot_download = _wrap(original_snapshot_download, file_call=False)
hf_hub_download = _wrap(original_hf_hub_download, file_call=True)


_LOOKUP_SIGNATURE = inspect.signature(original_try_to_load_from_cache)
_DOWNLOAD_SIGNATURE = inspect.signature(original_hf_hub_download)


@functools.wraps(original_try_to_load_from_cache)
def try_to_load_from_cache(*args: Any, **kwargs: Any) -> Any:
    """``huggingface_hub.try_to_load_from_cache``, where the mirror counts as cache: a
    file the local cache lacks and the mirror holds at the commit this process uses is
    hydrated and its path returned (vLLM asks this before it lists a repo's files on the
    Hub, so a worker starts with the Hub down). Nothing is downloaded from the Hub."""
    found = original_try_to_load_from_cache(*args, **kwargs)
    asked = _LOOKUP_SIGNATURE.bind(*args, **kwargs)
    asked.apply_defaults()
    if isinstance(found, str):
        _offer_to_the_mirror(asked.arguments, Path(found))
    if found is not None:
        return found
    # The download that would have put the file in the cache, served by the mirror alone.
    as_download = _DOWNLOAD_SIGNATURE.bind(**asked.arguments)
    as_download.apply_defaults()
    call = _Call(
        original_hf_hub_download, as_download, _repo_path(str(asked.arguments["filename"]))
    )
    try:
        settings = from_env()
        mirror = _mirror_for(call.options, settings)
        commit = hub_commits.pinned(call.options, mirror, settings) if mirror else None
        if mirror is None or commit is None:
            return None
        return _from_mirror(mirror, call, commit, settings)
    except _NotInCommit as absent:
        absent.error()  # records .no_exist/ as a download would
        return seam.cached_no_exist()
    except Exception as exc:  # a lookup never fails for the mirror's sake
        log.debug("loaderplug: the mirror could not answer a cache lookup: %s", exc)
        return None


def _download(call: _Call) -> Any:
    options = call.options
    if options.get("dry_run") or options.get("force_download"):
        _say_bypassed(options)
        return call.run_original()
    mirror: Path | None = None
    commit: str | None = None
    served: str | None = None
    try:
        settings = from_env()
        mirror = _mirror_for(options, settings)
        if mirror is not None:
            commit = hub_commits.pinned(options, mirror, settings)
        if mirror is not None and commit is not None:
            served = _from_mirror(mirror, call, commit, settings)
    except seam.revision_not_found_error():
        return call.run_original()  # the Hub's own error, as stock raises it
    except _NotInCommit as absent:
        raise absent.error() from None
    except Exception as exc:
        log.warning(
            "loaderplug: the mirror %s could not serve %s (%s); downloading it instead",
            mirror or "(not found)",
            options["repo_id"],
            exc,
        )
        return call.run_original(commit)
    if mirror is None:  # no mirror: the call is the original's alone
        return call.run_original()
    if served is not None:
        return served
    result = call.run_original(commit)
    if commit is not None:
        _keep_local_ref(options, commit, fsync=settings.fsync)
    if settings.sync and _offline(options) and options.get("local_dir") is None:
        _offer_to_the_mirror(options, None)  # what the local cache answered with
    if settings.sync and not _offline(options):
        try:
            _to_mirror(mirror, call, commit, settings)
        except Exception as exc:
            log.warning(
                "loaderplug: copying %s to the mirror %s failed (%s); the download itself "
                "is complete",
                options["repo_id"],
                mirror,
                exc,
            )
    return result


# -- where things are ----------------------------------------------------------------


def _cache_folder(options: dict[str, Any]) -> Path:
    """The repo's folder in the local cache, resolved as the original resolves it."""
    cache_dir = Path(options.get("cache_dir") or constants.HF_HUB_CACHE).expanduser().resolve()
    name = repo_folder_name(repo_id=options["repo_id"], repo_type=hub_commits.repo_type(options))
    return cache_dir / name


def _mirror_for(options: dict[str, Any], settings: Settings) -> Path | None:
    """The mirror's folder for this repo (``<hub root>/models--org--name``), or None,
    also when the local cache is the mirror itself (``HF_HOME`` on the volume)."""
    request = MirrorRequest("hub", options["repo_id"], _revision(options))
    root = Plugins(settings).find_mirror(request)
    if root is None:
        return None
    name = repo_folder_name(repo_id=options["repo_id"], repo_type=hub_commits.repo_type(options))
    mirror = root / name
    if options.get("local_dir") is None and mirror.resolve() == _cache_folder(options):
        return None
    return mirror


def _wanted(paths: Iterable[str], options: dict[str, Any]) -> list[str]:
    """The repo paths the call's allow/ignore patterns select."""
    return list(
        filter_repo_objects(
            items=list(paths),
            allow_patterns=options.get("allow_patterns"),
            ignore_patterns=options.get("ignore_patterns"),
        )
    )


def _chooser(call: _Call) -> Callable[[Iterable[str]], list[str]]:
    """The repo paths a call asks the mirror for, out of a commit's paths."""
    if call.file is not None:
        file = call.file
        return lambda paths: [file] if file in set(paths) else []

    def choose(paths: Iterable[str]) -> list[str]:
        paths = list(paths)
        chosen = _wanted(paths, call.options)
        if chosen or call.options.get("local_dir") is not None:
            return chosen
        # A lookup of the snapshot's path alone (vLLM's, offline: ignore_patterns="*")
        # gets a snapshot a loader can use: its files other than weights.
        return list(filter_repo_objects(items=paths, ignore_patterns=list(WEIGHT_PATTERNS)))

    return choose


def _keep_local_ref(options: dict[str, Any], commit: str, *, fsync: bool) -> None:
    """Point the local cache's ``refs/<branch>`` at the commit a download was pinned to
    (the original writes no ref for a pinned revision), so huggingface_hub's own lookups
    by branch find it offline."""
    ref = hub_commits.ref_name(options)
    if options.get("local_dir") is not None or ref is None:
        return
    folder = _cache_folder(options)
    if (folder / "snapshots" / commit).is_dir():
        hub_mirror.write_ref(folder, ref, commit, fsync=fsync)


# -- mirror -> local -----------------------------------------------------------------


class _NotInCommit(Exception):
    """The mirror's listing of the pinned commit has no such file: the Hub would answer
    404, so the call is answered so without asking it."""

    def __init__(self, call: _Call, commit: str, mirror: Path) -> None:
        super().__init__(call.file)
        self.call, self.commit, self.mirror = call, commit, mirror

    def error(self) -> BaseException:
        """What stock ``hf_hub_download`` raises for a 404, with ``.no_exist/`` recorded
        as it records it (transformers then skips the file without a call)."""
        import httpx2  # huggingface_hub's HTTP client

        options, file = self.call.options, str(self.call.file)
        if options.get("local_dir") is None:
            marker = _cache_folder(options) / ".no_exist" / self.commit / file
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
            f"(the file listing of that commit on the mirror {self.mirror} says so)"
        )
        return seam.remote_entry_not_found_error()(message, response=response)


@dataclass
class _Served:
    """What the mirror can give a call: the selection, and how it was made."""

    selection: hub_mirror.Selection
    listed: bool  # a listing backs the selection (the mirror's, or the Hub's)
    fetched: dict[str, dict[str, object]] | None = None  # a listing fetched from the Hub
    stored: bool = True  # the mirror holds the listing (the hydrate copies it)
    unchecked: str = ""  # why the snapshot is served with no listing to check it against


def _from_mirror(mirror: Path, call: _Call, commit: str, settings: Settings) -> str | None:
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
    if served.listed and settings.sync:
        _complete_mirror_snapshot(mirror, selection)
    if local_dir is not None:
        _record_local_dir_downloads(target, selection)
        where = Path(os.path.realpath(target))
    else:
        where = target / "snapshots" / commit
        where.mkdir(parents=True, exist_ok=True)  # a selection of nothing: an empty one
        _keep_local_ref(options, commit, fsync=settings.fsync)
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
        target = _cache_folder(options)
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
        left_out = f"; left out {len(refused)} file(s) ({_some(refused)})" if refused else ""
        _say_once(
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
        _say_once(
            mirror,
            options,
            "could not serve",
            "loaderplug: the mirror could not serve %d file(s) of %s (%s); downloading them",
            len(selection.refused),
            options["repo_id"],
            _some(selection.refused),
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
    mirror: Path, call: _Call, commit: str, settings: Settings
) -> _Served | None:
    """The files of this call the mirror holds at ``commit``, or None (said why) where it
    cannot serve it. A snapshot without a listing (a mirror written before
    huggingface_hub 1.22 kept them) gets its listing from the Hub, with one request, kept
    on the mirror for the next worker; where the Hub cannot give it, the snapshot is
    served as it is."""
    options = call.options
    choose = _chooser(call)
    if not mirror.is_dir():
        _skip(mirror, options, f"it holds no {mirror.name}")
        return None
    listing, problem = hub_mirror.inspect_listing(mirror, commit)
    if listing is not None:
        if call.file is not None and call.file not in listing:
            raise _NotInCommit(call, commit, mirror)
        return _Served(hub_mirror.check_selection(mirror, commit, choose(listing), listing), True)
    if problem != hub_mirror.NO_LISTING:
        _skip(mirror, options, f"commit {commit}: {problem}")
        return None
    if not (mirror / "snapshots" / commit).is_dir():
        revision = _revision(options)
        held = hub_mirror.resolve_commit(mirror, revision)
        if held is None:
            why = f"it holds no ref {revision!r} (refs/{revision}) nor commit {commit}"
        else:
            why = f"it holds no snapshot of commit {commit}" + (
                f" (its {revision} is {held})" if held != commit else ""
            )
        _skip(mirror, options, why)
        return None
    fetched, unchecked = hub_commits.fetch_listing(commit, options)
    if fetched is not None:
        listing, problem = hub_mirror.parse_listing(
            {"format_version": seam.LISTING_FORMAT, "files": fetched}
        )
        if listing is None:
            _skip(mirror, options, f"the Hub's listing of commit {commit} {problem}")
            return None
        stored = _store_listing(mirror, commit, fetched, options, settings)
        selection = hub_mirror.check_selection(mirror, commit, choose(listing), listing)
        return _Served(selection, listed=True, fetched=fetched, stored=stored)
    selection = hub_mirror.snapshot_selection(mirror, commit, choose)
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
    _say_once(
        mirror,
        options,
        why,
        "loaderplug: not using the mirror %s for %s: %s; %s",
        mirror,
        hub_commits.RepoRevision.of(options),
        why,
        then,
    )


_said: set[tuple[str, str, str]] = set()
_said_lock = threading.Lock()


def _say_once(mirror: Path, options: dict[str, Any], why: str, message: str, *args: Any) -> None:
    """One warning per mirror, repo and reason in a process: a load makes many calls (a
    config, a tokenizer, each shard) that would each say the same."""
    key = (str(mirror), str(options["repo_id"]), why)
    with _said_lock:
        if key in _said:
            return
        _said.add(key)
    log.warning(message, *args)


def _some(refused: dict[str, str]) -> str:
    """The first few refused files and why, for a message that gives their number."""
    some = "; ".join(f"{p}: {why}" for p, why in list(refused.items())[:3])
    return some + (f"; and {len(refused) - 3} more" if len(refused) > 3 else "")


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


def _offer_to_the_mirror(options: dict[str, Any], found: Path | None) -> None:
    """Have the mirror filled from the local cache (:mod:`.hub_fill`), in the background,
    with the commit a lookup found (``found``, a file of its snapshot) or the call's
    revision names in the cache. Never fails the call."""
    try:
        settings = from_env()
        mirror = _mirror_for(options, settings)
        if mirror is None or not settings.sync:
            return
        cache = _cache_folder(options)
        revision = _revision(options)
        commit = (
            _snapshot_commit(cache, found) if found else hub_mirror.resolve_commit(cache, revision)
        )
        if commit is not None:
            hub_fill.offer(hub_fill.LocalCommit(cache, mirror, commit))
    except Exception as exc:  # the call was answered: the mirror's fill is a bonus
        log.warning("loaderplug: the mirror will not be filled from the local cache: %s", exc)


def _snapshot_commit(cache: Path, found: Path) -> str | None:
    """The commit of a file found in ``cache/snapshots/<commit>/``."""
    try:
        commit = found.relative_to(cache / "snapshots").parts[0]
    except (ValueError, IndexError):
        return None
    return commit if hub_mirror.COMMIT.match(commit) else None


def _to_mirror(mirror: Path, call: _Call, commit: str | None, settings: Settings) -> None:
    """Copy what the call downloaded to the mirror (blobs, links, listing, then the ref).
    A single file's download leaves no listing behind: it is fetched (once per commit
    and process) and kept beside the file, as a snapshot download would have."""
    options = call.options
    local_dir = options.get("local_dir")
    revision = _revision(options)
    if local_dir is not None:
        source = Path(local_dir).expanduser().resolve()
        commit = commit or (revision if hub_mirror.COMMIT.match(revision) else None)
        commit = commit or _local_dir_commit(source)
        listing_folder = source / seam.LOCAL_DIR_META
    else:
        source = _cache_folder(options)
        commit = commit or hub_mirror.resolve_commit(source, revision)
        listing_folder = source
    if commit is None:
        raise RuntimeError(f"cannot tell which commit {revision!r} was downloaded")
    if call.file is not None and hub_mirror.read_listing(listing_folder, commit) is None:
        fetched, why = hub_commits.fetch_listing(commit, options)
        if fetched is None:
            raise RuntimeError(f"no file listing of commit {commit} to fill it with ({why})")
        hub_mirror.write_listing(listing_folder, commit, fetched, fsync=settings.fsync)
    choose = _chooser(call) if call.file is not None else (lambda ps: _wanted(ps, options))
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


# -- for loaders ---------------------------------------------------------------------


def pinned_commit(repo_id: str, revision: str | None, settings: Settings) -> str | None:
    """The commit this process loads ``repo_id`` at (see :mod:`.hub_commits`), or None
    where neither the Hub nor the mirror can say."""
    options: dict[str, Any] = {"repo_id": repo_id, "revision": revision}
    return hub_commits.pinned(options, _mirror_for(options, settings), settings)


def offline() -> bool:
    return bool(constants.HF_HUB_OFFLINE)


def download_weights(
    repo_id: str, revision: str | None, commit: str | None, patterns: list[str]
) -> Path:
    """The local snapshot holding the files ``patterns`` select, downloaded at ``commit``
    where it is known (from the mirror, or the Hub, which fills the mirror)."""
    pinned = revision
    if commit is not None:
        pinned = seam.resolved_revision()(commit, revision, repo_id, None)
    return Path(snapshot_download(repo_id, revision=pinned, allow_patterns=patterns))


# -- install -------------------------------------------------------------------------

# References that stay the originals: huggingface_hub's snapshot module calls
# hf_hub_download once per file it fetches, and its local_dir download looks in the
# cache with try_to_load_from_cache; both are inside a call already routed here.
_KEEP_ORIGINAL = {
    ("huggingface_hub._snapshot_download", "hf_hub_download"),
    ("huggingface_hub.file_download", "try_to_load_from_cache"),
}


def _wrappers() -> dict[Callable[..., Any], Callable[..., Any]]:
    """Each original, and what takes its place."""
    return {
        original_snapshot_download: snapshot_download,
        original_hf_hub_download: hf_hub_download,
        original_try_to_load_from_cache: try_to_load_from_cache,
    }


def install() -> None:
    """Route ``snapshot_download``, ``hf_hub_download`` and ``try_to_load_from_cache``
    through loaderplug in every namespace holding an original: the ``huggingface_hub``
    package, its ``_snapshot_download`` and ``file_download`` modules (which ``HfApi``'s
    methods import them from at call time), and modules that imported the names earlier
    (transformers, vLLM); and guard huggingface_hub's HTTP client, so a Hub that does not
    answer costs one timeout (:mod:`.hub_outage`). Idempotent; :func:`uninstall` undoes
    it."""
    if _installed:
        return
    _guard_the_client()
    ours = _wrappers()
    for original in ours:
        getattr(huggingface_hub, original.__name__)  # resolve the lazy attributes first
    for module in list(sys.modules.values()):
        if module is sys.modules[__name__]:  # our own references to the originals stay
            continue
        for name, original in _names_holding_originals(module, ours):
            if (module.__name__, name) in _KEEP_ORIGINAL:
                continue
            setattr(module, name, ours[original])
            _installed.append((module, name, original))
    for original, wrapper in ours.items():
        if getattr(huggingface_hub, original.__name__) is not wrapper:
            setattr(huggingface_hub, original.__name__, wrapper)
            _installed.append((huggingface_hub, original.__name__, original))


_factories: list[Callable[[], Any]] = []  # the client factory the guard wraps


def _guard_the_client() -> None:
    """huggingface_hub's shared client from now on: made by the factory in place (its
    default, or the program's own), its requests for repos the mirror holds guarded."""
    made_by = seam.client_factory()

    def guarded() -> Any:
        timeout_s = from_env().hub_timeout_s
        unreachable = seam.unreachable_errors()[:2]  # the connection's and the timeout's
        return hub_outage.guard(
            made_by(), _mirror_holds, timeout_s, seam.offline_mode_error(), unreachable
        )

    seam.set_client_factory()(guarded)  # the shared client in use so far is closed
    _factories.append(made_by)


def _mirror_holds(repo_type: str, repo_id: str) -> bool:
    """Whether the mirror holds the repo (some commit of it), so that a Hub out of reach
    is no reason to wait."""
    try:
        mirror = _mirror_for({"repo_id": repo_id, "repo_type": repo_type}, from_env())
    except Exception:  # a bad setting is said where it matters: at the download
        return False
    return mirror is not None and (mirror / "refs").is_dir()


def _names_holding_originals(
    module: Any, originals: dict[Callable[..., Any], Callable[..., Any]]
) -> list[tuple[str, Callable[..., Any]]]:
    """The names in ``module`` bound to one of ``originals``, compared by identity: a
    module's values may be lazy objects that import things when hashed or compared."""
    try:
        namespace = vars(module)
    except TypeError:
        return []
    by_id = {id(original): original for original in originals}
    return [
        (name, by_id[id(value)]) for name, value in list(namespace.items()) if id(value) in by_id
    ]


def uninstall() -> None:
    """Put the originals back wherever :func:`install` replaced them."""
    while _factories:
        seam.set_client_factory()(_factories.pop())
    wrappers = set(_wrappers().values())
    while _installed:
        module, name, original = _installed.pop()
        if getattr(module, name, None) in wrappers:
            setattr(module, name, original)


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
