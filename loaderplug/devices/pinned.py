"""Page-locked host buffers the engine reads into, made once per process and reused.

A load to an accelerator reads each range straight into a pinned buffer: O_DIRECT reads
need page-aligned memory, and an asynchronous host-to-device copy needs page-locked
memory, so each buffer is an anonymous mapping (page-aligned by construction, exactly
its size) that the backend pins. Pinning touches and locks every page, which costs far
more than the copy on a fresh host (8 x 64 MiB took 0.46 s on an H200 VM), so a
backend's :class:`PinnedPool` lends its buffers to every file and every load for as long
as something holds it: a load in progress, or the owner of a backend that lives as long
as the process (the CUDA backend of each device keeps its pool). A pool nothing holds any
more unpins its buffers, so a plugin that makes a backend per load leaves no page-locked
memory behind it; the pool of a backend another load is using is that load's too.

The pool holds at most a load's bytes in flight (a single buffer larger than that is
made when nothing else is pinned): it grows only within that, and when a load asks for
a size it has no free buffer of (a file's last range with its tail room for an O_DIRECT
read past the end, just over the span size), it unpins free buffers that do not fit
first. A buffer comes back with an event that completes after the last copy
that reads it (or none, where every copy from it is known to be done), and is lent again,
or unpinned, only once that event completed. It comes back to the pool that lent it
(:func:`give_back`) whenever it comes: a reader a load stopped waiting for (a second
interrupt) gives its buffer back after the load let go of the pool, and the pool, kept
alive by its lent buffers, counts it free again rather than full for good.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from loaderplug.devices.backend import CopyEvent, DeviceBackend
from loaderplug.engine.retry import Cancelled
from loaderplug.storage.source import aligned_buffer

# Buffers are made in whole pages: a range's size, with its tail room, rounded up.
GRAIN = mmap.PAGESIZE
# How often a reader waiting for a buffer looks at the cancel flag.
WAIT_S = 0.05


@dataclass(eq=False)
class PinnedBuffer:
    """A page-locked buffer: its memory (``view``, writable) and the backend's tensor
    over it (``host``), the source of copies to the device."""

    memory: mmap.mmap
    view: memoryview
    host: Any
    capacity: int
    # The pool that lent it, while lent: where it goes back, held alive until then. None
    # while free, so that a free buffer makes no cycle with its pool, which would then
    # outlive its holders until the garbage collector ran.
    lender: PinnedPool | None = None


class PinnedPool:
    """The pinned buffers of one backend, lent to readers and given back by writers."""

    def __init__(self, backend: DeviceBackend) -> None:
        self.backend = backend
        self.pinned_bytes = 0  # every buffer made and not unpinned, lent or free
        self.peak_bytes = 0
        self.made = 0
        self.lent = 0  # buffers lent and not given back
        self._free: list[tuple[PinnedBuffer, CopyEvent | None]] = []
        self._cond = threading.Condition()
        # Given the backend and the free list, not the pool, which is gone by then; not at
        # exit, where the process's end frees the memory and the device runtime may be
        # torn down already.
        weakref.finalize(self, _unpin_all, backend, self._free).atexit = False

    def take(self, nbytes: int, limit: int, cancel: threading.Event) -> PinnedBuffer:
        """A buffer of at least ``nbytes``, the pool holding at most ``limit`` bytes (with
        tail room); waits for one to come back while there is no room."""
        capacity = -(-max(nbytes, 1) // GRAIN) * GRAIN
        while True:
            with self._cond:
                lent, evict, make = self._choose(nbytes, capacity, limit, cancel)
            if lent is not None:
                buffer, event = lent
                try:
                    if event is not None:
                        event.synchronize()  # outside the lock: other readers go on
                except BaseException:
                    self.give(buffer, event, lent=False)
                    raise
                with self._cond:
                    self.lent += 1
                buffer.lender = self
                return buffer
            if evict is not None:
                self._unpin(*evict)
                continue
            assert make
            return self._pin(capacity)

    def _choose(
        self, nbytes: int, capacity: int, limit: int, cancel: threading.Event
    ) -> tuple[tuple[PinnedBuffer, CopyEvent | None] | None, Any, bool]:
        """Under the lock: a free buffer to lend, else one to unpin to make room, else
        room reserved for a new one (True); waits while none of these can be had."""
        while True:
            if cancel.is_set():
                raise Cancelled
            fits = [i for i, (b, _) in enumerate(self._free) if b.capacity >= nbytes]
            if fits:
                best = min(fits, key=lambda i: self._free[i][0].capacity)
                return self._free.pop(best), None, False
            if self.pinned_bytes == 0 or self.pinned_bytes + capacity <= limit:
                self._reserve(capacity)
                return None, None, True
            if self._free:
                smallest = min(range(len(self._free)), key=lambda i: self._free[i][0].capacity)
                return None, self._free.pop(smallest), False
            self._cond.wait(WAIT_S)

    def _reserve(self, capacity: int) -> None:
        self.pinned_bytes += capacity
        self.peak_bytes = max(self.peak_bytes, self.pinned_bytes)
        self.made += 1

    def _unreserve(self, capacity: int) -> None:
        with self._cond:
            self.pinned_bytes -= capacity
            self._cond.notify_all()

    def _pin(self, capacity: int) -> PinnedBuffer:
        """A new buffer of ``capacity`` (reserved already), lent; nothing held if it fails."""
        memory = None
        try:
            memory = aligned_buffer(capacity)
            host = self.backend.pin(memory)
        except BaseException:
            if memory is not None:
                memory.close()
            self._unreserve(capacity)
            raise
        with self._cond:
            self.lent += 1
        return PinnedBuffer(memory, memoryview(memory), host, capacity, lender=self)

    def _unpin(self, buffer: PinnedBuffer, event: CopyEvent | None) -> None:
        try:
            _unpin(self.backend, buffer, event)
        finally:
            self._unreserve(buffer.capacity)

    def give(
        self, buffer: PinnedBuffer, event: CopyEvent | None = None, *, lent: bool = True
    ) -> None:
        """``buffer`` back, to be lent again once ``event`` completed: one recorded after
        the last copy from it (None: every copy from it is done)."""
        with self._cond:
            if lent:
                self.lent -= 1
            buffer.lender = None
            self._free.append((buffer, event))
            self._cond.notify_all()

    def clear(self) -> None:
        """Unpin every free buffer (lent ones stay with their borrowers)."""
        with self._cond:
            free = list(self._free)
            self._free.clear()  # the same list: the pool's finalizer holds it
        for buffer, event in free:
            self._unpin(buffer, event)


def give_back(buffer: PinnedBuffer, event: CopyEvent | None = None) -> None:
    """``buffer`` back to the pool that lent it, to be lent again once ``event``
    completed (see :meth:`PinnedPool.give`), whether or not anything else holds that pool
    still."""
    lender = buffer.lender
    assert lender is not None, "a pinned buffer given back twice"
    lender.give(buffer, event)


def _unpin(backend: DeviceBackend, buffer: PinnedBuffer, event: CopyEvent | None) -> None:
    """``buffer`` unpinned once ``event`` completed, and its mapping closed."""
    try:
        if event is not None:
            event.synchronize()
        backend.unpin(buffer.host)
    finally:
        buffer.host = None
        buffer.view.release()
        # A slice still referenced elsewhere (an exception's frames) keeps the
        # mapping until it dies; it is no longer pinned, nor the pool's.
        with contextlib.suppress(BufferError):
            buffer.memory.close()


def _unpin_all(backend: DeviceBackend, free: list[tuple[PinnedBuffer, CopyEvent | None]]) -> None:
    """The free buffers of a pool nothing holds any more, unpinned."""
    while free:
        _unpin(backend, *free.pop())


_pools_lock = threading.Lock()
# Pools by their backend's id, while something holds them (see the module doc); a pool
# holds its backend, so an id stays its backend's for as long as the pool is found here.
_pools: weakref.WeakValueDictionary[int, PinnedPool] = weakref.WeakValueDictionary()


def pool_of(backend: DeviceBackend) -> PinnedPool:
    """The pool of ``backend``: the one something holds already (a load in progress,
    the backend's owner), else a new one. Hold it to keep its buffers across loads."""
    with _pools_lock:
        pool = _pools.get(id(backend))
        if pool is None:
            pool = PinnedPool(backend)
            _pools[id(backend)] = pool
        return pool


def release_pinned_memory() -> None:
    """Unpin every free buffer of every pool: for a process done loading (a server that
    loaded its model), which need not keep bytes in flight of page-locked memory. A later
    load pins afresh."""
    with _pools_lock:
        pools = list(_pools.values())
    for pool in pools:
        pool.clear()
