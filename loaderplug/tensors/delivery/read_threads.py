"""The process's readers: one pool of threads, started once, that every load and every
file shares for the reads a load does without the engine.

Starting threads for each load or each file would cost more than reading a small file;
and reading from the page cache is CPU work (faulting in fresh pages and copying into
them), which :data:`READERS` threads share where one thread would do it alone. The
readers fill the memory of files read into memory of a load's own
(:mod:`loaderplug.tensors.delivery.owned_reads`) and ask the kernel ahead of time for the pages of
cold files a load maps (:func:`prefetch`).
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from loaderplug.units import MiB

# At least two (one more than the consumer's thread), at most four: copying from the
# page cache gains nothing past the memory's bandwidth.
READERS = max(2, min(4, os.cpu_count() or 2))
# A reader's share of a prefetch at a time, asked for in steps: the kernel reads at most
# the device's readahead window (or its largest request, if larger) of one WILLNEED, and
# that is 128 KiB to a few MiB; a MiB at a time costs about as much as 8 (measured here).
PREFETCH_TASK = 64 * MiB
PREFETCH_STEP = 1 * MiB

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def readers() -> ThreadPoolExecutor:
    """The process's readers, started at the first read that needs them."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(READERS, thread_name_prefix="loaderplug-reader")
        return _pool


def _forget_readers() -> None:
    # A forked child has none of its parent's threads: its first read starts its own.
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_readers)


def prefetch(path: str, size: int) -> None:
    """Have the readers ask the kernel to read ``path``'s ``size`` bytes into the page
    cache, in file order, without waiting: a mapping of a cold file then finds its pages
    coming in from several requests in flight, not one readahead window at a time."""
    pool = readers()
    for offset in range(0, size, PREFETCH_TASK):
        pool.submit(_ask_for_pages, path, offset, min(PREFETCH_TASK, size - offset))


def _ask_for_pages(path: str, offset: int, length: int) -> None:
    # Advice, not a read: a file gone or changed since is the mapping's business.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for step in range(offset, offset + length, PREFETCH_STEP):
                end = min(step + PREFETCH_STEP, offset + length)
                os.posix_fadvise(fd, step, end - step, os.POSIX_FADV_WILLNEED)
        finally:
            os.close(fd)
