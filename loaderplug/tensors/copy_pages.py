"""A one pass's copy leaves the page cache as the host's ranks are done with it.

Ranks that stream a one pass (:func:`loaderplug.tensors.ranks.shared_tensors`, mode
``stream``) write the local copy through the page cache so that every rank can map
each tensor as it lands. Left there, the copy's pages pile up until the host holds the
whole model in memory, though each tensor is used once and the copy is meant for the
disk: a one pass in one process, and a hydrate, write it with O_DIRECT and hold only
what is in flight. The pages also cost what fresh memory costs: on a virtual machine
that hands freed memory back to its host, 2.4-2.6 s of CPU per GiB against 0.25 s for
memory freed a moment before (docs/benchmarks.md). So the owner of a tensor drops its
pages (``POSIX_FADV_DONTNEED``) once every rank has had it, which the step after it was
offered proves: every rank handed it over before it took part in that step. The
kernel drops only what it may: a page still mapped (a consumer that kept the tensor)
or not yet written back stays, and the pages at a tensor's two ends, which it may share
with a neighbour, are left alone. Dropping is advice: a failure to drop changes
nothing.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from loaderplug.jobs.partial import partial_for
from loaderplug.tensors.header import Header, TensorInfo


class ConsumedPages:
    """The copy's pages of the tensors this rank offered, dropped one step later."""

    def __init__(self, copies: list[Path]) -> None:
        self.copies = copies  # each file's final path in the local copy, by index
        self._fds: dict[int, int] = {}
        self._tensors: dict[int, dict[str, TensorInfo]] = {}  # each file's, by name
        self._offered: list[tuple[int, TensorInfo]] = []  # in the step under way
        self._handed_over: list[tuple[int, TensorInfo]] = []  # in the step before

    def offered(self, file: int, header: Header, name: str) -> None:
        """This rank offers tensor ``name`` of file ``file`` (``header``'s) in the step
        under way."""
        if file not in self._tensors:
            self._tensors[file] = {t.name: t for t in header.tensors}
        self._offered.append((file, self._tensors[file][name]))

    def step_passed(self) -> None:
        """Every rank has entered the step after the one under way's offers were made
        (so every rank handed those of the step before over): drop those."""
        for file, tensor in self._handed_over:
            fd = self._fd(file)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, tensor.begin, tensor.nbytes, os.POSIX_FADV_DONTNEED)
        self._handed_over, self._offered = self._offered, []

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def _fd(self, file: int) -> int | None:
        """The copy of ``file``: the partial one being written or, once published, the
        copy itself (the same pages either way); None if neither is there."""
        if file not in self._fds:
            final = self.copies[file]
            for path in (partial_for(final), final):
                with contextlib.suppress(OSError):
                    self._fds[file] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    break
        return self._fds.get(file)
