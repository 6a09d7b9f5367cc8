"""A file's tensors straight to a device: read into pinned memory, copied once.

:class:`DeviceTensorSink` is the sink of a file loaded to a device with a backend (see
:mod:`loaderplug.tensors.device_path`). It gives the engine a pinned buffer for each
range (:meth:`~DeviceTensorSink.place`): the reader's ``pread`` (O_DIRECT where the
policy says so) lands there, and there is no copy on the host. Each step the engine
hands on is copied from that buffer to the file's device memory with one non-blocking
copy on the buffer's stream; the writer that queued it waits for its event (without
the GIL), then counts the bytes landed, so a tensor whose last bytes those were is
whole on the device when it is handed over. Readers go on filling other buffers
meanwhile, and the writers' copies run side by side on the backend's streams.

The file's device memory is one allocation of its data area, made when its first
bytes arrive; every tensor is a view of it (a tensor whose offset does not suit its
dtype gets a copy of its own on the device), so a range is one copy however many
tensors it holds, and the memory is freed when the last of the file's tensors is.

A buffer goes back to the pool once its reader is done with it and every byte read
into it was copied, or the file failed: never while a ``pread`` may still fill it or a
copy still read it. A failed file's copies in flight are waited for before its device
memory is let go, so a late copy cannot write into memory the allocator has handed to
another file.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loaderplug.devices.backend import CopyEvent
from loaderplug.devices.pinned import PinnedBuffer
from loaderplug.engine.retry import Cancelled
from loaderplug.tensors.header import Header, TensorInfo
from loaderplug.tensors.sinks import Coverage, Emit, torch_dtypes

if TYPE_CHECKING:
    from loaderplug.tensors.device_path import DevicePath


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
    """Lands a file's ranges in pinned buffers and its tensors on the device."""

    def __init__(self, header: Header, path: DevicePath, emit: Emit, limit: int) -> None:
        assert path.backend is not None
        self.header, self.path, self.emit, self.limit = header, path, emit, limit
        self.backend = path.backend
        self._dtypes = torch_dtypes(header)
        self._coverage = Coverage(header)
        self._regions: list[_Region] = []
        self._memory: Any = None  # the file's data area on the device, made on first need
        self._in_flight: list[CopyEvent] = []
        self._lock = threading.Lock()
        self._aborted = False

    def prepare(self) -> None:
        for t in self.header.tensors:
            if not t.nbytes:
                self.emit(t.name, self._formed(t, self.backend.empty(0)))

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
        if region is None:
            self._write_unplaced(data, offset)
        else:
            start = offset - region.offset
            if not self._copy(region.buffer.host[start : start + len(data)], offset, region.stream):
                return
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

    def _write_unplaced(self, data: memoryview, offset: int) -> None:
        """Bytes this sink did not place (another engine's buffer): they reach the device
        through a pageable copy, counted as a copy on the host."""
        import torch

        with self._lock:
            if self._aborted:
                return
        host = torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0)
        moved = self.path.to_device(host)
        self._copy_within(moved, offset)

    def _copy(self, host: Any, offset: int, stream: int) -> bool:
        """Copy ``host`` (the file's bytes at ``offset``, pinned) to the file's device
        memory, but the header's; returns once the copy completed, False if the file
        was aborted first."""
        start = self.header.data_start
        lo, hi = max(offset, start), min(offset + len(host), self.header.size)
        if hi <= lo:
            return True  # the header: nothing of it goes to the device
        with self._lock:
            if self._aborted:
                return False
            target = self._device_memory()[lo - start : hi - start]
            self.backend.copy_async(target, host[lo - offset : hi - offset], stream)
            event = self.backend.record(stream)
            self._in_flight.append(event)
        try:
            event.synchronize()
        finally:
            with self._lock:
                self._in_flight.remove(event)
        self.path.count(device=hi - lo)
        return True

    def _copy_within(self, moved: Any, offset: int) -> None:
        start = self.header.data_start
        lo, hi = max(offset, start), min(offset + moved.numel(), self.header.size)
        if hi > lo:
            with self._lock:
                if not self._aborted:
                    self._device_memory()[lo - start : hi - start].copy_(
                        moved[lo - offset : hi - offset]
                    )

    def _device_memory(self) -> Any:
        """The file's data area on the device (under the lock)."""
        if self._memory is None:
            self._memory = self.backend.empty(self.header.size - self.header.data_start)
        return self._memory

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
        with self._lock:
            memory = self._memory
        if memory is None:  # aborted meanwhile
            return
        start = t.begin - self.header.data_start
        self.emit(t.name, self._formed(t, memory[start : start + t.nbytes]))

    def _formed(self, t: TensorInfo, raw: Any) -> Any:
        """The tensor over ``raw`` (its bytes on the device): a view, or where its offset
        does not suit its dtype (``view`` refuses it), a copy of its own."""
        dtype = self._dtypes[t.name]
        if raw.numel() and raw.storage_offset() % dtype.itemsize:
            raw = raw.clone()
        return raw.view(dtype).reshape(t.torch_shape)

    # -- the end --------------------------------------------------------------------

    def commit(self) -> None:
        self._coverage.check_complete(self.header.path)
        with self._lock:
            self._memory = None  # the tensors hold it now

    def abort(self) -> None:
        self._coverage.abort()
        with self._lock:
            self._aborted = True
            in_flight = list(self._in_flight)
            done = [r for r in self._regions if not r.reading]
            self._regions = [r for r in self._regions if r.reading]
        # Buffers go back fenced by their streams' events (see _give_back); the device
        # memory only once the copies queued before the abort finished, so that none
        # writes into memory the allocator has handed to another file meanwhile.
        for region in done:
            self._give_back(region, aborted=True)
        for event in in_flight:
            with contextlib.suppress(Exception):  # a failed copy failed its file already
                event.synchronize()
        with self._lock:
            self._memory = None
