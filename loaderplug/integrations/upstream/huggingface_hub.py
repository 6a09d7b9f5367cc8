"""huggingface_hub: the names and on-disk formats loaderplug relies on.

Used by :mod:`loaderplug.integrations.huggingface_hub` (the ``snapshot_download`` wrapper)
and :mod:`loaderplug.integrations.hub.mirror` (the mirror, in the Hub's cache layout).
The cache layout itself (``blobs/``, ``snapshots/``, ``refs/``) is documented; what
follows is not, or is the public API recorded with the versions it was checked in.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from loaderplug.integrations.upstream import Symbol, Upstream

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
# What stock snapshot_download (this module's, as it catches them) takes for the Hub being
# unreachable, and so serves its own cache instead; a proxy error it raises.
CONNECT_ERROR = Symbol(
    "huggingface_hub._snapshot_download",
    "httpx2.ConnectError",
    "a mirror snapshot without a listing is served unchecked when the Hub cannot be reached",
)
TIMEOUT_ERROR = Symbol(
    "huggingface_hub._snapshot_download",
    "httpx2.TimeoutException",
    "a mirror snapshot without a listing is served unchecked when the Hub times out",
)
PROXY_ERROR = Symbol(
    "huggingface_hub._snapshot_download",
    "httpx2.ProxyError",
    "a proxy error is not taken for an outage (stock snapshot_download raises it)",
)
HF_HUB_DOWNLOAD = Symbol(
    "huggingface_hub.file_download",
    "hf_hub_download",
    "the original hf_hub_download that loaderplug wraps; HfApi.hf_hub_download imports "
    "it from this module at call time, so install() rebinds it here",
)
# The cache-wide store of Xet-backed files (huggingface_hub >= 2.x): the mirror is read
# and filled through these, so a change of that layout fails a test, not a worker.
SHARED_BLOB_TARGET = Symbol(
    "huggingface_hub.utils._shared_blobs",
    "shared_blob_target",
    "a repo's blobs/<etag> that links into the cache-wide Xet store is followed there "
    "(and only there)",
)
IS_SHARED_BLOBS_DIR = Symbol(
    "huggingface_hub.utils._shared_blobs",
    "is_shared_blobs_dir",
    "a store is followed only when it carries huggingface_hub's marker",
)
SHARED_BLOBS_DIR = Symbol(
    "huggingface_hub.utils._shared_blobs",
    "shared_blobs_dir",
    "where a cache keeps its Xet store (<cache>/blobs)",
)
# Public API, recorded with the versions it was checked in.
VALIDATE_HF_HUB_ARGS = Symbol(
    "huggingface_hub.utils",
    "validate_hf_hub_args",
    "the wrappers check repo ids and drop legacy arguments exactly as the originals do",
    public=True,
)
RESOLVED_REVISION_CLASS = Symbol(
    "huggingface_hub",
    "ResolvedRevision",
    "a download the mirror cannot serve goes to the Hub pinned to the commit the load uses",
    public=True,
)
REPO_INFO = Symbol(
    "huggingface_hub",
    "HfApi.repo_info",
    "the one request per repo and process that learns which commit a branch names",
    public=True,
)
REPOSITORY_NOT_FOUND_ERROR = Symbol(
    "huggingface_hub.errors",
    "RepositoryNotFoundError",
    "the Hub says the repo does not exist (or is private): said once, the mirror answers",
    public=True,
)
TRY_TO_LOAD_FROM_CACHE = Symbol(
    "huggingface_hub.file_download",
    "try_to_load_from_cache",
    "the cache lookup vLLM makes before it asks the Hub for a repo's file list: a file "
    "the mirror holds is hydrated and found, so a worker starts with the Hub down",
)
CACHED_NO_EXIST = Symbol(
    "huggingface_hub.file_download",
    "_CACHED_NO_EXIST",
    "what try_to_load_from_cache answers for a file known not to exist at a commit",
)
REMOTE_ENTRY_NOT_FOUND_ERROR = Symbol(
    "huggingface_hub.errors",
    "RemoteEntryNotFoundError",
    "a file the mirror's listing of the pinned commit lacks is answered as the Hub "
    "answers it (and recorded in .no_exist/), with no request",
    public=True,
)
PUBLIC_HF_HUB_DOWNLOAD = Symbol(
    "huggingface_hub",
    "hf_hub_download",
    "the name most callers use; install() rebinds it",
    public=True,
)
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
LIST_REPO_TREE = Symbol(
    "huggingface_hub",
    "HfApi.list_repo_tree",
    "the listing of a commit a mirror written before the listing existed lacks (one call)",
    public=True,
)
REPO_FILE_FIELDS = tuple(
    Symbol(
        "huggingface_hub.hf_api",
        f"RepoFile.{field}",
        "a listing entry, as huggingface_hub writes it to trees/<commit>.json",
        public=True,
        instance=True,
    )
    for field in ("path", "size", "blob_id", "lfs", "xet_hash")
)
BLOB_LFS_FIELDS = tuple(
    Symbol(
        "huggingface_hub.hf_api",
        f"BlobLfsInfo.{field}",
        "the LFS part of a listing entry (lfs_sha256, lfs_size)",
        public=True,
        instance=True,
    )
    for field in ("sha256", "size")
)
OFFLINE_MODE_IS_ENABLED = Symbol(
    "huggingface_hub.errors",
    "OfflineModeIsEnabled",
    "a request refused by HF_HUB_OFFLINE: the Hub is taken as unreachable",
    public=True,
)
HF_HUB_HTTP_ERROR = Symbol(
    "huggingface_hub.errors",
    "HfHubHTTPError",
    "the Hub answered the listing request with an error: served unchecked, as stock does",
    public=True,
)
REVISION_NOT_FOUND_ERROR = Symbol(
    "huggingface_hub.errors",
    "RevisionNotFoundError",
    "the Hub says the mirror's commit does not exist: the mirror is not used",
    public=True,
)
RESOLVED_REVISION = Symbol(
    "huggingface_hub",
    "ResolvedRevision.resolved",
    "the commit a revision already resolved by huggingface_hub points at",
    public=True,
    instance=True,
)

CLIENT_FACTORY = Symbol(
    "huggingface_hub.utils._http",
    "_GLOBAL_CLIENT_FACTORY",
    "the factory of huggingface_hub's shared HTTP client (the default one, or one the "
    "program set): the hook wraps its clients so a hung Hub costs one timeout",
)
SET_CLIENT_FACTORY = Symbol(
    "huggingface_hub",
    "set_client_factory",
    "the hook's guarded client factory takes the place of the current one, and gives it "
    "back at uninstall",
    public=True,
)

SYMBOLS = (
    SNAPSHOT_DOWNLOAD,
    HF_HUB_DOWNLOAD,
    SHARED_BLOB_TARGET,
    IS_SHARED_BLOBS_DIR,
    SHARED_BLOBS_DIR,
    VALIDATE_HF_HUB_ARGS,
    RESOLVED_REVISION_CLASS,
    REPO_INFO,
    REPOSITORY_NOT_FOUND_ERROR,
    REMOTE_ENTRY_NOT_FOUND_ERROR,
    TRY_TO_LOAD_FROM_CACHE,
    CACHED_NO_EXIST,
    PUBLIC_HF_HUB_DOWNLOAD,
    WRITE_DOWNLOAD_METADATA,
    REPO_FOLDER_NAME,
    TREE_CACHE_FORMAT_VERSION,
    PUBLIC_SNAPSHOT_DOWNLOAD,
    FILTER_REPO_OBJECTS,
    DEFAULT_REVISION,
    HF_HUB_CACHE,
    HF_HUB_OFFLINE,
    RESOLVED_REVISION,
    CONNECT_ERROR,
    TIMEOUT_ERROR,
    PROXY_ERROR,
    LIST_REPO_TREE,
    *REPO_FILE_FIELDS,
    *BLOB_LFS_FIELDS,
    OFFLINE_MODE_IS_ENABLED,
    HF_HUB_HTTP_ERROR,
    REVISION_NOT_FOUND_ERROR,
    CLIENT_FACTORY,
    SET_CLIENT_FACTORY,
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


def hf_hub_download() -> Callable[..., Any]:
    """The ``hf_hub_download`` of ``huggingface_hub.file_download``, as it is now: after
    loaderplug's ``install()`` that is loaderplug's, so keep the first one."""
    return cast("Callable[..., Any]", UPSTREAM.get(HF_HUB_DOWNLOAD))


def try_to_load_from_cache() -> Callable[..., Any]:
    """``try_to_load_from_cache(repo_id, filename, cache_dir, revision, repo_type)``, as
    huggingface_hub defines it (kept before ``install()`` replaces it)."""
    return cast("Callable[..., Any]", UPSTREAM.get(TRY_TO_LOAD_FROM_CACHE))


def cached_no_exist() -> object:
    return UPSTREAM.get(CACHED_NO_EXIST)


def validate_hf_hub_args() -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The decorator of every download function: repo id checks, legacy arguments dropped."""
    return cast(
        "Callable[[Callable[..., Any]], Callable[..., Any]]", UPSTREAM.get(VALIDATE_HF_HUB_ARGS)
    )


