"""Which tensors of a file a landed range completes: the count every tensor sink keeps."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator
from typing import Any

from loaderplug.errors import FormatError
from loaderplug.tensors.format.header import Header, TensorInfo

# Hands a finished tensor on: its name and the tensor.
Emit = Callable[[str, Any], None]


class Coverage:
    """Counts the bytes of each non-empty tensor still to land; thread-safe."""

    def __init__(self, header: Header) -> None:
        self.tensors = [t for t in header.tensors if t.nbytes]
        self._starts = [t.begin for t in self.tensors]
        self._left = {t.name: t.nbytes for t in self.tensors}
        self._lock = threading.Lock()
        self.aborted = False

    def pieces(self, offset: int, end: int) -> Iterator[tuple[TensorInfo, int, int]]:
        """``(tensor, begin, end)`` for each tensor overlapping ``[offset, end)``."""
        first = max(0, bisect.bisect_right(self._starts, offset) - 1)
        for t in self.tensors[first:]:
            if t.begin >= end:
                return
            begin, stop = max(offset, t.begin), min(end, t.end)
            if stop > begin:
                yield t, begin, stop

    def landed(self, offset: int, end: int) -> list[TensorInfo]:
        """Record ``[offset, end)`` as landed; returns the tensors it completed (none once
        aborted, so a failed file never hands over a tensor)."""
        done = []
        with self._lock:
            if self.aborted:
                return []
            for t, begin, stop in self.pieces(offset, end):
                self._left[t.name] -= stop - begin
                if self._left[t.name] == 0:
                    done.append(t)
        return done

    def check_complete(self, path: str) -> None:
        with self._lock:
            missing = [name for name, left in self._left.items() if left]
        if missing:
            raise FormatError(f"{path}: tensors never completed: {missing[:5]}")

    def abort(self) -> None:
        with self._lock:
            self.aborted = True
