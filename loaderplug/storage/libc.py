"""The C library, loaded once: ``ctypes.util.find_library`` runs external tools and is
far too slow to call on every policy decision, so glibc's soname is tried first."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def libc() -> ctypes.CDLL:
    try:  # glibc's soname: no lookup needed
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:  # musl and others
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