def resolved_revision() -> Callable[..., str]:
    """``ResolvedRevision(resolved, initial, repo_id, repo_type)``: a ``str`` pinned to a commit."""
    return cast("Callable[..., str]", UPSTREAM.get(RESOLVED_REVISION_CLASS))


def shared_blob_target() -> Callable[[Path, Path], Path | None]:
    """``shared_blob_target(blob_path, cache_dir)``: the store file a managed link names."""
    return cast("Callable[[Path, Path], Path | None]", UPSTREAM.get(SHARED_BLOB_TARGET))


def is_shared_blobs_dir() -> Callable[[Path], bool]:
    return cast("Callable[[Path], bool]", UPSTREAM.get(IS_SHARED_BLOBS_DIR))


def shared_blobs_dir() -> Callable[[Path], Path]:
    return cast("Callable[[Path], Path]", UPSTREAM.get(SHARED_BLOBS_DIR))


def repository_not_found_error() -> type[BaseException]:
    return cast("type[BaseException]", UPSTREAM.get(REPOSITORY_NOT_FOUND_ERROR))


def remote_entry_not_found_error() -> Callable[..., BaseException]:
    """``RemoteEntryNotFoundError(message, response=...)``, an ``EntryNotFoundError``."""
    return cast("Callable[..., BaseException]", UPSTREAM.get(REMOTE_ENTRY_NOT_FOUND_ERROR))


