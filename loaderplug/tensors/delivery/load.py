"""A load under way: what :func:`loaderplug.iter_tensors` returns.

A :class:`Load` is an iterator of ``(name, tensor)`` pairs, each handed over as it
completes, and, once exhausted, the record of what the load did: its report, the time
to the first tensor, how each file was read (and, for ranks sharing it, how the ranks
shared it). Like the rest of the hand-over it is an object, not a generator: nothing of
it refers to a tensor it handed over.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from loaderplug.errors import TransferFailed
from loaderplug.jobs.runner import Runner
from loaderplug.report import TransferReport
from loaderplug.tensors.delivery.choice import TensorDelivery
from loaderplug.tensors.delivery.hand_over import TensorReady
from loaderplug.tensors.device.path import DevicePath

if TYPE_CHECKING:
    import torch

Pairs = Iterator[tuple[str, Any]]


class HostsSaid(Protocol):
    """What a load across hosts did (:class:`loaderplug.tensors.hosts.split.HostsChoice`,
    made a layer above): the hosts, whether they split the reads, why, and what this
    host read and received."""

    @property
    def hosts(self) -> int: ...
    @property
    def split(self) -> bool: ...
    @property
    def why(self) -> str: ...
    @property
    def exchanged(self) -> Any: ...
    def describe(self) -> str: ...


class Load(Iterator[tuple[str, "torch.Tensor"]]):
    """Iterate for ``(name, tensor)``; afterwards read :attr:`report` and the figures.

    A file that fails raises :class:`~loaderplug.errors.TransferFailed` naming it (ranks
    sharing the load raise :class:`~loaderplug.errors.DistributedError`) once every
    other tensor was handed over; a tensor is only ever handed over whole.
    """

    def __init__(self, start: Callable[[Load], Pairs], stats: dict[str, Any] | None = None) -> None:
        self._start: Callable[[Load], Pairs] | None = start
        self._stats = stats  # the deprecated way to get the figures: filled at the end
        self._pairs: Pairs | None = None
        self._at_end: list[Callable[[], None]] = []
        self.report: TransferReport | None = None
        # Seconds from the start of the job (its files listed) to the first tensor.
        self.first_tensor_s: float | None = None
        # How each file was read: direct, buffered or mapped, and why.
        self.io_modes: dict[str, str] = {}
        # For ranks sharing the load: pagecache, stream or broadcast, and each file's reader.
        self.sharing: str | None = None
        self.owners: dict[str, int] = {}
        # For ranks on several hosts: whether the hosts split the reads, and why.
        self.hosts: HostsSaid | None = None
        # The memory budget this process loaded within: LOADERPLUG_BYTES_IN_FLIGHT (for
        # a load to a device, no more than LOADERPLUG_DEVICE_BYTES), or its part of it
        # when ranks on the host share the load.
        self.bytes_in_flight: int | None = None
        # On the way to a device (see loaderplug.tensors.device.path): tensor bytes
        # copied host to host (none where reads land in pinned memory), bytes copied to
        # the device, and the most pinned memory the process held.
        self.host_copied_bytes = 0
        self.device_copied_bytes = 0
        self.pinned_peak_bytes = 0

    def record_device(self, path: DevicePath) -> None:
        """Take the figures of the way to the device from the load's ``path``."""
        self.host_copied_bytes = path.host_copied_bytes
        self.device_copied_bytes = path.device_copied_bytes
        self.pinned_peak_bytes = path.pinned_peak_bytes

    def at_end(self, action: Callable[[], None]) -> None:
        """Run ``action`` once the load is over: exhausted, failed or closed. What it
        lets go of is freed then, not whenever the load's objects, which refer to each
        other, are collected."""
        self._at_end.append(action)

    def _over(self) -> None:
        while self._at_end:
            self._at_end.pop()()

    def __iter__(self) -> Load:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        if self._pairs is None:
            if self._start is None:
                raise StopIteration
            self._pairs, self._start = self._start(self), None
        try:
            return next(self._pairs)
        except StopIteration:
            self._over()
            if self._stats is not None:
                self._stats.update(
                    report=self.report, first_tensor_s=self.first_tensor_s, io=self.io_modes
                )
                if self.sharing is not None:
                    self._stats.update(sharing=self.sharing, owners=self.owners)
                if self.hosts is not None:
                    self._stats.update(hosts=self.hosts)
            raise
        except BaseException:
            self._over()
            raise

    def close(self) -> None:
        """Stop early: the reading stops and every unfinished file is cleaned up."""
        self._start = None
        close = getattr(self._pairs, "close", None)
        if close is not None:
            close()
        self._over()

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> Load:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RunnerPairs(Iterator[tuple[str, Any]]):
    """A load run by the runner in this process: its tensors, in the order they complete;
    at the end the load's record is filled in (and a failed file raised)."""

    def __init__(self, runner: Runner, load: Load) -> None:
        self.runner = runner
        self.load = load
        self._events = runner.run()

    def __next__(self) -> tuple[str, Any]:
        while True:
            try:
                event = next(self._events)
            except StopIteration:
                self._conclude()
                raise
            if isinstance(event, TensorReady):
                return event.name, event.tensor

    def close(self) -> None:
        self._events.close()

    def _conclude(self) -> None:
        report, load = self.runner.report, self.load
        assert report is not None
        load.report, load.io_modes = report, self.runner.io_modes
        load.bytes_in_flight = self.runner.settings.bytes_in_flight
        delivery = self.runner.plan.delivery
        if isinstance(delivery, TensorDelivery):
            load.first_tensor_s = delivery.first_tensor_s
            load.record_device(delivery.device)
        if not report.ok:
            raise TransferFailed(report)
