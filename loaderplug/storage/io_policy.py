"""The IO policy: whether a file is read with O_DIRECT, and with what alignment.

The decision comes from the filesystem *type*, never from whether ``open(O_DIRECT)``
succeeds: the Linux NFS client accepts O_DIRECT and then turns every read into an
uncached synchronous round trip, so a network filesystem must be recognised by name.
"""

from __future__ import annotations

import os
import struct
from typing import NamedTuple

from loaderplug.storage.io_probe import measured_policy
from loaderplug.storage.mounts import (
    MEMORY_TYPES,
    filesystem_type,
    is_buffered_type,
    mount_identity,
    nearest_existing,
)
from loaderplug.storage.residency import NOT_ASKED, WARM_FRACTION, cached_fraction
from loaderplug.types import DirectIO, IOPolicy

DEFAULT_ALIGNMENT = 4096

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

        from loaderplug.storage.libc import libc

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


# Each mount's O_DIRECT alignment (see mounts.filesystem_type for the key): a job asks
# for every file it reads, and the answer is the device's.
_alignments: dict[tuple[int, int | None], int] = {}


def direct_io_alignment(path: str | os.PathLike[str]) -> int:
    """O_DIRECT alignment: statx's STATX_DIOALIGN where the kernel and filesystem report
    it, else the device's logical block size, else 4096; the same for a whole mount."""
    key = mount_identity(path)
    if key is not None and key in _alignments:
        return _alignments[key]
    alignment = _alignment_of(path)
    if key is not None:
        _alignments[key] = alignment
    return alignment


def _alignment_of(path: str | os.PathLike[str]) -> int:
    existing = nearest_existing(os.fspath(path))
    dio = _statx_dio(existing)
    if dio is not None and dio[0] and dio[1]:
        return max(dio[0], dio[1])
    try:
        dev = dio[2] if dio is not None else os.stat(existing).st_dev
    except OSError:
        return DEFAULT_ALIGNMENT
    return _logical_block_size(dev) or DEFAULT_ALIGNMENT


def decide(
    path: str | os.PathLike[str], mode: DirectIO = "auto", *, measure: bool = False
) -> IOPolicy:
    """The built-in policy: network and memory filesystems buffered, local block direct;
    with ``measure``, what was measured on the mount wins over that table
    (:mod:`loaderplug.storage.io_probe`)."""
    return decided(path, filesystem_type(path), mode, measure=measure).policy


class FilePolicy(NamedTuple):
    """A file's IO policy, and the share of it in the page cache where the policy asked
    (:data:`~loaderplug.storage.residency.NOT_ASKED` where it did not; None: the kernel
    would not say)."""

    policy: IOPolicy
    cached: float | None


def decided(
    path: str | os.PathLike[str],
    fs_type: str,
    mode: DirectIO = "auto",
    *,
    measure: bool = False,
    is_file: bool | None = None,
) -> FilePolicy:
    """:func:`decide` for ``path`` on a filesystem of ``fs_type`` (what a job holds for
    each mount), with the share of it in the page cache the policy asked for, so that
    nothing asks again; ``is_file``: whether it is a regular file, where the caller
    knows."""
    # Whether the file is in the page cache is its own, and asked once.
    cached = _cached(path, fs_type, mode, is_file)
    guess = _by_type(path, mode, fs_type, cached)
    if not measure or mode != "auto" or guess.fs_type in MEMORY_TYPES:
        return FilePolicy(guess, cached)
    if cached is not None and cached >= WARM_FRACTION:
        return FilePolicy(guess, cached)  # served from memory: no measurement applies
    known = None if cached == NOT_ASKED else cached
    alignment = direct_io_alignment(path)
    return FilePolicy(measured_policy(os.fspath(path), guess, alignment, cached=known), cached)


def _cached(
    path: str | os.PathLike[str], fs_type: str, mode: DirectIO, is_file: bool | None
) -> float | None:
    """The share of a local block filesystem's file in the page cache, where the policy
    asks (not for a folder, a forced mode or a filesystem the type decides)."""
    if mode != "auto" or is_buffered_type(fs_type):
        return NOT_ASKED
    if not (os.path.isfile(path) if is_file is None else is_file):
        return None
    return cached_fraction(os.fspath(path))


def _by_type(
    path: str | os.PathLike[str], mode: DirectIO, fs_type: str, cached: float | None
) -> IOPolicy:
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
    if cached is not None and cached >= WARM_FRACTION:
        # Served from memory, buffered reads beat any disk read; O_DIRECT would ignore
        # the cached copy and read it from the device again.
        return IOPolicy.buffered(fs_type, f"{cached:.0%} of it is in the page cache")
    return IOPolicy(
        True, direct_io_alignment(path), fs_type, f"{fs_type} is a local block filesystem"
    )
