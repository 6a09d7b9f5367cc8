"""Host memory for tensors, bounded by a budget rather than by the model.

A load reads ranges straight into the memory its tensors will live in (see
:mod:`loaderplug.tensors.sinks`). :class:`MemoryBudget` counts each tensor's bytes, whole,
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

import threading

from loaderplug.engine.retry import Cancelled

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
