"""Memory for tensors, bounded by a budget rather than by the model.

A load reads ranges straight into the memory its tensors will live in: host memory (see
:mod:`loaderplug.tensors.delivery.tensor_sinks`), or for a load to a device with a backend, each
tensor's own device memory (see :mod:`loaderplug.tensors.device.sink`), under a budget
of its own (:func:`device_limit`). :class:`MemoryBudget` counts each tensor's bytes, whole,
from the moment its first span is admitted to be read until the tensor is dropped by its
consumer, and admits a span that begins tensors only while they fit. Spans are handed
out in file order, so what is held is a window of the model: the tensors being read and
those the consumer has not taken or dropped yet. The spans that continue a tensor need
no more room; most spans do, and also begin the next tensor: letting them in because
they continue one (as counting the spans read would have to) let a slow consumer's load
run past the budget by tensor after tensor.

What the budget does not hold: the tensor the consumer is using (it owns it once handed
over) and the one just handed over, until the consumer asks for the next; hence "bytes
in flight + 2 x the largest tensor" for a consumer that drops each tensor.

Two exceptions keep a load from waiting on itself. A span is admitted when nothing is
held, so a tensor larger than the budget still loads (the budget stretches to it). A
span that finishes a tensor is admitted when that tensor is all that is held: it can
only be freed once this span lands, whatever else the span begins (the budget stretches
to it and the tensors beginning in that span).
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections.abc import Sequence

from loaderplug.engine.retry import Cancelled
from loaderplug.settings import Settings
from loaderplug.tensors.format.header import TensorInfo

WAIT_S = 0.05  # how often a waiting reader looks at the cancel flag


class MemoryBudget:
    """Bytes held for tensors, and the most that may be held."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.peak = 0
        self._cond = threading.Condition()

    def admit(self, nbytes: int, *, finishing: int, cancel: threading.Event) -> None:
        """Wait until ``nbytes`` more fit, then hold them. ``finishing``: the bytes of
        the tensor (held already) whose last bytes the span reads, if any."""
        with self._cond:
            while nbytes and self.held > finishing and self.held + nbytes > self.limit:
                if cancel.is_set():
                    raise Cancelled
                self._cond.wait(WAIT_S)
            self.held += nbytes
            self.peak = max(self.peak, self.held)

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.held -= nbytes
            self._cond.notify_all()


class FileHold:
    """What one file's sink holds in a :class:`MemoryBudget` (none if ``budget`` is
    None): each of its ``tensors`` (non-empty, in file order) whole, from the admission
    of the first span that begins it until it is handed over (the delivery releases it
    then) or the file closes (what it held for tensors never emitted goes back)."""

    def __init__(self, tensors: Sequence[TensorInfo], budget: MemoryBudget | None) -> None:
        self.budget = budget
        self._tensors = list(tensors)
        self._begins = [t.begin for t in self._tensors]
        # The bytes of the tensors before each one (and of all, last): what spans hold.
        self._bytes_before = [0, *itertools.accumulate(t.nbytes for t in self._tensors)]
        self._lock = threading.Lock()
        self._held = 0
        self._emitted = 0  # bytes of tensors emitted: released when handed over
        self.closed = False

    def admit(self, offset: int, length: int, cancel: threading.Event) -> None:
        """Hold, before ``[offset, offset+length)`` is read, every tensor it begins,
        whole (so the spans continuing them need no room); Cancelled once closed."""
        if self.budget is None:
            return
        with self._lock:
            if self.closed:
                raise Cancelled
        first = bisect.bisect_left(self._begins, offset)
        begun = self._bytes_before[bisect.bisect_left(self._begins, offset + length)]
        nbytes = begun - self._bytes_before[first]
        # The tensor this span continues (begun before it) is held whole already.
        before = self._tensors[first - 1] if first else None
        finishing = before.nbytes if before is not None and before.end > offset else 0
        self.budget.admit(nbytes, finishing=finishing, cancel=cancel)
        with self._lock:
            self._held += nbytes
            closed = self.closed
        if closed:  # closed meanwhile: what it would have held is not coming
            self.budget.release(nbytes)

    def emitting(self, nbytes: int) -> bool:
        """A tensor of ``nbytes`` is about to be handed on: counted as the delivery's to
        release; False if the file closed since it landed (its bytes went back then)."""
        with self._lock:
            if self.closed:
                return False
            self._emitted += nbytes
            return True

    def close(self) -> bool:
        """The file is done: what it held for tensors it will never emit goes back.
        False if it was closed already."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            unclaimed = self._held - self._emitted
        if unclaimed > 0 and self.budget is not None:
            self.budget.release(unclaimed)
        return True


def device_limit(settings: Settings) -> int:
    """The most device memory a load to a device with a backend holds for tensors it
    has not handed over: ``LOADERPLUG_DEVICE_BYTES``, or unset, bytes in flight."""
    if settings.device_bytes is not None:
        return settings.device_bytes
    return settings.bytes_in_flight
