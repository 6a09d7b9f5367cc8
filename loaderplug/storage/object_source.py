"""Objects as sources: what the engine reads an object store's files through.

:class:`ObjectFiles` is a job's objects: it lists them (under a URL's prefix, or each
URL with a HEAD), keeps the version each was listed at, and is the job's opener: an
:class:`ObjectSource` reads one object by ranged GETs, each asked with ``If-Match`` on
the listed ETag, so an object replaced mid-read fails as changed and never mixes two
versions. A reader says which span it reads next (:meth:`ObjectSource.will_read`): the
span is then one GET whose body the reader's steps consume as it arrives, instead of a
request per step.
"""

from __future__ import annotations

import errno
import threading
from collections.abc import Iterator
from typing import Any

from loaderplug.errors import FileError
from loaderplug.storage.object_store import (
    NO_ETAG,
    ObjectChanged,
    ObjectInfo,
    ObjectStore,
    copy_into,
    store_for,
)
from loaderplug.storage.object_urls import ObjectURL, is_object_url, key_problem
from loaderplug.storage.source import PosixSource
from loaderplug.types import Identity, IOPolicy, Source


def object_policy(url: ObjectURL) -> IOPolicy:
    """How an object is read: by ranges, buffered, no descriptor, no page cache."""
    return IOPolicy.buffered(url.store, f"{url.scheme}:// object: ranged GETs")


class ObjectFiles:
    """A job's objects, by URL, at the versions they were listed at; calling it opens
    one (the engine's opener)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._listed: dict[str, tuple[ObjectStore, str, Identity]] = {}
        self._lock = threading.Lock()

    def store(self, url: ObjectURL) -> ObjectStore:
        return store_for(url, self.timeout_s)

    def list(self, url: ObjectURL) -> tuple[list[ObjectInfo], dict[str, str]]:
        """The objects under ``url``'s prefix, each remembered by its URL; and the keys
        refused, with why (a key that is not a plain relative path)."""
        store = self.store(url)
        kept, refused = [], {}
        listed = store.list(url.prefix)
        folders = {rel.rsplit("/", 1)[0] for rel in (i.rel for i in listed) if "/" in rel}
        folders |= {f.rsplit("/", i)[0] for f in list(folders) for i in range(f.count("/") + 1)}
        for info in listed:
            if info.size == 0 and (info.rel.endswith("/") or info.rel in folders):
                # A folder marker (a console's "create folder": "dir/", which the client
                # lists as "dir"), not a file: objects live under it.
                continue
            problem = key_problem(info.rel) or ("" if info.etag else NO_ETAG)
            if problem:
                refused[info.rel] = problem
                continue
            self._remember(url.child(info.rel), store, info)
            kept.append(info)
        return kept, refused

    def head(self, url: ObjectURL) -> ObjectInfo:
        """The object at ``url`` (one HEAD), remembered."""
        store = self.store(url)
        info = store.head(url.prefix)
        if not info.etag:
            raise OSError(errno.EINVAL, NO_ETAG, str(url))
        self._remember(url, store, info)
        return info

    def _remember(self, url: ObjectURL, store: ObjectStore, info: ObjectInfo) -> None:
        with self._lock:
            self._listed[str(url)] = (store, url.prefix, info.identity())

    def __call__(self, src: str, policy: IOPolicy) -> Source:
        if not is_object_url(src):
            # A file: the current local copy a load reads instead of the object.
            return PosixSource(src, policy)
        with self._lock:
            listed = self._listed.get(src)
        if listed is None:  # listed by another ObjectFiles (a rerun's): ask again
            self.head(ObjectURL.parse(src))
            with self._lock:
                listed = self._listed[src]
        store, key, identity = listed
        return ObjectSource(store, key, identity, src)


class ObjectSource:
    """One object read by ranged GETs of its listed version (a :class:`Source`)."""

    def __init__(self, store: ObjectStore, key: str, identity: Identity, url: str) -> None:
        self.store, self.key, self.url = store, key, url
        self._identity = identity
        self._body: Iterator[Any] | None = None
        self._at = 0  # the offset the open body's next byte is at
        self._end = 0
        self._left: memoryview | None = None  # a chunk's bytes not yet read

    @property
    def size(self) -> int:
        return self._identity.size

    def identity(self) -> Identity:
        # Every GET was asked with If-Match on the listed ETag: bytes that arrived are
        # of that version, and any other version failed the read (see pread_into).
        return self._identity

    def will_read(self, offset: int, length: int) -> None:
        """The next reads are ``length`` bytes at ``offset``: one GET for all of them."""
        self._drop_body()
        length = min(length, self.size - offset)
        if length > 0:
            self._body = self.store.stream(self.key, offset, length, self._identity.etag)
            self._at, self._end = offset, offset + length

    def pread_into(self, buf: memoryview, offset: int) -> int:
        want = min(len(buf), self.size - offset)
        if want <= 0:
            return 0
        try:
            if self._body is not None and offset == self._at and offset + want <= self._end:
                return self._from_body(buf[:want])
            self._drop_body()
            return self.store.read_into(self.key, offset, buf[:want], self._identity.etag)
        except ObjectChanged as exc:
            self._drop_body()
            raise FileError(
                f"source changed while being copied: {exc}; run again once the mirror holds still",
                path=self.url,
                range=(offset, want),
            ) from None
        except BaseException:
            self._drop_body()
            raise

    def _from_body(self, buf: memoryview) -> int:
        assert self._body is not None
        done = 0
        while done < len(buf):
            if not self._left:
                chunk = next(self._body, None)
                if chunk is None:
                    break
                self._left = memoryview(chunk).cast("B")
            take = min(len(self._left), len(buf) - done)
            copy_into(buf[done : done + take], self._left[:take])
            self._left = self._left[take:]
            done += take
        self._at += done
        if self._at >= self._end:
            self._drop_body()
        return done

    def _drop_body(self) -> None:
        body, self._body, self._left = self._body, None, None
        if body is not None and hasattr(body, "close"):
            body.close()

    def close(self) -> None:
        self._drop_body()
