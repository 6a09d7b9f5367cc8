"""A one pass's copy leaves the page cache as the host's ranks are done with it.

Ranks that stream a one pass (:func:`loaderplug.tensors.ranks.shared.shared_tensors`, mode
``stream``) write the local copy through the page cache so that every rank can map each
tensor as it lands. Left there, the copy's pages pile up until the host holds the whole
model in memory, though each tensor is used once and the copy is meant for the disk: a
one pass in one process, and a hydrate, hold only what is in flight (and write the copy
with O_DIRECT where its filesystem takes it). The pages also cost what fresh memory
costs: on a virtual machine that hands freed memory back to its host, 2.4-2.6 s of CPU
per GiB against 0.25 s for memory freed a moment before (docs/benchmarks.md). So the
owner of a tensor drops its pages (``POSIX_FADV_DONTNEED``) once every rank is done with
it, which the second step that hands tensors over after the one it was offered in
proves: every rank handed it over before the next step, and its consumer took a tensor
of the next step that hands any before the one after, so a consumer that drops each
tensor as it takes the next (``for name, tensor in load``) holds it no more. The kernel
drops only what it may: a page still mapped (a consumer that kept the tensor) or not yet
written back stays, and the pages at a tensor's two ends, which it may share with a
neighbour, are left alone; so a copy written without ``LOADERPLUG_FSYNC``, whose pages
stay dirty for the kernel to write back when it likes, mostly stays. Dropping is advice:
a failure to drop changes nothing.
"""

from __future__ import annotations

import collections
import contextlib
import os
from pathlib import Path

from loaderplug.engine.spans import Landed
from loaderplug.jobs.partial import open_copy
from loaderplug.tensors.format.header import Header, TensorInfo

# How many steps after its offer a tensor's pages go (see the module's docstring).
STEPS_LATER = 2


class ConsumedPages:
    """The copy's pages of the tensors this rank offered, dropped two steps later."""

    def __init__(self, copies: list[Path]) -> None:
        self.copies = copies  # each file's final path in the local copy, by index
        self._fds: dict[int, int] = {}
        self._tensors: dict[int, dict[str, TensorInfo]] = {}  # each file's, by name
        # The tensors offered in the step under way (first) and in the steps before.
        self._steps: collections.deque[list[tuple[int, TensorInfo]]] = collections.deque(
            [[] for _ in range(STEPS_LATER + 1)]
        )

    def offered(self, file: int, header: Header, name: str) -> None:
        """This rank offers tensor ``name`` of file ``file`` (``header``'s) in the step
        under way."""
        if file not in self._tensors:
            self._tensors[file] = {t.name: t for t in header.tensors}
        self._steps[0].append((file, self._tensors[file][name]))

    def step_entered(self, *, handed: bool) -> None:
        """Every rank has entered the step under way, which ``handed`` a tensor to every
        rank (or none: a step of ranks waiting for theirs, which proves nothing): the
        tensors offered two such steps before are every consumer's no more; drop them."""
        if not handed:
            return
        for file, begin, end in _runs(self._steps.pop()):
            self._drop(file, begin, end - begin)
        self._steps.appendleft([])

    def close(self) -> None:
        """The load is over: drop what is left of the copies this rank wrote (the last
        steps' tensors, those still being written back when their turn came, the pages
        two tensors share), as a one pass in one process leaves none of its copy
        behind; but a page a consumer still maps."""
        for file in self._tensors:  # every file this rank offered a tensor of
            self._drop(file, 0, 0)  # 0 bytes: to the end of the file
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

    def _drop(self, file: int, offset: int, length: int) -> None:
        fd = self._fd(file)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)

    def _fd(self, file: int) -> int | None:
        """The copy of ``file``: the partial one being written or, once published, the
        copy itself (the same pages either way); None if neither is there."""
        if file not in self._fds:
            with contextlib.suppress(OSError):
                self._fds[file] = open_copy(
                    self.copies[file], lambda path: os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                )
        return self._fds.get(file)


def _runs(tensors: list[tuple[int, TensorInfo]]) -> list[tuple[int, int, int]]:
    """``(file, begin, end)`` of each run of adjacent tensors: one call to the kernel per
    run, not per tensor (a batch of a file's small tensors is one range). An empty
    tensor has no run: a length of 0 would tell the kernel "to the end of the file"."""
    by_file: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    for file, t in tensors:
        by_file[file].append((t.begin, t.end))
    return [
        (file, begin, end)
        for file in sorted(by_file)
        for begin, end in Landed.of(by_file[file]).ranges
    ]
