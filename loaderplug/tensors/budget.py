"""Host memory for tensors, bounded by a budget rather than by the model.

A load reads ranges straight into the memory its tensors will live in (see
:mod:`loaderplug.tensors.sinks`). :class:`MemoryBudget` counts those bytes from the moment
a reader is admitted to read them until the tensor they belong to is dropped by its
consumer (a file's other bytes, its header, until the file is done), and admits a new
span only while the count stays within the budget. Spans are handed out in file order,
so what is held is a window of the model: the spans in flight, the tensors they are
completing and the tensors the consumer has not taken or dropped yet.

What the budget does not hold: the tensor the consumer is using (it owns it once handed
over) and the one just handed over, until the consumer asks for the next; hence "bytes
in flight + 2 x the largest tensor" for a consumer that drops each tensor.

Two exceptions keep a load from waiting on itself. A span that continues a tensor begun
in an earlier span is always admitted: that tensor can only complete, and be freed,
once this span lands. A span is also admitted when nothing is held, so a tensor larger
than the budget still loads (the budget stretches to it).
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

    def admit(self, nbytes: int, *, continuation: bool, cancel: threading.Event) -> None:
        """Wait until ``nbytes`` more fit (or the span must go ahead), then hold them."""
        with self._cond:
            while not continuation and self.held and self.held + nbytes > self.limit:
                if cancel.is_set():
                    raise Cancelled
                self._cond.wait(WAIT_S)
            self.held += nbytes
            self.peak = max(self.peak, self.held)

    def release(self, nbytes: int) -> None:
        with self._cond:
            self.held -= nbytes
            self._cond.notify_all()
