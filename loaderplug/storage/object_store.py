"""An object store's client: list, head, ranged GETs, uploads and conditional writes.

One small interface (:class:`ObjectStore`) over obstore, the client chosen by
measurement (docs/benchmarks.md, "Object store clients"): one client for S3, GCS and
Azure, its requests made in Rust with the GIL released, so the engine's reader threads
run in parallel. obstore is an extra (``pip install loaderplug[objectstore]``), imported
only when a URL is read.

Credentials and endpoints are the standard chains as the store's own tools read them:
AWS's environment (keys, session tokens, ``AWS_ENDPOINT_URL`` and
``AWS_ENDPOINT_URL_S3``, web identity, container and instance credentials,
``AWS_SKIP_SIGNATURE`` for public buckets) with ``AWS_PROFILE`` through boto3 where it
is installed, GCS's application default credentials, Azure's account key or default
credential; path-style requests (S3-compatible stores) unless
``AWS_VIRTUAL_HOSTED_STYLE_REQUEST`` says otherwise; ``AWS_CA_BUNDLE`` (or
``SSL_CERT_FILE``) as an extra root certificate.

Every failure becomes an ``OSError`` the engine knows: EAGAIN where the store asks for
less (429, 503 SlowDown), EIO where a retry may succeed (timeouts, resets, other 5xx),
EACCES, ENOENT, ENOSPC or EINVAL where it cannot; its text names the URL, redacted
(:func:`loaderplug.storage.object_urls.redact`), never a credential.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from loaderplug.storage.object_urls import ObjectURL, redact
from loaderplug.types import Identity

T = TypeVar("T")

try:  # numpy copies without the GIL (see copy_into); loaderplug does not need it
    import numpy as _numpy
except ImportError:  # pragma: no cover - numpy comes with torch
    _numpy = None  # type: ignore[assignment]

# The HTTP answers a retry may cure, and those that ask the client to slow down.
_SLOW_DOWN = frozenset({429, 503})
_STATUS = re.compile(r"status code: (\d{3})|\b(\d{3}) (?:Service Unavailable|Slow Down|Too Many)")
# Words of a failed transfer (no HTTP answer, or a body cut short) in the client's text.
_TRANSIENT_WORDS = (
    "timed out",
    "timeout",
    "reset",
    "connection",
    "error sending request",
    "error decoding response body",
    "incomplete",
    "broken pipe",
    "unexpected eof",
    "slowdown",
)
# A GET's body is handed over in pieces of at least this much (each a call holding the
# GIL): 4 MiB read a 2 GiB model in 4.8-4.9 s, steadier than 1 MiB (4.9-6.0 s).
STREAM_CHUNK = 4 * 1024 * 1024
# Uploads are cut into parts of this size, this many in flight per object.
PART_BYTES = 16 * 1024 * 1024
PARTS_IN_FLIGHT = 8


def copy_into(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src``, with the GIL released where numpy is there to copy: the copy
    into a tensor's fresh memory faults its pages in, and under the GIL every reader
    thread would wait for each fault (70% of a streaming load's GIL time, measured)."""
    if _numpy is None or len(dst) < 65536:
        dst[:] = src
        return
    _numpy.copyto(
        _numpy.frombuffer(dst, dtype=_numpy.uint8), _numpy.frombuffer(src, dtype=_numpy.uint8)
    )


# A call other than a span's read (a listing, a HEAD, a small object, an upload) is
# tried this often on a transient error, waiting a full-jitter backoff of up to
# CALL_BACKOFF_S x 2^attempt between tries: the engine retries spans itself.
CALL_ATTEMPTS = 4
CALL_BACKOFF_S = 0.2


def _retried(op: Callable[[], T]) -> T:
    for attempt in range(CALL_ATTEMPTS):
        try:
            return op()
        except OSError as exc:
            if exc.errno not in (errno.EIO, errno.EAGAIN) or attempt + 1 == CALL_ATTEMPTS:
                raise
            time.sleep(random.uniform(0, CALL_BACKOFF_S * 2**attempt))
    raise AssertionError("unreachable: CALL_ATTEMPTS is at least 1")


