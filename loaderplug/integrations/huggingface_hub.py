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
   with no request to the Hub for a file. What the commit holds is the Hub's word
   where it answers (:mod:`.hub_serve`: its listing, once per commit and process; each
   file checked against the hash the Hub gives it as it is copied); offline, the
   mirror's listing, said to be unverified. A call whose patterns select nothing (vLLM's
   path lookup, ``ignore_patterns="*"``) gets the repo's files other than weights, so
   the snapshot it returns is one a loader can read a config from.
3. Otherwise the original runs at the pinned commit (fetching only what is missing),
   and what it downloaded is copied to the mirror, unless ``LOADERPLUG_SYNC=off``. The
   copy runs before the call returns: a short-lived worker that exited mid-copy would
   leave nothing usable, and the first worker pays for it once per model.
4. Any failure on the mirror path falls back to the original, and a failed copy to
   the mirror never fails the caller's download: each says its cause in one warning per
   repo (the traceback at debug). A mirror blob of the wrong size or content is
   refused, and that file is downloaded instead. A mirror that is skipped says why in
   one warning.

A call naming a repo, revision or file that is not plainly a path inside its folder
(``../x``, an absolute path; :mod:`.hub_names`) is the original's alone: it raises what
stock raises, and the hook writes nothing for it.

``try_to_load_from_cache`` stays the lookup its callers take it for: it asks the Hub
nothing and writes nothing to the mirror. Where the local cache answers, its answer is
the original's, and the commit it found is offered to the background fill of the
mirror (:mod:`.hub_fill`), which publishes only what the local cache can check against
its own listing. Where it does not, the mirror answers if it holds the file (at the
commit this process pinned, else the mirror's ref), as a cache would.

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
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from loaderplug.integrations.upstream import huggingface_hub as seam
from loaderplug.settings import Settings, from_env

try:
    from huggingface_hub import constants

    # The functions this module wraps, as huggingface_hub defines them.
    original_snapshot_download: Callable[..., Any] = seam.snapshot_download()
    original_hf_hub_download: Callable[..., Any] = seam.hf_hub_download()
    original_try_to_load_from_cache: Callable[..., Any] = seam.try_to_load_from_cache()
except ImportError as exc:  # pragma: no cover - the message is the point
    raise ImportError(
        "loaderplug.integrations.huggingface_hub needs huggingface_hub: "
        "pip install 'loaderplug[hf]'"
    ) from exc

from loaderplug.integrations.hub import bucket as hub_bucket
from loaderplug.integrations.hub import commits as hub_commits
from loaderplug.integrations.hub import fill as hub_fill
from loaderplug.integrations.hub import install as hub_install
from loaderplug.integrations.hub import serve as hub_serve
from loaderplug.integrations.hub import sync as hub_sync
from loaderplug.integrations.hub.calls import (
    WEIGHT_PATTERNS,
    Call,
    cache_folder,
    mirror_for,
    repo_path,
    unusable,
)
from loaderplug.integrations.hub.commits import offline as _offline
from loaderplug.integrations.hub.notices import cause, failed
from loaderplug.storage.object_urls import ObjectURL, is_object_url, redact

log = logging.getLogger(__name__)

__all__ = [
    "WEIGHT_PATTERNS",
    "download_weights",
    "hf_hub_download",
    "install",
    "installed",
    "is_installed",
    "offline",
    "original_hf_hub_download",
    "original_snapshot_download",
    "original_try_to_load_from_cache",
    "pinned_commit",
    "snapshot_download",
    "try_to_load_from_cache",
    "uninstall",
]


def _wrap(original: Callable[..., Any], file_call: bool) -> Callable[..., Any]:
    """A function with ``original``'s name, signature and decorator, that serves the call
    from the mirror when it can."""
    signature = inspect.signature(original)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)  # the original's TypeError for a bad call
        bound.apply_defaults()
        file = None
        if file_call:
            subfolder, name = bound.arguments.get("subfolder"), bound.arguments["filename"]
            # Joined as the original joins them, and checked as one name.
            name = f"{subfolder}/{name}" if subfolder else name
            if isinstance(name, str):
                file = repo_path(name)
        else:
            name = None
        call = Call(original, bound, file)
        if unusable(call.options, name):
            return call.run_original()  # stock's error (or stock's answer), nothing of ours
        return _download(call)

    functools.update_wrapper(wrapper, original)
    del wrapper.__wrapped__  # type: ignore[attr-defined]  # its signature is set below
    wrapper.__signature__ = signature  # type: ignore[attr-defined]
    wrapper.__module__ = __name__
    # The originals' own decorator: repo ids checked, legacy arguments (proxies, ...)
    # dropped with its warning, before the call is bound.
    validated = seam.validate_hf_hub_args()(wrapper)
    return validated


