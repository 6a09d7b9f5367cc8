"""Reading a source file: open under an IO policy, pread into caller buffers.

A :class:`PosixSource` is opened by each worker for each file it reads from, so no
descriptor is shared between threads; the file's identity is checked through it after
every read, and once more through a fresh open before the copy is published.

A source is opened without blocking and must then be a regular file: a mirror's file
swapped for a FIFO (or a device) after it was listed fails its open at once, rather
than block a reader forever with the destination's lock held.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading

from loaderplug.storage.state_files import open_regular
from loaderplug.types import Identity, IOPolicy

log = logging.getLogger(__name__)


def aligned_buffer(size: int) -> mmap.mmap:
    """A page-aligned anonymous buffer, as O_DIRECT needs; freed when closed."""
    return mmap.mmap(-1, max(size, mmap.PAGESIZE))


_fallback_lock = threading.Lock()
_fallback_logged: set[str] = set()


def _note_fallback(policy: IOPolicy, path: str) -> None:
    with _fallback_lock:
        if policy.fs_type in _fallback_logged:
            return
        _fallback_logged.add(policy.fs_type)
    log.info("O_DIRECT refused on %s (%s); reading it buffered", policy.fs_type, path)


class PosixSource:
    """A local or mounted file read with ``preadv``, O_DIRECT when the policy says so.

    O_DIRECT needs aligned offsets, lengths and buffers: callers pass page-aligned buffers
    (:func:`aligned_buffer`) with lengths padded to the alignment, so the last read of a
    file runs past its end and the kernel returns the short tail. When the kernel refuses
    direct IO (EINVAL at open or read) the file is reopened buffered and read the same way.
    """

    def __init__(self, path: str, policy: IOPolicy) -> None:
        self.path = path
        self.policy = policy
        fd = _open_direct(path) if policy.direct else None
        if policy.direct and fd is None:
            _note_fallback(policy, path)
        self.direct = fd is not None
        self._fd = fd if fd is not None else _open_buffered(path)
        self._size = os.fstat(self._fd).st_size

    @property
    def size(self) -> int:
        return self._size

    def identity(self) -> Identity:
        return Identity.of(os.fstat(self._fd))

    def pread_into(self, buf: memoryview, offset: int) -> int:
        """Fill ``buf`` from ``offset``, looping over short reads; stop early only at EOF.

        Direct reads need ``offset`` and ``len(buf)`` to be multiples of the alignment
        (the engine pads its requests); anything else is read buffered.
        """
        align = self.policy.alignment
        if self.direct:
            if offset % align or len(buf) % align:
                self._reopen_buffered()  # an unaligned request: not a refusal
            else:
                try:
                    return self._read_loop(buf, offset, stop_on_unaligned=align)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    _note_fallback(self.policy, self.path)
                    self._reopen_buffered()
        return self._read_loop(buf, offset, stop_on_unaligned=0)

    def _read_loop(self, buf: memoryview, offset: int, *, stop_on_unaligned: int) -> int:
        done = 0
        while done < len(buf):
            n = os.preadv(self._fd, [buf[done:]], offset + done)
            if n == 0:
                break
            done += n
            # With O_DIRECT a short read that is not a multiple of the alignment is the
            # file's tail, and asking again at an unaligned offset would fail.
            if stop_on_unaligned and done % stop_on_unaligned:
                break
        return done

    def _reopen_buffered(self) -> None:
        fd = _open_buffered(self.path)
        os.close(self._fd)
        self._fd = fd
        self.direct = False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _open_buffered(path: str) -> int:
    """``path`` open for reading as a regular file (a link to one is followed: a mirror's
    files may be links into its blobs)."""
    return open_regular(path, os.O_RDONLY, follow=True)


def _open_direct(path: str) -> int | None:
    """:func:`_open_buffered` with O_DIRECT; None where the kernel refuses direct IO for
    it (EINVAL: tmpfs, some FUSE servers)."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return open_regular(path, os.O_RDONLY | os.O_DIRECT, follow=True)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return None
