"""Which files the ranks (or hosts) of a shared load load: agreed by name, then by what
each file is.

Ranks that share a load split its files by name and hand each other's tensors over, so
two ranks given different files under one name (an actor and a reward model, both
``model-00001-of-00002.safetensors``) would silently get each other's tensors. Before
sharing, the ranks of a host say each file's name and identity as each sees it (the
device, inode, size, mtime and ctime: the same file is the same inode), in one exchange
per load; files that differ fail the load on every rank, saying which rank holds which
file: never a silent swap, never a hang. Hosts, which see the mirror through mounts of
their own, agree on the names here and compare each file's size, mtime and header
digest (:func:`across_hosts`) where they decide whether to split the reads
(:mod:`loaderplug.tensors.hosts.exchange`): hosts whose files differ each load their own.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from loaderplug.errors import LoaderplugError
from loaderplug.storage.held import HeldFile
from loaderplug.storage.mounts import filesystem_type, is_fuse_type
from loaderplug.tensors.format.header import LENGTH_BYTES, header_length
from loaderplug.tensors.ranks.steps import Steps
from loaderplug.types import Identity

# What a member says a file is: comparable with ==, and readable in an error.
FileKey = tuple[int, ...] | tuple[int, str]


def by_name(files: Sequence[Path]) -> list[Path]:
    """``files`` in the order every rank agrees on, whatever order each was given them
    in: by name (a file's name is also its name in a local copy)."""
    return sorted(files, key=lambda path: (path.name, str(path)))


def on_this_host(path: Path) -> FileKey:
    """A file as ranks of one host tell it: device, inode, size, mtime and ctime; on a
    FUSE mount, whose inode numbers change as the kernel forgets inodes (see
    :attr:`~loaderplug.types.IOPolicy.stable_inodes`), device, size and mtime."""
    return _key(Identity.of(_stat(path)), stable_inodes=not is_fuse_type(filesystem_type(path)))


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
            f"{path}: not the file {who} loaded ({_describe(now)} against "
            f"{_describe(said)}): it was replaced meanwhile; load it again once it holds still"
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


def same_files(
    steps: Steps,
    files: Sequence[Path],
    who: str = "rank",
    identify: Callable[[Path], FileKey] | None = on_this_host,
) -> list[FileKey]:
    """Check that every member of ``steps`` loads the same files: of the same names and,
    by ``identify`` (None: by name only), the same files under each name; if not, raise
    the same error on every member, naming the first member that differs from the
    first (``who``: how members are called in the message). Returns each file's key,
    as every member has it. A file this member cannot look at fails the load on every
    member."""
    try:
        keys = [identify(path) if identify is not None else () for path in files]
    except LoaderplugError as exc:
        steps.fail(exc)
    said = steps.exchange(("files", [(p.name, k) for p, k in zip(files, keys, strict=True)]))
    lists = [step[1] if step is not None else [] for step in said]
    ranks = steps.share.global_ranks
    names = [[name for name, _ in listed] for listed in lists]
    differing = next((m for m, theirs in enumerate(names) if theirs != names[0]), None)
    if differing is not None:
        raise LoaderplugError(
            f"the ranks of a shared load must load the same files, and {who} "
            f"{ranks[differing]} does not: next to rank {ranks[0]}'s, its list "
            f"{_difference(names[0], names[differing])}; pass every rank the same files"
        )
    for member, listed in enumerate(lists):
        for (name, theirs), mine in zip(listed, lists[0], strict=True):
            if theirs != mine[1]:
                raise LoaderplugError(
                    f"the ranks of a shared load must load the same files, and {who} "
                    f"{ranks[member]} does not: its {name} is another file than rank "
                    f"{ranks[0]}'s ({_describe(theirs)} against {_describe(mine[1])}); "
                    "load files that differ under one name in separate loads, or give "
                    "them other names"
                )
    return keys


def _difference(first: list[str], theirs: list[str]) -> str:
    lacks, more = sorted(set(first) - set(theirs)), sorted(set(theirs) - set(first))
    parts = [f"lacks {', '.join(lacks)}"] if lacks else []
    parts += [f"also has {', '.join(more)}"] if more else []
    return "; ".join(parts) or "has some twice"


def _describe(key: FileKey) -> str:
    if len(key) == 2:
        return f"size {key[0]}, header sha256 {str(key[1])[:12]}"
    device, inode, size, mtime_ns, ctime_ns = key
    return f"device {device}, inode {inode}, size {size}, mtime_ns {mtime_ns}, ctime_ns {ctime_ns}"


def _stat(path: Path) -> os.stat_result:
    try:
        return os.stat(path)
    except OSError as exc:
        raise LoaderplugError(f"{path}: cannot read it: {exc.strerror or exc}") from exc