snapshot_download = _wrap(original_snapshot_download, file_call=False)
hf_hub_download = _wrap(original_hf_hub_download, file_call=True)


_LOOKUP_SIGNATURE = inspect.signature(original_try_to_load_from_cache)
_DOWNLOAD_SIGNATURE = inspect.signature(original_hf_hub_download)


@functools.wraps(original_try_to_load_from_cache)
def try_to_load_from_cache(*args: Any, **kwargs: Any) -> Any:
    """``huggingface_hub.try_to_load_from_cache``, still a lookup: no request to the Hub
    and no write to the mirror. A file the local cache holds is answered as stock
    answers it (its commit offered to the background fill of the mirror,
    :mod:`.hub_fill`); one it lacks and the mirror holds, at the commit this process
    uses or else the mirror's, is hydrated and its path returned (vLLM asks this before
    it lists a repo's files on the Hub, so a worker starts with the Hub down)."""
    found = original_try_to_load_from_cache(*args, **kwargs)
    asked = _LOOKUP_SIGNATURE.bind(*args, **kwargs)
    asked.apply_defaults()
    if unusable(asked.arguments, asked.arguments["filename"]):
        return found  # a name the hook would not use as a path: stock's answer alone
    if isinstance(found, str):
        hub_fill.offer(asked.arguments, Path(found))
    if found is not None:
        return found
    # The download that would have put the file in the cache, served by the mirror alone.
    as_download = _DOWNLOAD_SIGNATURE.bind(**asked.arguments)
    as_download.apply_defaults()
    file = repo_path(str(asked.arguments["filename"]))
    return _look_in_the_mirror(Call(original_hf_hub_download, as_download, file, lookup=True))


def _look_in_the_mirror(call: Call) -> Any:
    """A lookup the local cache could not answer, answered from the mirror if it can
    (None, as the original answered, where it cannot)."""
    mirror: Path | None = None
    try:
        settings = from_env()
        mirror = mirror_for(call.options, settings)
        commit = hub_commits.known(call.options, mirror) if mirror else None
        if mirror is None or commit is None:
            return None
        return hub_serve.from_mirror(mirror, call, commit, settings)
    except hub_serve.NotInCommit as absent:
        absent.error()  # records .no_exist/ as a download would
        return seam.cached_no_exist()
    except Exception as exc:  # a lookup never fails for the mirror's sake
        failed(
            "serve",
            call.options,
            exc,
            "loaderplug: the mirror %s could not answer a cache lookup of %s (%s); "
            "answered as the local cache answers",
            mirror or "(not found)",
            call.options["repo_id"],
            cause(exc),
        )
        return None


