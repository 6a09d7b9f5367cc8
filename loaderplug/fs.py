"""Filesystem detection: which mount holds a path, and whether to read it with O_DIRECT.

The decision comes from the filesystem *type*, never from whether ``open(O_DIRECT)``
succeeds: the Linux NFS client accepts O_DIRECT and then turns every read into an
uncached synchronous round trip, so a network filesystem must be recognised by name.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

from loaderplug.types import IOPolicy

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

DEFAULT_ALIGNMENT = 4096
# A file at least this much in the page cache is read buffered, from memory.
WARM_FRACTION = 0.5


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


def _statfs_type(path: str) -> str | None:
    try:
        import ctypes

        from loaderplug.libc import libc

        buf = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on x86_64
        if libc().statfs(os.fsencode(path), buf) != 0:
            return None
        magic = int.from_bytes(buf.raw[:8], "little") & 0xFFFFFFFF
        return _MAGIC_TO_TYPE.get(magic)
    except (OSError, AttributeError):
        return None


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The filesystem type serving ``path`` (``ext4``, ``nfs4``, ``fuse.geesefs`` ...)."""
    mount = find_mount(path)
    name = mount.fs_type if mount else ""
    if name in ("", "none", "unknown"):
        existing = _nearest_existing(os.fspath(path))
        name = _statfs_type(existing) or name or "unknown"
    return name


def _nearest_existing(path: str) -> str:
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return str(p)


def is_buffered_type(fs_type: str) -> bool:
    return fs_type in BUFFERED_TYPES or fs_type.startswith("fuse.")


def is_network_type(fs_type: str) -> bool:
    """Buffered for being remote or userspace, not for living in memory."""
    return is_buffered_type(fs_type) and fs_type not in MEMORY_TYPES


_STATX_DIOALIGN = 0x2000
_AT_FDCWD = -100
_STATX_SIZE = 256


def _statx_dio(path: str) -> tuple[int, int, int] | None:
    """(dio_mem_align, dio_offset_align, dev) from statx(STATX_DIOALIGN), or None.

    The standard library has no statx, so glibc's is called through ctypes. Offsets are
    those of ``struct statx`` in <linux/stat.h>: stx_mask at 0, stx_dev_major/minor at
    136/140, stx_dio_mem_align/offset_align at 152/156.
    """
    try:
        import ctypes

        from loaderplug.libc import libc

        statx = libc().statx
    except (OSError, AttributeError):
        return None
    buf = ctypes.create_string_buffer(_STATX_SIZE)
    if statx(_AT_FDCWD, os.fsencode(path), 0, _STATX_DIOALIGN, buf) != 0:
        return None
    (mask,) = struct.unpack_from("<I", buf.raw, 0)
    major, minor, mem, offset = struct.unpack_from("<IIxxxxxxxxII", buf.raw, 136)
    if not mask & _STATX_DIOALIGN:
        return (0, 0, os.makedev(major, minor))
    return (mem, offset, os.makedev(major, minor))


def _logical_block_size(dev: int) -> int | None:
    base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
    for queue in (f"{base}/queue", f"{base}/../queue"):  # a partition has its disk's queue
        try:
            with open(f"{queue}/logical_block_size") as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            continue
    return None


def direct_io_alignment(path: str | os.PathLike[str]) -> int:
    """O_DIRECT alignment: statx's STATX_DIOALIGN where the kernel and filesystem report
    it, else the device's logical block size, else 4096."""
    existing = _nearest_existing(os.fspath(path))
    dio = _statx_dio(existing)
    if dio is not None and dio[0] and dio[1]:
        return max(dio[0], dio[1])
    try:
        dev = dio[2] if dio is not None else os.stat(existing).st_dev
    except OSError:
        return DEFAULT_ALIGNMENT
    return _logical_block_size(dev) or DEFAULT_ALIGNMENT


def decide(path: str | os.PathLike[str], mode: str = "auto") -> IOPolicy:
    """The built-in policy: network and memory filesystems buffered, local block direct."""
    fs_type = filesystem_type(path)
    if mode == "off":
        return IOPolicy.buffered(fs_type, "LOADERPLUG_DIRECT_IO=off")
    if mode == "on":
        return IOPolicy(True, direct_io_alignment(path), fs_type, "LOADERPLUG_DIRECT_IO=on")
    if fs_type in MEMORY_TYPES:
        return IOPolicy.buffered(fs_type, f"{fs_type} lives in memory: O_DIRECT gains nothing")
    if is_buffered_type(fs_type):
        return IOPolicy.buffered(
            fs_type, f"{fs_type} is a network or userspace filesystem: reads stay buffered"
        )
    if os.path.isfile(path):
        from loaderplug.pagecache import cached_fraction

        cached = cached_fraction(os.fspath(path))
        if cached is not None and cached >= WARM_FRACTION:
            # Served from memory, buffered reads beat any disk read; O_DIRECT would
            # ignore the cached copy and read it from the device again.
            return IOPolicy.buffered(fs_type, f"{cached:.0%} of it is in the page cache")
    return IOPolicy(
        True, direct_io_alignment(path), fs_type, f"{fs_type} is a local block filesystem"
    )