class ObjectChanged(Exception):
    """An object was replaced after it was listed (its ETag no longer matches)."""


@dataclass(frozen=True)
class ObjectInfo:
    """One object under a URL: its key relative to the URL's prefix, and its version."""

    rel: str
    size: int
    etag: str
    mtime_ns: int

    def identity(self) -> Identity:
        return Identity(self.size, self.mtime_ns, 0, etag=self.etag)


class ObjectStore:
    """A bucket's client; its methods take keys under the bucket (not the prefix)."""

    def __init__(self, url: ObjectURL, timeout_s: float) -> None:
        self.url = url.root
        obstore_store = _obstore().store
        # Ranged reads are retried by the engine, span by span, with its own backoff;
        # the other calls by the client.
        self._reads = _make_store(obstore_store, self.url, timeout_s, retries=0)
        self._calls = _make_store(obstore_store, self.url, timeout_s, retries=3)

    def list(self, prefix: str, *, retried: bool = True) -> list[ObjectInfo]:
        """Every object under ``prefix`` (a key prefix ending at a ``/``, or ``""``);
        without ``retried``, one attempt."""
        return _retried(lambda: self._list(prefix)) if retried else self._list(prefix)

    def _list(self, prefix: str) -> builtins.list[ObjectInfo]:  # list: the method above
        below = f"{prefix}/" if prefix else ""
        objects = []
        with self._errors(prefix):
            for batch in _obstore().list(self._calls, prefix=prefix or None):
                for meta in batch:
                    path = str(meta["path"])
                    if below and not path.startswith(below):
                        continue  # a sibling sharing the prefix's first letters
                    objects.append(_info(path[len(below) :], meta))
        return objects

    def head(self, key: str) -> ObjectInfo:
        return _retried(lambda: self._head(key))

    def _head(self, key: str) -> ObjectInfo:
        with self._errors(key):
            return _info(key, _obstore().head(self._calls, key))

    def read_into(self, key: str, offset: int, buf: memoryview, etag: str) -> int:
        """One ranged GET of ``len(buf)`` bytes at ``offset`` of version ``etag``."""
        done = 0
        for chunk in self.stream(key, offset, len(buf), etag):
            view = memoryview(chunk).cast("B")
            copy_into(buf[done : done + len(view)], view)
            done += len(view)
        return done

    def stream(self, key: str, offset: int, length: int, etag: str) -> Iterator[Any]:
        """The bytes of one ranged GET as they arrive, each chunk a buffer; raises
        :class:`ObjectChanged` where the object is no longer version ``etag``."""
        options: dict[str, Any] = {"range": (offset, offset + length)}
        if etag:
            options["if_match"] = f'"{etag}"'
        ob = _obstore()
        with self._errors(key):
            result = ob.get(self._reads, key, options=options)
            yield from result.stream(min_chunk_size=STREAM_CHUNK)

    def put_file(self, key: str, path: str) -> None:
        """Upload ``path`` as ``key``: in parallel parts above one part's size, the
        object appearing whole or not at all (an interrupted upload is aborted)."""
        _retried(lambda: self._put_file(key, path))

    def _put_file(self, key: str, path: str) -> None:
        with open(path, "rb") as file, self._errors(key):
            _obstore().put(
                self._calls,
                key,
                file,
                chunk_size=PART_BYTES,
                max_concurrency=PARTS_IN_FLIGHT,
            )

    def put_bytes(self, key: str, data: bytes, *, if_absent: bool = False) -> bool:
        """Write ``data`` as ``key``; with ``if_absent``, only where no object bears
        the key yet (False: one does)."""
        return _retried(lambda: self._put_bytes(key, data, if_absent))

    def _put_bytes(self, key: str, data: bytes, if_absent: bool) -> bool:
        ob = _obstore()
        with self._errors(key):
            try:
                ob.put(self._calls, key, data, mode="create" if if_absent else "overwrite")
            except ob.exceptions.AlreadyExistsError:
                return False
            except ob.exceptions.PreconditionError:
                return False
        return True

    def get_bytes(self, key: str) -> bytes:
        return _retried(lambda: self._get_bytes(key))

    def _get_bytes(self, key: str) -> bytes:
        with self._errors(key):
            return bytes(_obstore().get(self._calls, key).bytes())

    def delete(self, key: str) -> None:
        _retried(lambda: self._delete(key))

    def _delete(self, key: str) -> None:
        # Gone already is deleted: a retry after a delete whose answer was lost (GCS and
        # Azure answer 404 where S3 answers 204).
        with contextlib.suppress(FileNotFoundError), self._errors(key):
            _obstore().delete(self._calls, key)

    def _errors(self, key: str) -> _AsOSError:
        return _AsOSError(str(self.url.child(key)) if key else str(self.url))


