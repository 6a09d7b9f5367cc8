"""Tensors over one mapping of a file, each of whose memory is given back when it dies.

A file's tensors are views of one mapping (an anonymous one the engine reads into, or a
private mapping of the file itself), so a load reads straight into the memory the
tensors keep and never copies. Left alone, the mapping would hold every page of the file
until its last tensor died. Instead each tensor gets a handle of its own on its bytes
(a ctypes array over the mapping, which its storage keeps alive, views included); when
the last user of a tensor's storage lets go, its pages are returned to the kernel with
``madvise(MADV_DONTNEED)``. A page shared by two tensors (or by a tensor and the header)
goes back once neither needs it. The mapping's address space stays reserved until every
tensor is gone; its memory does not.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import threading
import weakref
from collections.abc import Callable
from typing import Any

from loaderplug.tensors.format.header import Header, TensorInfo

PAGE = mmap.PAGESIZE


class PageReleaser:
    """Gives back the pages of ``mapping`` (a private one: anonymous, or a copy-on-write
    mapping of a file) as the tensors over them die.

    Pages are counted only where they are shared: the first and last page of every
    tensor, and every page holding bytes no tensor owns (the header, gaps, the padding
    past the end), which belong to the file as a whole until :meth:`release_rest`.
    The file's byte 0 is at ``base`` in the mapping (a page boundary: an arena starts
    at a huge page's, see :mod:`loaderplug.tensors.memory.arena`).
    """

    def __init__(self, mapping: mmap.mmap, header: Header, mapped_size: int, base: int = 0) -> None:
        if base % PAGE:
            raise ValueError(f"a file's bytes must start at a page boundary, not at {base}")
        self.mapping = mapping
        self._base = base
        self._lock = threading.Lock()
        self._shared: dict[int, int] = {}
        self._others: list[tuple[int, int]] = []  # the file's own bytes: (begin, end)
        cursor = 0
        for t in header.tensors:
            if not t.nbytes:
                continue
            if t.begin > cursor:
                self._others.append((cursor, t.begin))
            cursor = max(cursor, t.end)
            for page in {t.begin // PAGE, (t.end - 1) // PAGE}:
                self._shared[page] = self._shared.get(page, 0) + 1
        if mapped_size > cursor:
            self._others.append((cursor, mapped_size))
        for begin, end in self._others:
            for page in {begin // PAGE, (end - 1) // PAGE}:
                self._shared[page] = self._shared.get(page, 0) + 1
        self._rest_released = False

    def tensor(self, t: TensorInfo, on_release: Callable[[], None] | None = None) -> Any:
        """A handle on ``t``'s bytes for ``torch.frombuffer``; when it dies its pages go
        back (and ``on_release`` runs)."""
        handle = (ctypes.c_char * t.nbytes).from_buffer(self.mapping, self._base + t.begin)
        weakref.finalize(handle, self._tensor_died, t.begin, t.end, on_release)
        return handle

    def _tensor_died(self, begin: int, end: int, on_release: Callable[[], None] | None) -> None:
        self._give_back(begin, end)
        if on_release is not None:
            on_release()

    def release_rest(self) -> None:
        """The file is done with its own bytes (header, gaps, padding)."""
        with self._lock:
            if self._rest_released:
                return
            self._rest_released = True
        for begin, end in self._others:
            self._give_back(begin, end)

    def _give_back(self, begin: int, end: int) -> None:
        """Return the pages of ``[begin, end)`` that nothing else still needs."""
        first, last = begin // PAGE, (end - 1) // PAGE
        with self._lock:
            ends = {}
            for page in {first, last}:
                self._shared[page] -= 1
                ends[page] = self._shared[page] == 0
        start = first if ends[first] else first + 1
        stop = last + 1 if ends[last] else last
        if stop > start:
            _dontneed(self.mapping, self._base + start * PAGE, (stop - start) * PAGE)


def _dontneed(mapping: mmap.mmap, start: int, length: int) -> None:
    # A closed mapping (ValueError) has given its memory back already.
    with contextlib.suppress(ValueError, OSError):
        mapping.madvise(mmap.MADV_DONTNEED, start, length)
