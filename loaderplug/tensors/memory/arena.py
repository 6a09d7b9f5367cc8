"""The memory a file's tensors own: one anonymous mapping per file, starting at a 2 MiB
boundary and backed by transparent huge pages where the kernel gives them.

Each fresh page of anonymous memory costs a fault and its zeroing before a byte lands
in it. For 256 MiB that is about 100 ms with 4 KiB pages and 25 ms with 2 MiB pages
(measured on a 2-core VM), more than copying the bytes in (about 22 ms): the page size
decides what owning a file's bytes costs. A huge page backs an aligned 2 MiB of address
space only, so the arena starts on such a boundary and asks for huge pages with
``madvise(MADV_HUGEPAGE)``, which works wherever transparent huge pages are ``always``
or ``madvise`` (where they are ``never``, the arena is 4 KiB pages, as any memory).

Pages are still given back one tensor at a time (:mod:`loaderplug.tensors.memory.page_release`):
``MADV_DONTNEED`` on part of a huge page splits it and frees what was asked.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap

from loaderplug.units import MiB

HUGE_PAGE = 2 * MiB


class Arena:
    """``size`` bytes of private anonymous memory at a 2 MiB boundary: :attr:`view` is
    them, :attr:`base` where they start in :attr:`mapping`."""

    def __init__(self, size: int) -> None:
        # One huge page more than asked: room to start at a boundary wherever the
        # kernel put the mapping. Address space only: untouched pages cost no memory.
        # Private: a page given back (MADV_DONTNEED) is freed, not kept by a shared object.
        self.mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.base = -_address(self.mapping) % HUGE_PAGE
        self.view = memoryview(self.mapping)[self.base : self.base + size]
        _ask_for_huge_pages(self.mapping, self.base, size)


def _address(mapping: mmap.mmap) -> int:
    """Where ``mapping`` starts in this process's address space."""
    first = ctypes.c_char.from_buffer(mapping)
    try:
        return ctypes.addressof(first)
    finally:
        del first  # it pins the mapping while it lives


def _ask_for_huge_pages(mapping: mmap.mmap, start: int, length: int) -> None:
    # A kernel without transparent huge pages refuses the advice (EINVAL), and a Python
    # without MADV_HUGEPAGE has no name for it: 4 KiB pages then, slower but the same.
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or length <= 0:
        return
    length = -(-length // mmap.PAGESIZE) * mmap.PAGESIZE
    with contextlib.suppress(OSError, ValueError):
        mapping.madvise(advice, start, length)