class _AsOSError:
    """Turns the client's errors into ``OSError`` naming ``url`` (see the module)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        # Only the client's calls run inside: every error but a Ctrl-C is its.
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, ObjectChanged):
            return
        raise as_os_error(exc, self.url) from None


def as_os_error(exc: BaseException, url: str) -> BaseException:
    """The ``OSError`` (or :class:`ObjectChanged`) a client error means for ``url``."""
    ob = _obstore()
    text = str(exc)
    first = redact(text.split("\n", 1)[0])[:300]
    status = _status_of(text)
    if isinstance(exc, ob.exceptions.PreconditionError) or status == 412:
        return ObjectChanged(f"{url} was replaced while being read (its ETag changed)")
    if isinstance(exc, FileNotFoundError) or status == 404:
        what = "the bucket does not exist" if "NoSuchBucket" in text else "no such object"
        return FileNotFoundError(errno.ENOENT, f"{what} ({first})", url)
    if isinstance(
        exc, (ob.exceptions.PermissionDeniedError, ob.exceptions.UnauthenticatedError)
    ) or status in (401, 403):
        return PermissionError(
            errno.EACCES,
            f"access denied: check the credentials and the bucket's policy ({first})",
            url,
        )
    if status in _SLOW_DOWN or "SlowDown" in text:
        return OSError(errno.EAGAIN, f"the store asks to slow down ({status or 'SlowDown'})", url)
    if status == 507 or "QuotaExceeded" in text or "InsufficientStorage" in text:
        return OSError(errno.ENOSPC, f"the store is full or over its quota ({first})", url)
    lowered = text.lower()
    if (status is not None and status >= 500) or any(w in lowered for w in _TRANSIENT_WORDS):
        return OSError(errno.EIO, f"the store's answer failed ({first})", url)
    return OSError(errno.EINVAL, f"the store refused the request ({first})", url)


def _status_of(text: str) -> int | None:
    match = _STATUS.search(text)
    if match is None:
        return None
    return int(match[1] or match[2])


def _info(rel: str, meta: Any) -> ObjectInfo:
    modified = meta["last_modified"]
    mtime_ns = int(modified.timestamp()) * 1_000_000_000 + modified.microsecond * 1000
    # One spelling for every call: a store may quote an ETag in one answer (a HEAD's
    # header) and not in another (a listing's XML), as Azure does. A weak ETag is no
    # validator: If-Match compares strongly (see NO_ETAG).
    raw = str(meta.get("e_tag") or "")
    etag = "" if raw.startswith("W/") else raw.strip('"')
    return ObjectInfo(rel, int(meta["size"]), etag, mtime_ns)


# Why an object with no strong ETag is not read: nothing would tell its versions apart.
NO_ETAG = "the store gives it no strong ETag, so its version cannot be checked on each range"


def _obstore() -> Any:
    try:
        import obstore
        import obstore.exceptions
        import obstore.store
    except ImportError as exc:
        raise ImportError(
            "reading s3://, gs:// or az:// needs loaderplug's object store extra: "
            "pip install 'loaderplug[objectstore]'"
        ) from exc
    return obstore


def _make_store(module: Any, url: ObjectURL, timeout_s: float, *, retries: int) -> Any:
    from datetime import timedelta

    client: dict[str, Any] = {
        "connect_timeout": f"{min(10.0, timeout_s)}s",
        "read_timeout": f"{timeout_s}s",
        "timeout": "3600s",  # a whole request: a 64 MiB range at a slow store
        "pool_max_idle_per_host": "64",
    }
    retry = {"max_retries": retries, "retry_timeout": timedelta(seconds=max(timeout_s, 1) * 4)}
    extra = _certificate()
    if extra:
        client["root_certificate"] = extra
    if url.store == "s3":
        return _s3_store(module, url, client, retry)
    if url.store == "gcs":
        return module.GCSStore(url.bucket, client_options=client, retry_config=retry)
    return module.AzureStore(url.bucket, client_options=client, retry_config=retry)


def _s3_store(module: Any, url: ObjectURL, client: dict[str, Any], retry: dict[str, Any]) -> Any:
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config: dict[str, Any] = {}
    if endpoint:
        config["endpoint"] = endpoint
        client["allow_http"] = endpoint.startswith("http://")
    provider = _profile_credentials()
    return module.S3Store(
        url.bucket,
        config=config,
        client_options=client,
        retry_config=retry,
        credential_provider=provider,
    )


def _profile_credentials() -> Any:
    """boto3's credential chain where a profile is named (obstore reads no profiles)."""
    if not os.environ.get("AWS_PROFILE") or os.environ.get("AWS_ACCESS_KEY_ID"):
        return None
    try:
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return None
    return Boto3CredentialProvider()


