"""Which files the ranks (or hosts) of a shared load load: in an order every rank agrees
on, by name, and each file as a key of what it is.

Ranks that share a load split its files by name and hand each other's tensors over, so
two ranks given different files under one name (an actor and a reward model, both
``model-00001-of-00002.safetensors``) would silently get each other's tensors. A file's
key says what it is: on one host its device, inode, size, mtime and ctime (the same
file is the same inode); across hosts, which see the mirror through mounts of their
own, its size and header digest (:func:`across_hosts`). The ranks compare the keys
before sharing (:func:`~loaderplug.tensors.ranks.agreement.same_files`), and a file
is checked against its key again when it is held open to be mapped
(:func:`held_as_said`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from loaderplug.errors import LoaderplugError
from loaderplug.settings import from_env
from loaderplug.storage.held import HeldFile
from loaderplug.storage.mounts import filesystem_type, is_fuse_type
from loaderplug.storage.object_store import store_for
from loaderplug.storage.object_urls import ObjectURL, is_object_url
from loaderplug.tensors.format.header import LENGTH_BYTES, header_length
from loaderplug.types import Identity

# What a member says a file is: comparable with ==, and readable in an error.
FileKey = tuple[int, ...] | tuple[int, str]
# A file of a load: a path, or an object's URL (a str).
LoadPath = Path | str
P = TypeVar("P", Path, LoadPath)


def load_paths(paths: Sequence[str | os.PathLike[str]]) -> list[LoadPath]:
    """``paths`` as a load's files: an object's URL kept as it is, a path as a Path."""
    return [p if isinstance(p, str) and is_object_url(p) else Path(p) for p in paths]


def name_of(path: LoadPath) -> str:
    """The file's name (an object's, the last part of its key)."""
    return path.name if isinstance(path, Path) else ObjectURL.parse(path).name


def by_name(files: Sequence[P]) -> list[P]:
    """``files`` in the order every rank agrees on, whatever order each was given them
    in: by name (a file's name is also its name in a local copy)."""
    return sorted(files, key=lambda path: (name_of(path), str(path)))


def on_this_host(path: LoadPath) -> FileKey:
    """A file as ranks of one host tell it: device, inode, size, mtime and ctime; on a
    FUSE mount, whose inode numbers change as the kernel forgets inodes (see
    :attr:`~loaderplug.types.IOPolicy.stable_inodes`), device, size and mtime. An
    object: its size and ETag."""
    if isinstance(path, str):
        return object_key(path)
    return _key(Identity.of(_stat(path)), stable_inodes=not is_fuse_type(filesystem_type(path)))


def object_key(url: str) -> FileKey:
    """An object as every rank tells it: its size and ETag (one HEAD)."""
    where = ObjectURL.parse(url)
    try:
        info = store_for(where, from_env().object_timeout_s).head(where.prefix)
    except OSError as exc:
        raise LoaderplugError(f"{url}: cannot read it: {exc.strerror or exc}") from exc
    return (info.size, f"ETag {info.etag}")


def _key(i: Identity, *, stable_inodes: bool) -> FileKey:
    if not stable_inodes:
        return (i.device, -1, i.size, i.mtime_ns, -1)
    return (i.device, i.inode, i.size, i.mtime_ns, i.ctime_ns)


def held_as_said(path: Path, said: FileKey, who: str) -> HeldFile:
    """``path`` held open (see :mod:`loaderplug.storage.held`), checked to be the file
    ``who`` said it is (``said``, its :func:`on_this_host` key): a file replaced under
    its name since fails here, before a byte of it is handed over."""
    held = HeldFile.open(str(path))
    # Told as ``said`` was: without the inode and ctime where the sayer's mount lacks them.
    now = _key(held.identity, stable_inodes=said[1] != -1)
    if now != said:
        held.close()
        raise LoaderplugError(
            f"{path}: not the file {who} loaded ({describe(now)} against "
            f"{describe(said)}): it was replaced meanwhile; load it again once it holds still"
        )
    return held


def across_hosts(path: Path) -> FileKey:
    """A file as hosts with mounts of their own tell it: its size and its header's
    SHA-256 (inode numbers and times are each mount's own)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            n = header_length(str(path), f.read(LENGTH_BYTES), size)
            digest = hashlib.sha256(f.read(n)).hexdigest()
    except OSError as exc:
        raise LoaderplugError(f"{path}: cannot read it: {exc.strerror or exc}") from exc
    return (size, digest)


def describe(key: FileKey) -> str:
    if len(key) == 2 and str(key[1]).startswith("ETag"):
        return f"size {key[0]}, {key[1]}"
    if len(key) == 2:
        return f"size {key[0]}, header sha256 {str(key[1])[:12]}"
    device, inode, size, mtime_ns, ctime_ns = key
    return f"device {device}, inode {inode}, size {size}, mtime_ns {mtime_ns}, ctime_ns {ctime_ns}"


def _stat(path: Path) -> os.stat_result:
    try:
        return os.stat(path)
    except OSError as exc:
        raise LoaderplugError(f"{path}: cannot read it: {exc.strerror or exc}") from exc
