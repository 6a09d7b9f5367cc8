"""How much of a file is in the page cache right now.

A warm file is served fastest from the page cache; a cold one fastest with O_DIRECT,
which also leaves the cache alone. The policy asks here which case it is in:
``cachestat`` (Linux 6.5+) counts cached pages in one call; older kernels fall back to
``mincore`` over a read-only mapping. ``None`` means the kernel would not say.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import platform

from loaderplug.storage.libc import libc

# A file at least this much in the page cache is read buffered, from memory.
WARM_FRACTION = 0.5
# A share no file has: the page cache was not asked about it (see io_policy.decided).
NOT_ASKED = -1.0

_CACHESTAT_NR = {"x86_64": 451, "aarch64": 451}.get(platform.machine())
_PROT_READ, _MAP_SHARED = 1, 1
_MAP_FAILED = ctypes.c_void_p(-1).value


class _Range(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_uint64)
        for name in ("cache", "dirty", "writeback", "evicted", "recently_evicted")
    ]


def _cachestat_pages(fd: int) -> int | None:
    if _CACHESTAT_NR is None:
        return None
    result = _Stat()
    rng = _Range(0, 0)  # len 0: to the end of the file
    if libc().syscall(_CACHESTAT_NR, fd, ctypes.byref(rng), ctypes.byref(result), 0) != 0:
        return None  # ENOSYS on older kernels, or a filesystem that cannot say
    return int(result.cache)


def _mincore_pages(fd: int, size: int) -> int | None:
    lib = libc()
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    addr = lib.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
    if addr in (None, _MAP_FAILED):
        return None
    try:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        if lib.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
            return None
        return sum(b & 1 for b in vec)
    finally:
        lib.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))


def cached_fraction(path: str) -> float | None:
    """The share of ``path``'s pages in the page cache (0.0 to 1.0), or None if unknown."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        pages = _cachestat_pages(fd)
        if pages is None:
            pages = _mincore_pages(fd, size)
        if pages is None:
            return None
        return min(1.0, pages / -(-size // mmap.PAGESIZE))
    except OSError:
        return None
    finally:
        os.close(fd)