def _certificate() -> str:
    for variable in ("AWS_CA_BUNDLE", "SSL_CERT_FILE", "REQUESTS_CA_BUNDLE"):
        path = os.environ.get(variable)
        if path and os.path.isfile(path):
            with open(path) as file:
                return file.read()
    return ""


_stores: dict[tuple[str, float, tuple[tuple[str, str], ...]], ObjectStore] = {}
_stores_lock = threading.Lock()


def store_for(url: ObjectURL, timeout_s: float) -> ObjectStore:
    """The client of ``url``'s bucket, one per process (and per environment: a changed
    credential or endpoint makes a new one)."""
    seen = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES)))
    key = (str(url.root), timeout_s, seen)
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = ObjectStore(url, timeout_s)
        return store


_ENV_PREFIXES = ("AWS_", "GOOGLE_", "AZURE_", "SSL_CERT", "REQUESTS_CA")


def describe_client(url: ObjectURL) -> str:
    """Where ``url``'s requests go and with which credentials, by the variables' names
    (never their values): for ``doctor``."""
    if url.store == "s3":
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        where = f"endpoint {redact(endpoint)}, path-style" if endpoint else "AWS's endpoint"
        if os.environ.get("AWS_SKIP_SIGNATURE", "").lower() in ("1", "true"):
            who = "unsigned (AWS_SKIP_SIGNATURE)"
        elif os.environ.get("AWS_ACCESS_KEY_ID"):
            token = " and AWS_SESSION_TOKEN" if os.environ.get("AWS_SESSION_TOKEN") else ""
            who = f"AWS_ACCESS_KEY_ID{token} from the environment"
        elif os.environ.get("AWS_WEB_IDENTITY_TOKEN_FILE"):
            who = "web identity (AWS_ROLE_ARN, AWS_WEB_IDENTITY_TOKEN_FILE)"
        elif os.environ.get("AWS_PROFILE"):
            who = f"profile {os.environ['AWS_PROFILE']} (boto3's chain)"
        else:
            who = "container or instance credentials"
        return f"{where}; credentials: {who}"
    if url.store == "gcs":
        who = (
            "GOOGLE_APPLICATION_CREDENTIALS"
            if os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
            else "application default credentials"
        )
        return f"credentials: {who}"
    who = (
        "AZURE_STORAGE_ACCOUNT_KEY"
        if os.environ.get("AZURE_STORAGE_ACCOUNT_KEY")
        else "Azure's default credential"
    )
    account = os.environ.get("AZURE_STORAGE_ACCOUNT_NAME", "(AZURE_STORAGE_ACCOUNT_NAME unset)")
    return f"account {account}; credentials: {who}"
