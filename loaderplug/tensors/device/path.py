"""Where one load's tensors go and how they get there, decided once per load.

:func:`device_path_for` asks the plugins for the device's backend (the built-in one is
CUDA's) and returns a :class:`DevicePath`, the one object the rest of the load consults
about the device: the delivery asks it for a file's sink, the ranks for how a tensor
mapped from the page cache reaches the device, where a broadcast lands and which
collective carries it. With a backend, ranges are read straight into its pinned buffers
and copied from there (:mod:`loaderplug.tensors.device.sink`); without one, tensors are
assembled in host memory and, for a device other than the CPU, moved with ``.to``.

It also counts what the way to the device cost, for the load's record and the
benchmarks: tensor bytes copied from host memory to host memory on the way (none on
the pinned path), and bytes copied to the device.
"""

from __future__ import annotations

import itertools
import math
import threading
from typing import TYPE_CHECKING, Any

from loaderplug.devices.pinned import PinnedBuffer, PinnedPool, give_back, pool_of
from loaderplug.engine.sizing import CHUNK_ALIGNMENT
from loaderplug.errors import LoaderplugError
from loaderplug.plugins.manager import Plugins
from loaderplug.settings import Settings
from loaderplug.tensors.memory.budget import device_limit

if TYPE_CHECKING:
    import torch

    from loaderplug.devices.backend import CopyEvent, DeviceBackend


class DevicePath:
    """One load's device (``"cpu"``, ``"cuda:0"``) and its backend, or None."""

    def __init__(self, device: str, backend: DeviceBackend | None) -> None:
        self.device = backend.device if backend is not None else device
        self.backend = backend
        self.pool: PinnedPool | None = pool_of(backend) if backend is not None else None
        self._pinned_peak_bytes = 0  # the pool's, once let go of
        # Tensor bytes copied host to host on the way to the device (a pageable copy to
        # a device counts: the driver stages it through pinned memory of its own).
        self.host_copied_bytes = 0
        self.device_copied_bytes = 0  # host to device
        self._streams = itertools.count()
        self._lock = threading.Lock()

    @property
    def on_host(self) -> bool:
        """Whether the tensors stay in host memory (the device is the CPU)."""
        return self.device == "cpu"

    @property
    def collective(self) -> str:
        """The torch.distributed backend that carries this load's tensors between ranks."""
        return self.backend.collective if self.backend is not None else "gloo"

    @property
    def pinned_peak_bytes(self) -> int:
        """The most pinned memory the process held (its pool is shared by its loads)."""
        return self.pool.peak_bytes if self.pool is not None else self._pinned_peak_bytes

    # -- the pinned path ---------------------------------------------------------------

    def take(self, nbytes: int, limit: int, cancel: threading.Event) -> PinnedBuffer:
        assert self.backend is not None, "a load without a device backend has no pinned pool"
        if self.pool is None:  # let go of at an interrupt the load went on from: taken again
            self.pool = pool_of(self.backend)
        return self.pool.take(nbytes, limit, cancel)

    def give(self, buffer: PinnedBuffer, event: CopyEvent | None = None) -> None:
        """``buffer`` back to the pool that lent it, lent again once ``event`` completed
        (None: every copy from it is done); after :meth:`release` too, where a reader the
        load stopped waiting for (a second interrupt) gives its buffer back late."""
        give_back(buffer, event)

    def release(self) -> None:
        """Let go of the pinned pool, the load being over: one that nothing else holds (a
        backend made for this load) unpins its buffers now (see
        :mod:`loaderplug.devices.pinned`)."""
        if self.pool is not None:
            self._pinned_peak_bytes = self.pool.peak_bytes
            self.pool = None

    def next_stream(self) -> int:
        """The copy stream of the next buffer: buffers take the streams in turn."""
        assert self.backend is not None
        return next(self._streams) % self.backend.streams

    def count(self, *, host: int = 0, device: int = 0) -> None:
        with self._lock:
            self.host_copied_bytes += host
            self.device_copied_bytes += device

    # -- tensors that are in host memory already ---------------------------------------

    def to_device(self, tensor: Any) -> Any:
        """A host tensor (say, a mapping of the page cache another rank filled) on the
        device: itself on the CPU, else a copy there."""
        if self.on_host:
            return tensor
        nbytes = tensor.numel() * tensor.element_size()
        self.count(host=nbytes, device=nbytes)
        return (
            self.backend.to_device(tensor) if self.backend is not None else tensor.to(self.device)
        )

    def receive_buffer(self, dtype: torch.dtype, shape: list[int]) -> Any:
        """Where a tensor broadcast by another rank lands: device memory of its own, or
        on the host memory that goes back to the kernel the moment the tensor dies (the
        allocator's heap would keep it)."""
        import mmap

        import torch

        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if self.backend is not None:
            return self.backend.empty(nbytes).view(dtype).reshape(shape)
        if not self.on_host:
            return torch.empty(shape, dtype=dtype, device=self.device)
        if nbytes == 0:  # reshaped: torch refuses to make some empty shapes directly
            return torch.empty(0, dtype=dtype).reshape(shape)
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).reshape(shape)


def within_device_budget(path: DevicePath, settings: Settings) -> Settings:
    """``settings`` for a load on ``path``: to a device with a backend, bytes in flight
    and the span no larger than the device budget, since every span read is held on the
    device, whole, until its tensors are handed over (a span larger than the budget
    would take it all at once)."""
    if path.backend is None:
        return settings
    limit = device_limit(settings)
    overrides: dict[str, int] = {}
    if settings.bytes_in_flight > limit:
        overrides["bytes_in_flight"] = limit
    if settings.span_bytes is not None and settings.span_bytes > limit:
        # Kept a multiple of the alignment O_DIRECT reads need.
        overrides["span_bytes"] = max(CHUNK_ALIGNMENT, limit // CHUNK_ALIGNMENT * CHUNK_ALIGNMENT)
    return settings.replace(**overrides) if overrides else settings


def device_path_for(device: Any, settings: Settings) -> DevicePath:
    """The :class:`DevicePath` of a load to ``device`` (a name or a ``torch.device``)."""
    name = str(device)
    backend = None if name == "cpu" else Plugins(settings).device_backend(name)
    if backend is None and name != "cpu":
        _check_device(name)
    return DevicePath(name, backend)


def _check_device(name: str) -> None:
    """Fail before any read, with the device's name, where torch cannot use ``name``
    (say "cuda" on a host without a GPU): found out later, on a writer thread, it would
    end the load as a crash."""
    import torch

    try:
        torch.empty(0, device=name)
    except (RuntimeError, AssertionError) as exc:
        raise LoaderplugError(f"cannot load tensors to device {name!r}: {exc}") from exc
