"""A file's tensors straight to a device: read into pinned memory, copied once.

:class:`DeviceTensorSink` is the sink of a file loaded to a device with a backend (see
:mod:`loaderplug.tensors.device.path`). It gives the engine a pinned buffer for each
range (:meth:`~DeviceTensorSink.place`): the reader's ``pread`` (O_DIRECT where the
policy says so) lands there, and there is no copy on the host. Each step the engine
hands on is copied from that buffer into the device memory of the tensors it covers,
one non-blocking copy per tensor on the buffer's stream, then one event; the writer
that queued them waits for that event (without the GIL), then counts the bytes landed,
so a tensor whose last bytes those were is whole on the device when it is handed over.
Readers go on filling other buffers meanwhile, and the writers' copies run side by side
on the backend's streams.

Each tensor has device memory of its own, allocated when its first bytes are copied and
owned by the tensor alone once handed over: it is freed when the consumer drops the
tensor, whatever else of the file it keeps (a weight loader that copies each weight
into its parameter needs one weight's memory at a time, not a file's). The device
memory of tensors not handed over yet is held in the load's device budget (see
:mod:`loaderplug.tensors.memory.budget`): each tensor whole, from the admission of the span
that begins it, before that span is read.

A buffer goes back to the pool once its reader is done with it and every byte read
into it was copied, or the file failed: never while a ``pread`` may still fill it or a
copy still read it. A failed file's copies in flight are waited for before its device
memory is let go, so a late copy cannot write into memory the allocator has handed to
another tensor.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loaderplug.devices.backend import CopyEvent
from loaderplug.devices.pinned import PinnedBuffer
from loaderplug.engine.retry import Cancelled
from loaderplug.tensors.format.coverage import Coverage, Emit
from loaderplug.tensors.format.header import Header, TensorInfo
from loaderplug.tensors.format.torch_dtypes import torch_dtypes
from loaderplug.tensors.memory.budget import FileHold, MemoryBudget

if TYPE_CHECKING:
    from loaderplug.tensors.device.path import DevicePath

# A tensor's bytes within a write: the tensor, and where they begin and end in the file.
Piece = tuple[TensorInfo, int, int]


@dataclass(eq=False)
class _Region:
    """A pinned buffer lent to one range of the file: ``expected`` bytes of it (all but
    the tail room) are the file's from ``offset``."""

    offset: int
    expected: int
    buffer: PinnedBuffer
    stream: int
    landed: int = 0
    reading: bool = True  # its reader may still be filling it