def write_download_metadata() -> Callable[[Path, str, str, str], None]:
    """``write_download_metadata(local_dir, filename, commit_hash, etag)``."""
    return cast("Callable[[Path, str, str, str], None]", UPSTREAM.get(WRITE_DOWNLOAD_METADATA))


def repo_folder_name() -> Callable[..., str]:
    """``repo_folder_name(*, repo_id, repo_type)``."""
    return cast("Callable[..., str]", UPSTREAM.get(REPO_FOLDER_NAME))


def unreachable_errors() -> tuple[type[BaseException], ...]:
    """What stock ``snapshot_download`` takes for the Hub being out of reach (it then serves
    its own cache): a refused or failed connection, a timeout, ``HF_HUB_OFFLINE``."""
    return (
        cast("type[BaseException]", UPSTREAM.get(CONNECT_ERROR)),
        cast("type[BaseException]", UPSTREAM.get(TIMEOUT_ERROR)),
        cast("type[BaseException]", UPSTREAM.get(OFFLINE_MODE_IS_ENABLED)),
    )


def proxy_error() -> type[BaseException]:
    """A proxy that refused the request: stock ``snapshot_download`` raises it."""
    return cast("type[BaseException]", UPSTREAM.get(PROXY_ERROR))


def revision_not_found_error() -> type[BaseException]:
    return cast("type[BaseException]", UPSTREAM.get(REVISION_NOT_FOUND_ERROR))


def hub_http_error() -> type[BaseException]:
    """Any error answer of the Hub (a 5xx, a 401, a gated or unknown repo)."""
    return cast("type[BaseException]", UPSTREAM.get(HF_HUB_HTTP_ERROR))


def client_factory() -> Callable[[], Any]:
    """The factory huggingface_hub makes its shared ``httpx2.Client`` with, now."""
    return cast("Callable[[], Any]", UPSTREAM.get(CLIENT_FACTORY))


def set_client_factory() -> Callable[[Callable[[], Any]], None]:
    """``set_client_factory(factory)``: the next shared client is made by ``factory``."""
    return cast("Callable[[Callable[[], Any]], None]", UPSTREAM.get(SET_CLIENT_FACTORY))


def offline_mode_error() -> type[Exception]:
    """``OfflineModeIsEnabled``: a request refused as ``HF_HUB_OFFLINE`` refuses it."""
    return cast("type[Exception]", UPSTREAM.get(OFFLINE_MODE_IS_ENABLED))
