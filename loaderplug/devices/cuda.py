"""The CUDA backend: pinned buffers by ``cudaHostRegister``, copies on a few streams.

Pinned memory comes from our own anonymous mappings, registered with the CUDA runtime,
rather than from ``torch.empty(pin_memory=True)``: torch's pinned allocator rounds a
size up to a power of two (64 MiB + 64 KiB of tail room would cost 128 MiB) and, with
``pinned_use_cuda_host_register``, hands out memory that is not page-aligned, which
O_DIRECT refuses. A registered mapping is exactly its size and page-aligned.

torch records nothing for a ``non_blocking`` copy from memory it did not allocate: the
events of :meth:`CudaBackend.record` are what keeps a buffer from being reused (or
unregistered) while a copy still reads it.
"""

from __future__ import annotations

import mmap
import threading
from typing import Any

from loaderplug.devices.backend import CopyEvent
from loaderplug.devices.pinned import PinnedPool, pool_of
from loaderplug.errors import LoaderplugError

# Copy streams per device: one is enough for the bandwidth; a few let the copies of
# ranges that landed side by side run side by side (fastsafetensors gives each of its
# slots a stream).
COPY_STREAMS = 4
# cudaHostRegisterPortable: the pinned memory counts as pinned in every CUDA context.
HOST_REGISTER_PORTABLE = 1


class CudaBackend:
    """:class:`~loaderplug.devices.backend.DeviceBackend` on one CUDA device."""

    collective = "nccl"

    def __init__(self, device: str, streams: int = COPY_STREAMS) -> None:
        import torch

        self._torch = torch
        self._device = torch.device(device)
        if self._device.index is None:
            self._device = torch.device("cuda", torch.cuda.current_device())
        self.device = str(self._device)
        self._streams = [torch.cuda.Stream(self._device) for _ in range(streams)]  # type: ignore[no-untyped-call]
        self.streams = streams

    def pin(self, memory: mmap.mmap) -> Any:
        torch = self._torch
        host = torch.frombuffer(memory, dtype=torch.uint8)
        # On this device (a reader thread starts on device 0, whose context the call
        # would otherwise create), and portable: usable from every device's context.
        with torch.cuda.device(self._device):
            cudart = torch.cuda.cudart()
            flags = HOST_REGISTER_PORTABLE
            torch.cuda.check_error(cudart.cudaHostRegister(host.data_ptr(), len(memory), flags))
        # A copy from memory that is not page-locked is correct but slow, and silent.
        if not host.is_pinned():
            self.unpin(host)
            raise LoaderplugError("cudaHostRegister returned success, yet the memory is not pinned")
        return host

    def unpin(self, host: Any) -> None:
        torch = self._torch
        with torch.cuda.device(self._device):
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(host.data_ptr()))

    def empty(self, nbytes: int) -> Any:
        """Device memory from the caching allocator, allocated on the calling thread's
        stream (the default one). The allocator may hand out a block whose last use,
        queued on that stream, has not run yet (a consumer's ``param.copy_(tensor)`` of
        a tensor it then dropped): the copy streams wait for that stream's work so far
        before they write into it."""
        torch = self._torch
        memory = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
        allocated = torch.cuda.Event()
        allocated.record(torch.cuda.current_stream(self._device))
        for stream in self._streams:
            stream.wait_event(allocated)
        return memory

    def copy_async(self, dst: Any, src: Any, stream: int) -> None:
        # Device memory is allocated on the default stream and written on a side one;
        # the load hands a tensor over only after its copies' events completed, and
        # never frees device memory a copy is still writing (see DeviceTensorSink).
        with self._torch.cuda.stream(self._streams[stream]):
            dst.copy_(src, non_blocking=True)

    def record(self, stream: int) -> CopyEvent:
        # Blocking: a writer waiting for its copy sleeps rather than spins on a core the
        # readers need.
        event = self._torch.cuda.Event(blocking=True)  # type: ignore[no-untyped-call]
        event.record(self._streams[stream])
        return event

    def to_device(self, tensor: Any) -> Any:
        return tensor.to(self._device)


_lock = threading.Lock()
_backends: dict[str, CudaBackend] = {}
# Each device's pinned pool, kept with its backend: pinning costs far more than a load's
# copies, so every load of the process reuses the buffers.
_pools: dict[str, PinnedPool] = {}


def cuda_backend(device: str) -> CudaBackend | None:
    """The process's backend for a CUDA ``device`` ("cuda", "cuda:1"), made once (its
    streams and its pinned pool live as long as the process); None if ``device`` is not
    CUDA or torch has no usable CUDA device."""
    if device != "cuda" and not device.startswith("cuda:"):
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    where = torch.device(device)
    key = f"cuda:{where.index if where.index is not None else torch.cuda.current_device()}"
    with _lock:
        if key not in _backends:
            _backends[key] = CudaBackend(key)
            _pools[key] = pool_of(_backends[key])
        return _backends[key]