class DeviceTensorSink:
    """Lands a file's ranges in pinned buffers and its tensors on the device. ``limit``
    bounds the pinned pool; ``budget``, if given, the device memory of the tensors not
    handed over yet."""

    def __init__(
        self,
        header: Header,
        path: DevicePath,
        emit: Emit,
        limit: int,
        budget: MemoryBudget | None = None,
    ) -> None:
        assert path.backend is not None
        self.header, self.path, self.emit, self.limit = header, path, emit, limit
        self.backend = path.backend
        self._dtypes = torch_dtypes(header)
        self._coverage = Coverage(header)
        self._hold = FileHold(self._coverage.tensors, budget)
        self._regions: list[_Region] = []
        # Each tensor's device memory, from its first bytes copied until it is emitted.
        self._memory: dict[str, Any] = {}
        self._in_flight: list[CopyEvent] = []
        self._lock = threading.Lock()
        self._aborted = False

    def prepare(self) -> None:
        for t in self.header.tensors:
            if not t.nbytes:
                self.emit(t.name, self._formed(t, self.backend.empty(0)))

    # -- the device budget ----------------------------------------------------------

    def admit(self, offset: int, length: int, cancel: threading.Event) -> None:
        """Hold in the device budget, before ``[offset, offset+length)`` is read, every
        tensor it begins, whole."""
        with self._lock:
            if self._aborted:
                raise Cancelled
        self._hold.admit(offset, length, cancel)

    # -- the engine's reads ---------------------------------------------------------

    def place(self, offset: int, length: int, cancel: threading.Event) -> memoryview:
        """A pinned buffer for the range, from the pool (waiting for one to come back
        while the pool is at its limit); Cancelled if the file was aborted."""
        with self._lock:
            if self._aborted:
                raise Cancelled
        buffer = self.path.take(length, self.limit, cancel)
        expected = min(length, self.header.size - offset)
        region = _Region(offset, expected, buffer, self.path.next_stream())
        with self._lock:
            aborted = self._aborted
            if not aborted:
                self._regions.append(region)
        if aborted:
            self.path.give(buffer)
            raise Cancelled
        return buffer.view[:length]

    def placed_read_done(self, offset: int) -> None:
        with self._lock:
            region = next((r for r in self._regions if r.offset == offset), None)
            if region is None:
                return
            region.reading = False
            aborted = self._aborted
            done = aborted or region.landed == region.expected
            if done:
                self._regions.remove(region)
        if done:
            self._give_back(region, aborted)

    def _give_back(self, region: _Region, aborted: bool) -> None:
        """``region``'s buffer back to the pool. Every byte landed: each copy from it was
        waited for. Aborted: a copy from it may still be queued (its writer waits for it
        while abort() waits for all), and no copy is queued after the abort, so an event
        recorded now on its stream follows every copy from it."""
        self.path.give(region.buffer, self.backend.record(region.stream) if aborted else None)

    # -- the engine's writes --------------------------------------------------------

    def write(self, data: memoryview, offset: int) -> None:
        region = self._region_of(data, offset)
        pieces = list(self._coverage.pieces(offset, offset + len(data)))
        if region is None:
            copied = self._copy_unplaced(data, offset, pieces)
        else:
            start = offset - region.offset
            host = region.buffer.host[start : start + len(data)]
            copied = self._copy(host, offset, pieces, region.stream)
        if not copied:
            return  # the file was aborted: abort() gives the buffer back
        for t in self._coverage.landed(offset, offset + len(data)):
            self._deliver(t)
        if region is not None:
            self._count_landed(region, len(data))

    def _region_of(self, data: memoryview, offset: int) -> _Region | None:
        with self._lock:
            for region in self._regions:
                if (
                    data.obj is region.buffer.memory
                    and 0 <= offset - region.offset < region.expected
                ):
                    return region
        return None

    def _copy(self, host: Any, offset: int, pieces: list[Piece], stream: int) -> bool:
        """Copy ``host`` (the file's bytes at ``offset``, pinned) into the device memory
        of the tensors it covers, ``pieces``; returns once the copies completed, False
        if the file was aborted first."""
        if not pieces:
            return True  # the header: nothing of it goes to the device
        with self._lock:
            if self._aborted:
                return False
            for t, begin, end in pieces:
                target = self._memory_of(t)[begin - t.begin : end - t.begin]
                self.backend.copy_async(target, host[begin - offset : end - offset], stream)
            event = self.backend.record(stream)
            self._in_flight.append(event)
        try:
            event.synchronize()
        finally:
            with self._lock:
                self._in_flight.remove(event)
        self.path.count(device=sum(end - begin for _, begin, end in pieces))
        return True

    def _copy_unplaced(self, data: memoryview, offset: int, pieces: list[Piece]) -> bool:
        """Bytes this sink did not place (another engine's buffer, pageable): copied
        synchronously, each tensor's piece straight into its device memory, and counted
        as copied on the host too (the driver stages pageable memory)."""
        import torch

        if not pieces:
            return True  # the header: nothing of it goes to the device
        host = torch.frombuffer(data, dtype=torch.uint8)
        with self._lock:
            if self._aborted:
                return False
            for t, begin, end in pieces:
                target = self._memory_of(t)[begin - t.begin : end - t.begin]
                target.copy_(host[begin - offset : end - offset])
        nbytes = sum(end - begin for _, begin, end in pieces)
        self.path.count(host=nbytes, device=nbytes)
        return True

    def _memory_of(self, t: TensorInfo) -> Any:
        """``t``'s device memory, allocated on its first bytes (under the lock)."""
        memory = self._memory.get(t.name)
        if memory is None:
            memory = self._memory[t.name] = self.backend.empty(t.nbytes)
        return memory

    def _count_landed(self, region: _Region, nbytes: int) -> None:
        with self._lock:
            region.landed += nbytes
            done = not region.reading and region.landed == region.expected
            if done and region in self._regions:
                self._regions.remove(region)
            else:
                done = False
        if done:
            self._give_back(region, aborted=False)

    # -- tensors --------------------------------------------------------------------

    def _deliver(self, t: TensorInfo) -> None:
        """Hand ``t`` on, its memory with it: the sink keeps no reference to it."""
        with self._lock:
            memory = self._memory.pop(t.name, None)
        if memory is None or not self._hold.emitting(t.nbytes):
            return  # aborted meanwhile: its memory went back with the file
        self.emit(t.name, self._formed(t, memory))

    def _formed(self, t: TensorInfo, raw: Any) -> Any:
        """The tensor over ``raw``, its own memory (which begins at a device allocation's
        start, so suits every dtype)."""
        return raw.view(self._dtypes[t.name]).reshape(t.torch_shape)

    # -- the end --------------------------------------------------------------------

    def commit(self) -> None:
        self._coverage.check_complete(self.header.path)
        self._hold.close()

    def abort(self) -> None:
        self._coverage.abort()
        with self._lock:
            self._aborted = True
            in_flight = list(self._in_flight)
            done = [r for r in self._regions if not r.reading]
            self._regions = [r for r in self._regions if r.reading]
        # Buffers go back fenced by their streams' events (see _give_back); the device
        # memory only once the copies queued before the abort finished, so that none
        # writes into memory the allocator has handed to another tensor meanwhile.
        for region in done:
            self._give_back(region, aborted=True)
        for event in in_flight:
            with contextlib.suppress(Exception):  # a failed copy failed its file already
                event.synchronize()
        with self._lock:
            self._memory.clear()
        # Only now does the budget let other tensors in: this file's memory is freed.
        self._hold.close()