def _download(call: Call) -> Any:
    options = call.options
    if options.get("dry_run") or options.get("force_download"):
        hub_serve.say_bypassed(options)
        return call.run_original()
    bucket = _bucket_mirror()
    if bucket is not None:
        return _from_bucket(bucket, call)
    mirror: Path | None = None
    commit: str | None = None
    served: str | None = None
    try:
        settings = from_env()
        mirror = mirror_for(options, settings)
        if mirror is not None:
            commit = hub_commits.pinned(options, mirror, settings)
        if mirror is not None and commit is not None:
            served = hub_serve.from_mirror(mirror, call, commit, settings)
    except seam.revision_not_found_error():
        return call.run_original()  # the Hub's own error, as stock raises it
    except hub_serve.NotInCommit as absent:
        raise absent.error() from None
    except Exception as exc:
        failed(
            "serve",
            options,
            exc,
            "loaderplug: the mirror %s could not serve %s (%s); downloading it instead",
            mirror or "(not found)",
            options["repo_id"],
            cause(exc),
        )
        return call.run_original(commit)
    if mirror is None:  # no mirror: the call is the original's alone
        return call.run_original()
    if served is not None:
        return served
    result = call.run_original(commit)
    if commit is not None:
        _keep_local_ref(options, commit, settings)
    if settings.sync and _offline(options) and options.get("local_dir") is None:
        hub_fill.offer(options)  # what the local cache answered with
    if settings.sync and not _offline(options):
        try:
            hub_sync.to_mirror(mirror, call, commit, settings)
        except Exception as exc:
            failed(
                "fill",
                options,
                exc,
                "loaderplug: copying %s to the mirror %s failed (%s); the download itself "
                "is complete",
                options["repo_id"],
                mirror,
                cause(exc),
            )
    return result


def _bucket_mirror() -> str | None:
    """What LOADERPLUG_MIRROR says where it is a URL, or None (a volume, or no mirror)."""
    try:
        mirror = from_env().mirror
    except Exception:  # a bad setting is said where the volume mirror is looked for
        return None
    return mirror if mirror and is_object_url(mirror) else None


def _from_bucket(bucket: str, call: Call) -> Any:
    """A download served from the bucket where it holds the whole call, else the
    original's, pinned to the commit the rest of the process uses; a bucket out of
    reach, refusing, or named wrongly never fails the call."""
    commit: str | None = None
    settings: Settings | None = None
    try:
        url = ObjectURL.parse(bucket, variable="LOADERPLUG_MIRROR")
        settings = from_env()
        commit = hub_bucket.commit_for(url, call, settings)
        served = hub_bucket.from_bucket(url, call, settings, commit) if commit else None
    except seam.revision_not_found_error():
        return call.run_original()  # the Hub's own error, as stock raises it
    except Exception as exc:
        log.warning(
            "loaderplug: the bucket %s could not serve %s (%s); downloading it instead",
            redact(bucket),
            call.options["repo_id"],
            cause(exc),
        )
        served = None
    if served is not None:
        return served
    result = call.run_original(commit)
    if commit is not None and settings is not None:
        # Pinned, the original writes no ref: a later lookup by branch still finds it.
        _keep_local_ref(call.options, commit, settings)
    return result


def _keep_local_ref(options: dict[str, Any], commit: str, settings: Settings) -> None:
    hub_commits.keep_local_ref(cache_folder(options), options, commit, fsync=settings.fsync)


# -- for loaders ---------------------------------------------------------------------


def pinned_commit(repo_id: str, revision: str | None, settings: Settings) -> str | None:
    """The commit this process loads ``repo_id`` at (see :mod:`.hub_commits`), or None
    where neither the Hub nor the mirror can say."""
    options: dict[str, Any] = {"repo_id": repo_id, "revision": revision}
    if unusable(options):
        return None  # the download then goes to huggingface_hub, which says what is wrong
    return hub_commits.pinned(options, mirror_for(options, settings), settings)


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
    # This module's own references to the originals stay: the wrappers call them.
    hub_install.install(_wrappers(), sys.modules[__name__])


def uninstall() -> None:
    """Put the originals back wherever :func:`install` replaced them."""
    hub_install.uninstall(set(_wrappers().values()))


def is_installed() -> bool:
    return hub_install.is_installed()


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """``install()`` for the duration of a ``with`` block (no-op if already installed)."""
    owner = not is_installed()
    install()
    try:
        yield
    finally:
        if owner:
            uninstall()
