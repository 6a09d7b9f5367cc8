"""Which mount holds a path, its filesystem type, and what kind of filesystem that is
(network or userspace, in memory, a local block device)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from loaderplug.types import OBJECT_STORE_TYPES

# Network, distributed and userspace filesystems: buffered reads keep readahead and the
# page cache working for them. Every FUSE mount counts (``fuse``, ``fuseblk`` and, matched
# by prefix below, ``fuse.*``): userspace servers such as geesefs or s3fs are networked.
BUFFERED_TYPES = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "lustre",
        "gpfs",
        "beegfs",
        "glusterfs",
        "ceph",
        "9p",
        "virtiofs",
        "wekafs",
        "fuse",
        "fuseblk",
        # Memory-backed: O_DIRECT gains nothing and tmpfs refuses it on older kernels.
        "tmpfs",
        "ramfs",
    }
    # Objects in a store: remote, read by requests (see IOPolicy.object_store).
    | set(OBJECT_STORE_TYPES)
)

# statfs f_type magic numbers, for mounts whose name says nothing (e.g. "none").
_MAGIC_TO_TYPE = {
    0x6969: "nfs",
    0xFF534D42: "cifs",
    0xFE534D42: "smb3",
    0x0BD00BD0: "lustre",
    0x47504653: "gpfs",
    0x65735546: "fuse",
    0x01021994: "tmpfs",
    0x858458F6: "ramfs",
    0x794C7630: "overlay",
    0xEF53: "ext4",
    0x58465342: "xfs",
    0x9123683E: "btrfs",
    0xF2F52010: "f2fs",
}

MEMORY_TYPES = frozenset({"tmpfs", "ramfs"})

# Filesystems of this machine's own disks and memory: no other host writes a file there,
# so a file changes only as a process here changes it. Any other type (a network or
# cluster filesystem, FUSE, one this list does not know) may change under a reader.
LOCAL_TYPES = frozenset(
    {
        "ext2",
        "ext3",
        "ext4",
        "xfs",
        "btrfs",
        "f2fs",
        "zfs",
        "bcachefs",
        "jfs",
        "reiserfs",
        "overlay",
        "squashfs",
        "erofs",
        *MEMORY_TYPES,
    }
)


@dataclass(frozen=True)
class Mount:
    """One line of /proc/self/mountinfo."""

    mount_point: str
    fs_type: str
    source: str


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (\040 ...).
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit() and i + 4 <= len(field):
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def read_mounts(mountinfo: str = "/proc/self/mountinfo") -> list[Mount]:
    """Mounts in the order the kernel lists them (later ones stack on earlier ones)."""
    mounts = []
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    except OSError:
        return []
    for line in lines:
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 2:
            continue
        mounts.append(Mount(_unescape(fields[4]), tail[0], _unescape(tail[1])))
    return mounts


def find_mount(path: str | os.PathLike[str], mounts: list[Mount] | None = None) -> Mount | None:
    """The mount that serves ``path``: the longest mount point above it, last one wins.

    Where several mounts share one mount point the last listed sits on top and is the one
    the path actually reaches.
    """
    resolved = os.path.realpath(path)
    best: Mount | None = None
    for mount in read_mounts() if mounts is None else mounts:
        mp = mount.mount_point
        inside = resolved == mp or resolved.startswith(mp.rstrip("/") + "/")
        if inside and (best is None or len(mp) >= len(best.mount_point)):
            best = mount
    return best


def _statfs_magic(path: str) -> int | None:
    """The filesystem's statfs ``f_type`` magic number, or None where it cannot be had."""
    try:
        import ctypes

        from loaderplug.storage.libc import libc

        buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on x86_64
        if libc().statfs(os.fsencode(path), buf) != 0:
            return None
        return int.from_bytes(buf.raw[:8], "little") & 0xFFFFFFFF
    except (OSError, AttributeError):
        return None


def _statfs_type(path: str) -> str | None:
    magic = _statfs_magic(path)
    return _MAGIC_TO_TYPE.get(magic) if magic is not None else None


# Each mounted filesystem's type, by its device and statfs magic: what a mount is does
# not change while it is mounted, and the mount table costs half a millisecond to read,
# for every file a job decides a policy for. A device number freed by an unmount and
# given to another filesystem comes with that filesystem's magic: a new key.
_types: dict[tuple[int, int | None], str] = {}


def mount_identity(path: str | os.PathLike[str]) -> tuple[int, int | None] | None:
    """What names the filesystem serving ``path`` (or its nearest existing parent) for as
    long as it is mounted: its device and statfs magic; None if it cannot be told."""
    existing = os.fspath(path)
    try:
        device = os.stat(existing).st_dev
    except OSError:
        existing = nearest_existing(existing)
        try:
            device = os.stat(existing).st_dev
        except OSError:
            return None
    return device, _statfs_magic(existing)


# Filesystems whose statfs magic names them as the mount table would: a process's first
# look at one of them need not read the table (half a millisecond, in a load of a
# single file that takes a few). Others are named by the table: ``nfs4`` and
# ``fuse.geesefs`` share their magic with ``nfs`` and every FUSE filesystem.
_NAMED_BY_MAGIC = frozenset({"ext4", "xfs", "btrfs", "f2fs", "overlay", "tmpfs", "ramfs"})


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The filesystem type serving ``path`` (``ext4``, ``nfs4``, ``fuse.geesefs`` ...;
    ext2 and ext3, which share ext4's magic, are named ext4)."""
    key = mount_identity(path)
    known = _types.get(key) if key is not None else None
    if known is not None:
        return known
    by_magic = _MAGIC_TO_TYPE.get(key[1]) if key is not None and key[1] is not None else None
    if key is not None and by_magic in _NAMED_BY_MAGIC:
        _types[key] = by_magic
        return by_magic
    mount = find_mount(path)
    name = mount.fs_type if mount else ""
    if name in ("", "none", "unknown"):
        existing = nearest_existing(os.fspath(path))
        name = _statfs_type(existing) or name or "unknown"
    if key is not None and name != "unknown":
        _types[key] = name
    return name


def nearest_existing(path: str) -> str:
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return str(p)


def is_buffered_type(fs_type: str) -> bool:
    return fs_type in BUFFERED_TYPES or fs_type.startswith("fuse.")


def is_local_type(fs_type: str) -> bool:
    """A filesystem of this machine's own disks or memory (see :data:`LOCAL_TYPES`)."""
    return fs_type in LOCAL_TYPES


def is_network_type(fs_type: str) -> bool:
    """Buffered for being remote or userspace, not for living in memory."""
    return is_buffered_type(fs_type) and fs_type not in MEMORY_TYPES


def is_fuse_type(fs_type: str) -> bool:
    """Whether ``fs_type`` is a FUSE filesystem's, whose inode numbers are the kernel's
    node ids unless its server keeps its own (see ``IOPolicy.stable_inodes``)."""
    return fs_type in ("fuse", "fuseblk") or fs_type.startswith("fuse.")
