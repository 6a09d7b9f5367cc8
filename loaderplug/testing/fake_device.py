"""A stand-in accelerator for tests and for trying the device path without a GPU.

:class:`FakeDevice` implements :class:`~loaderplug.devices.backend.DeviceBackend` on the
CPU, as a GPU behaves where it matters: copies are queued and run later, in order, on
one thread per stream, each after a pause; an event completes when its stream reaches
it; "device memory" is host memory filled with a marker byte, counted as allocated
until the last tensor over it dies (as the caching allocator frees a block). It records
what a test needs to see: every buffer pinned and unpinned, every device allocation,
the device bytes allocated now and at most, every copy, and every misuse a real GPU
would only show as a rare wrong tensor:

* a copy whose source changed between being queued and running (its buffer was lent
  to another read before the copy completed);
* a buffer unpinned while a copy from it was still queued.

Register :class:`FakeDevicePlugin` and load to ``"cuda"``: the load takes exactly the
path it takes on a GPU, through this backend.
"""

from __future__ import annotations

import mmap
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from loaderplug.plugins.hookspecs import hookimpl

# A copy's pause: long next to a memcpy here, so that a buffer reused too early is
# overwritten before its copy runs.
COPY_DELAY_S = 0.0005


class FakeEvent:
    def __init__(self) -> None:
        self._done = threading.Event()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


@dataclass(eq=False)
class _Copy:
    dst: Any
    src: Any
    before: bytes  # the source's bytes when queued


@dataclass
class FakeRecord:
    """What a :class:`FakeDevice` saw."""

    pinned: list[int] = field(default_factory=list)  # each buffer's size, as pinned
    unpinned: int = 0
    allocations: list[int] = field(default_factory=list)  # each device allocation's size
    allocated_bytes: int = 0  # device memory some tensor still holds
    peak_allocated_bytes: int = 0
    frees: int = 0  # device allocations freed
    copies: int = 0
    copied_bytes: int = 0
    misuses: list[str] = field(default_factory=list)


class FakeDevice:
    """A :class:`~loaderplug.devices.backend.DeviceBackend` whose copies run late."""

    collective = "gloo"

    def __init__(
        self, device: str = "cuda:0", streams: int = 2, delay_s: float = COPY_DELAY_S
    ) -> None:
        self.device = device
        self.streams = streams
        self.delay_s = delay_s
        self.record_of = FakeRecord()
        # Reentrant: a tensor freed by a garbage collection that runs while this thread
        # holds the lock counts its bytes under it again.
        self._lock = threading.RLock()
        self._queued: dict[int, int] = {}  # pinned buffer's address -> copies queued
        self._queues: list[queue.SimpleQueue[_Copy | FakeEvent]] = []
        for index in range(streams):
            work: queue.SimpleQueue[_Copy | FakeEvent] = queue.SimpleQueue()
            self._queues.append(work)
            threading.Thread(
                target=self._run, args=(work,), name=f"fake-stream-{index}", daemon=True
            ).start()

    # -- the backend ----------------------------------------------------------------

    def pin(self, memory: mmap.mmap) -> Any:
        import torch

        with self._lock:
            self.record_of.pinned.append(len(memory))
        return torch.frombuffer(memory, dtype=torch.uint8)

    def unpin(self, host: Any) -> None:
        with self._lock:
            self.record_of.unpinned += 1
            if self._queued.get(host.data_ptr()):
                self.record_of.misuses.append("a buffer was unpinned with a copy from it queued")

    def empty(self, nbytes: int) -> Any:
        import numpy as np
        import torch

        with self._lock:
            record = self.record_of
            record.allocations.append(nbytes)
            record.allocated_bytes += nbytes
            record.peak_allocated_bytes = max(record.peak_allocated_bytes, record.allocated_bytes)
        if not nbytes:  # numpy gives an empty array stride 0, which torch will not view
            return torch.empty(0, dtype=torch.uint8)
        memory = np.full(nbytes, 0xAB, dtype=np.uint8)
        # The tensor's storage owns the array: the array dies with the last view of it.
        weakref.finalize(memory, self._freed, nbytes).atexit = False
        return torch.from_numpy(memory)

    def _freed(self, nbytes: int) -> None:
        with self._lock:
            self.record_of.allocated_bytes -= nbytes
            self.record_of.frees += 1

    def copy_async(self, dst: Any, src: Any, stream: int) -> None:
        base = _base_address(src)
        with self._lock:
            self._queued[base] = self._queued.get(base, 0) + 1
        self._queues[stream].put(_Copy(dst, src, bytes(src.numpy())))

    def record(self, stream: int) -> FakeEvent:
        event = FakeEvent()
        self._queues[stream].put(event)
        return event

    def to_device(self, tensor: Any) -> Any:
        moved = self.empty(tensor.numel() * tensor.element_size())
        return moved.view(tensor.dtype).reshape(tensor.shape).copy_(tensor)

    # -- the streams ----------------------------------------------------------------

    def _run(self, work: queue.SimpleQueue[_Copy | FakeEvent]) -> None:
        while True:
            item = work.get()
            if isinstance(item, FakeEvent):
                item._done.set()
            else:
                time.sleep(self.delay_s)
                self._copy(item)
            # A copy done refers to its device memory no more (a stream keeps none alive).
            del item

    def _copy(self, item: _Copy) -> None:
        now = bytes(item.src.numpy())
        item.dst.copy_(item.src)
        base = _base_address(item.src)
        with self._lock:
            self.record_of.copies += 1
            self.record_of.copied_bytes += len(now)
            self._queued[base] -= 1
            if now != item.before:
                self.record_of.misuses.append(
                    "a copy's source changed before it ran: its buffer was lent again too early"
                )


def _base_address(tensor: Any) -> int:
    """The address of the memory ``tensor`` is a view of (its pinned buffer's)."""
    return int(tensor.untyped_storage().data_ptr())


class FakeDevicePlugin:
    """Answers ``loaderplug_device_backend`` for CUDA devices with ``backend``."""

    def __init__(self, backend: FakeDevice) -> None:
        self.backend = backend

    @hookimpl
    def loaderplug_device_backend(self, device: str) -> FakeDevice | None:
        if device == "cuda" or device.startswith("cuda:"):
            return self.backend
        return None
