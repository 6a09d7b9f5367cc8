"""What a device backend is: the few device calls a load to an accelerator makes.

A backend is chosen once per load (the ``loaderplug_device_backend`` hook; the built-in
answer is :class:`~loaderplug.devices.cuda.CudaBackend` for a CUDA device) and everything
device-specific goes through it: pinning host memory, allocating device memory, copying
asynchronously on one of its streams, and the events that say a copy completed. Tests
drive the same load with a backend whose copies run late on threads of their own
(:mod:`loaderplug.testing.fake_device`), so a buffer reused too early shows up as a wrong
tensor rather than as a rare corruption on a GPU.
"""

from __future__ import annotations

import mmap
from typing import Any, Protocol


class CopyEvent(Protocol):
    def query(self) -> bool:
        """True once every copy recorded before the event has completed."""

    def synchronize(self) -> None:
        """Block until :meth:`query` would be true (without holding the GIL)."""


class DeviceBackend(Protocol):
    """One device's side of a load."""

    # The device tensors land on ("cuda:0"), and the torch.distributed backend that
    # moves tensors between ranks' devices ("nccl").
    device: str
    collective: str
    # How many copy streams it has: a load spreads its buffers' copies over them.
    streams: int

    def pin(self, memory: mmap.mmap) -> Any:
        """A ``uint8`` host tensor over ``memory`` (page-aligned, never moved), which the
        device can now copy from asynchronously."""

    def unpin(self, host: Any) -> None:
        """Undo :meth:`pin`; called only once every copy from it has completed."""

    def empty(self, nbytes: int) -> Any:
        """Uninitialised ``uint8`` device memory."""

    def copy_async(self, dst: Any, src: Any, stream: int) -> None:
        """Enqueue ``dst.copy_(src)`` (pinned host to device) on stream ``stream``; returns
        at once."""

    def record(self, stream: int) -> CopyEvent:
        """An event that completes after every copy enqueued on ``stream`` so far."""

    def to_device(self, tensor: Any) -> Any:
        """A copy of a host tensor (pageable, say a mapping of the page cache) on the
        device, complete when it returns."""
