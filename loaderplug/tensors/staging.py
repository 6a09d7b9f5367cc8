"""Getting landed bytes onto an accelerator: pinned staging, a side stream, event-gated reuse.

The engine lands each range in host memory of its own (a pool buffer or the tensor
sink's mapping). For a CUDA destination the bytes then take one more hop:

1. a pinned (page-locked) staging buffer is taken from a pool whose buffers add up to at
   most the job's bytes in flight, and the range is copied into it;
2. the pieces of every tensor the range covers are copied to that tensor's device memory
   with non-blocking copies on a side stream, so the copies overlap the reads;
3. an event is recorded after them, and the buffer goes back to the pool with it: it is
   handed out again only once that event has completed, so a copy never reads a buffer
   that a later range is already overwriting.

A tensor is handed over once its last piece's event has completed: it is whole on the
device, and owns that memory (allocated per tensor, never reused by loaderplug).

The device calls go through :class:`CopyBackend`, which :class:`CudaBackend` implements
with torch; tests drive the same pool and sink with a backend whose copies run late on
a thread of their own, so a buffer reused too early shows up as a wrong tensor.
"""

from __future__ import annotations

import collections
import threading
from typing import TYPE_CHECKING, Any, Protocol

from loaderplug.units import MiB

if TYPE_CHECKING:
    import torch

# Pinned buffers this size reach full host-to-device bandwidth on current GPUs, and are
# small enough that the pool's budget (bytes in flight) holds many of them.
STAGING_BUFFER_BYTES = 16 * MiB


class CopyEvent(Protocol):
    def query(self) -> bool:
        """True once everything recorded before the event has completed."""

    def synchronize(self) -> None:
        """Block until ``query`` would be true."""


class CopyBackend(Protocol):
    """The device side of staging: allocate, copy asynchronously, and order with events."""

    def empty(self, nbytes: int) -> torch.Tensor:
        """Uninitialised ``uint8`` device memory."""

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A page-locked ``uint8`` host buffer."""

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Enqueue ``dst.copy_(src)`` on the side stream; returns at once."""

    def record(self) -> CopyEvent:
        """An event that completes after every copy enqueued so far."""


class CudaBackend:
    """:class:`CopyBackend` on one CUDA device, with one side stream for all copies."""

    def __init__(self, device: str) -> None:
        import torch

        self._torch = torch
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]

    def empty(self, nbytes: int) -> torch.Tensor:
        return self._torch.empty(nbytes, dtype=self._torch.uint8, device=self.device)

    def pinned(self, nbytes: int) -> torch.Tensor:
        return self._torch.empty(nbytes, dtype=self._torch.uint8, pin_memory=True)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # Device memory is allocated on the default stream and written on the side one;
        # tensors are handed over only after their copies' event completed (see
        # DeviceTensorSink), so the caching allocator never sees a pending use.
        with self._torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)

    def record(self) -> CopyEvent:
        event = self._torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.stream)
        return event


def backend_for(device: str) -> CopyBackend | None:
    """The staging backend for ``device``, or None where tensors are assembled in host
    memory and moved with ``.to(device)`` (the CPU itself, and devices without one)."""
    if device == "cuda" or device.startswith("cuda:"):
        return CudaBackend(device)
    return None


class StagingPool:
    """At most ``count`` pinned buffers of ``size`` bytes, made on first need.

    A buffer comes back with the event of the copies that read it, and is handed out
    again only after that event completed; the oldest comes back first, as it is the
    likeliest to be done.
    """

    def __init__(self, backend: CopyBackend, size: int, count: int) -> None:
        self.backend = backend
        self.size = size
        self.count = max(1, count)
        self.made = 0
        self._returned: collections.deque[tuple[torch.Tensor, CopyEvent]] = collections.deque()
        self._cond = threading.Condition()

    def take(self) -> torch.Tensor:
        with self._cond:
            while not self._returned and self.made == self.count:
                self._cond.wait()
            if not self._returned:
                self.made += 1
                return self.backend.pinned(self.size)
            buffer, event = self._returned.popleft()
        event.synchronize()  # outside the lock: other writers keep taking and giving
        return buffer

    def give(self, buffer: torch.Tensor, event: CopyEvent) -> None:
        with self._cond:
            self._returned.append((buffer, event))
            self._cond.notify()


def pool_for(backend: CopyBackend, bytes_in_flight: int) -> StagingPool:
    size = min(STAGING_BUFFER_BYTES, bytes_in_flight)
    return StagingPool(backend, size, bytes_in_flight // size)


def fill(buffer: torch.Tensor, data: memoryview) -> None:
    """Copy ``data`` into the start of the host tensor ``buffer``.

    Through numpy, which lets go of the GIL for the copy: a memoryview assignment holds
    it for the whole memcpy, so the writers staging at once copied one at a time. On an
    H200 host, 4 GiB from the page cache reached the GPU in 0.47-0.54 s with the copy out
    of the GIL against 1.06-1.15 s (benchmarks/results/gpu.md; measured with torch's
    ``copy_``, which splits each copy over a team of threads per writer: numpy's stays on
    the writer's thread, and gave the same 8 writers' throughput on the CPU here)."""
    import numpy as np

    host: Any = buffer.numpy()
    np.copyto(host[: len(data)], np.frombuffer(data, dtype=np.uint8))
