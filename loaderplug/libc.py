"""The C library, loaded once: ``ctypes.util.find_library`` runs external tools and is
far too slow to call on every policy decision."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
