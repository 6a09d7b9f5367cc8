"""huggingface_hub: the names and on-disk formats loaderplug relies on.

Used by :mod:`loaderplug.integrations.huggingface_hub` (the ``snapshot_download`` wrapper)
and :mod:`loaderplug.integrations.hub_mirror` (the mirror, in the Hub's cache layout).
The cache layout itself (``blobs/``, ``snapshots/``, ``refs/``) is documented; what
follows is not, or is the public API recorded with the versions it was checked in.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from . import Symbol, Upstream

# 2.4 keeps each commit's file listing (trees/<commit>.json), which the mirror relies on.
OLDEST = (2, 4)
NEWEST_CHECKED = "2.4.0"

# -- on-disk formats, written and read as huggingface_hub does ---------------------------

# The ``format_version`` of ``trees/<commit>.json`` (checked: TREE_CACHE_FORMAT_VERSION).
LISTING_FORMAT = 1
# Where a ``local_dir`` download keeps huggingface_hub's bookkeeping: the listing under
# ``trees/``, and ``download/<path>.metadata`` (commit, etag, time) for each file.
LOCAL_DIR_META = ".cache/huggingface"
LOCAL_DIR_DOWNLOADS = f"{LOCAL_DIR_META}/download"

# -- the symbols ------------------------------------------------------------------------

SNAPSHOT_DOWNLOAD = Symbol(
    "huggingface_hub._snapshot_download",
    "snapshot_download",
    "the original snapshot_download that loaderplug wraps; HfApi.snapshot_download looks "
    "it up in this module, so install() rebinds it here",
)
WRITE_DOWNLOAD_METADATA = Symbol(
    "huggingface_hub._local_folder",
    "write_download_metadata",
    "a local_dir hydrated from the mirror records its files as current, so "
    "huggingface_hub does not download them again",
)
REPO_FOLDER_NAME = Symbol(
    "huggingface_hub.file_download",
    "repo_folder_name",
    "the cache folder name of a repo (models--org--name), on the mirror as in the cache",
)
TREE_CACHE_FORMAT_VERSION = Symbol(
    "huggingface_hub._tree_cache",
    "TREE_CACHE_FORMAT_VERSION",
    "the format of trees/<commit>.json, the file listing the mirror reads and copies",
    value=LISTING_FORMAT,
)
# Public API, recorded with the versions it was checked in.
PUBLIC_SNAPSHOT_DOWNLOAD = Symbol(
    "huggingface_hub",
    "snapshot_download",
    "the name most callers use; install() rebinds it",
    public=True,
)
FILTER_REPO_OBJECTS = Symbol(
    "huggingface_hub.utils",
    "filter_repo_objects",
    "the files a call's allow_patterns and ignore_patterns select",
    public=True,
)
DEFAULT_REVISION = Symbol(
    "huggingface_hub.constants",
    "DEFAULT_REVISION",
    "the revision of a call that names none",
    public=True,
)
HF_HUB_CACHE = Symbol(
    "huggingface_hub.constants",
    "HF_HUB_CACHE",
    "the local cache of a call that names no cache_dir",
    public=True,
)
HF_HUB_OFFLINE = Symbol(
    "huggingface_hub.constants",
    "HF_HUB_OFFLINE",
    "an offline download is not copied to the mirror",
    public=True,
)
RESOLVED_REVISION = Symbol(
    "huggingface_hub",
    "ResolvedRevision.resolved",
    "the commit a revision already resolved by huggingface_hub points at",
    public=True,
    instance=True,
)

SYMBOLS = (
    SNAPSHOT_DOWNLOAD,
    WRITE_DOWNLOAD_METADATA,
    REPO_FOLDER_NAME,
    TREE_CACHE_FORMAT_VERSION,
    PUBLIC_SNAPSHOT_DOWNLOAD,
    FILTER_REPO_OBJECTS,
    DEFAULT_REVISION,
    HF_HUB_CACHE,
    HF_HUB_OFFLINE,
    RESOLVED_REVISION,
)
UPSTREAM = Upstream("huggingface_hub", OLDEST, NEWEST_CHECKED, SYMBOLS)


def version() -> str:
    return UPSTREAM.version()


def missing() -> list[str]:
    """One message for each symbol the installed huggingface_hub lacks."""
    return UPSTREAM.missing()


def snapshot_download() -> Callable[..., Any]:
    """The ``snapshot_download`` of ``huggingface_hub._snapshot_download``, as it is now:
    after loaderplug's ``install()`` that is loaderplug's, so keep the first one."""
    return cast("Callable[..., Any]", UPSTREAM.get(SNAPSHOT_DOWNLOAD))


def write_download_metadata() -> Callable[[Path, str, str, str], None]:
    """``write_download_metadata(local_dir, filename, commit_hash, etag)``."""
    return cast("Callable[[Path, str, str, str], None]", UPSTREAM.get(WRITE_DOWNLOAD_METADATA))


def repo_folder_name() -> Callable[..., str]:
    """``repo_folder_name(*, repo_id, repo_type)``."""
    return cast("Callable[..., str]", UPSTREAM.get(REPO_FOLDER_NAME))
