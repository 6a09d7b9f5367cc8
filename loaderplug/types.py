"""The hook vocabulary: the values plugins receive and return.

Everything here is plain data (or a protocol), below every other module of the package,
so a plugin, the engine and the integrations can all speak it without importing one
another.

Words used throughout:

* a **job** is one whole transfer (a hydrate, a sync, a load, a one pass);
* a **file** of a job is copied or read as **spans** (a range of one file, the unit a
  reader takes), each read in **steps** of at most a few MiB;
* a span has **landed** once every sink of its file stored it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Protocol

# The choices of the choice settings and of the hooks, declared once (settings derive
# their accepted values from these).
DirectIO = Literal["auto", "on", "off"]
WeightsReader = Literal["loaderplug", "fastsafetensors"]
WeightsDevice = Literal["auto", "cpu", "model"]
Distributed = Literal["auto", "off"]
HostSplit = Literal["auto", "on", "off"]
RankSharing = Literal["auto", "pagecache", "broadcast", "stream"]
# Each value says what it does; on and off, the old spellings of own and map, still
# parse (loaderplug.settings.RENAMED_VALUES).
Owned = Literal["auto", "own", "map"]
MirrorKind = Literal["hub", "folder"]
# The filesystem type an object store's objects are read as (see IOPolicy.object_store):
# no mount, no page cache, no descriptor; ranged GETs by the store's client.
OBJECT_STORE_TYPES = ("s3", "gcs", "azure")


@dataclass(frozen=True)
class MirrorRequest:
    """What a caller wants from the mirror: ``kind`` is ``hub`` (a Hub repo, kept in the
    Hub's cache layout under ``<volume>/hub``) or ``folder`` (``<volume>/models/<name>``)."""

    kind: MirrorKind
    name: str
    revision: str | None = None

    @property
    def subpath(self) -> str:
        return "hub" if self.kind == "hub" else f"models/{self.name}"


@dataclass(frozen=True)
class IOPolicy:
    """How to read one path: with O_DIRECT or through the page cache, and why."""

    direct: bool
    alignment: int
    fs_type: str
    reason: str

    @staticmethod
    def buffered(fs_type: str, reason: str) -> IOPolicy:
        return IOPolicy(direct=False, alignment=1, fs_type=fs_type, reason=reason)

    @property
    def object_store(self) -> bool:
        """Whether the path is an object in a store: it is never mapped or opened as a
        file, only read by ranges."""
        return self.fs_type in OBJECT_STORE_TYPES

    @property
    def stable_inodes(self) -> bool:
        """Whether an inode number names the file for good on this filesystem. FUSE
        reports the kernel's node ids unless its server keeps numbers of its own
        (``use_ino``), and a node id changes whenever the kernel forgets an inode nobody
        holds open (memory pressure does, every few seconds on a loaded host)."""
        return not (self.fs_type in ("fuse", "fuseblk") or self.fs_type.startswith("fuse."))

    @property
    def inode_note(self) -> str:
        """What the policy says of inode numbers, for ``doctor``."""
        if self.stable_inodes:
            return "inode numbers stable: a replaced file is also told by its inode"
        return (
            "inode numbers not stable (FUSE node ids): a file counts as changed by its "
            "size or mtime only"
        )


@dataclass(frozen=True)
class Identity:
    """What must stay the same while a file is read or copied: size, mtime and inode,
    and where known (0: not known, as for an identity another host sent) the device and
    the change time, which a rewrite in place that restores the mtime still moves. An
    object in a store has no inode: its ``etag`` (or generation) names its version."""

    size: int
    mtime_ns: int
    inode: int
    device: int = 0
    ctime_ns: int = 0
    etag: str = ""

    @staticmethod
    def of(st: os.stat_result) -> Identity:
        return Identity(st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns)

    def matches(self, other: Identity, *, inode: bool = True) -> bool:
        """Whether ``other`` is the same content as far as can be told: size and mtime,
        and where the filesystem keeps inode numbers (``inode``; see
        :attr:`IOPolicy.stable_inodes`) the inode, the device and the change time, each
        where both sides know it. Without stable inodes the change time is not compared
        either: such a filesystem (FUSE) may make it up at each lookup."""
        same = self.size == other.size and self.mtime_ns == other.mtime_ns
        same = same and (not self.etag or not other.etag or self.etag == other.etag)
        if not same or not inode:
            return same
        return (
            self.inode == other.inode
            and _same_if_known(self.device, other.device)
            and _same_if_known(self.ctime_ns, other.ctime_ns)
        )

    def describe(self) -> str:
        if self.etag:
            return f"size {self.size}, ETag {self.etag}"
        known = f", device {self.device}" if self.device else ""
        known += f", ctime_ns {self.ctime_ns}" if self.ctime_ns else ""
        return f"size {self.size}, mtime_ns {self.mtime_ns}, inode {self.inode}{known}"


def _same_if_known(mine: int, theirs: int) -> bool:
    return not mine or not theirs or mine == theirs


# Granularities filesystems keep modification times at, in ns: NTFS and CIFS (100 ns),
# microseconds, milliseconds, whole seconds (many FUSE filesystems, ext3), FAT (2 s).
MTIME_GRANULARITIES_NS = (100, 1_000, 1_000_000, 1_000_000_000, 2_000_000_000)


def same_mtime(stamped_ns: int, kept_ns: int) -> bool:
    """Whether a file stamped with ``stamped_ns`` can read back as ``kept_ns``: the same
    time, or that time cut to a granularity its filesystem keeps."""
    return stamped_ns == kept_ns or any(
        kept_ns == stamped_ns - stamped_ns % g for g in MTIME_GRANULARITIES_NS
    )


class Source(Protocol):
    """An open file to read from: what ``loaderplug_open_source`` returns."""

    @property
    def size(self) -> int: ...

    def identity(self) -> Identity:
        """The file's identity now (a fresh stat of the open file)."""
        ...

    def pread_into(self, buf: memoryview, offset: int) -> int:
        """Read up to ``len(buf)`` bytes at ``offset``; fewer only at end of file."""
        ...

    def close(self) -> None: ...


# restored: copied and published; loaded: read (into tensors) without being copied;
# mapped: handed over as tensors over a mapping of a file in memory (its pages are read
# as the consumer touches them, not by loaderplug); skipped: the destination already
# held it; linked: a symlink placed; failed: see reason.
Status = Literal["restored", "loaded", "mapped", "skipped", "linked", "failed"]


@dataclass(frozen=True)
class FileResult:
    """The outcome for one path (relative to the job's source root)."""

    path: str
    status: Status
    size: int = 0
    reason: str = ""
    errno: int | None = None
    range: tuple[int, int] | None = None
