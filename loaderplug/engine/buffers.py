"""What readers read with: page-aligned buffers from one bounded pool, and the sources a
reader keeps open."""

from __future__ import annotations

import collections
import contextlib
import mmap
import threading
from collections.abc import Callable

from loaderplug.engine.file_task import FileTask, check_identity
from loaderplug.engine.retry import Cancelled
from loaderplug.storage.source import aligned_buffer
from loaderplug.types import IOPolicy, Source

# Sources a reader keeps open at once: offset-major order moves a reader from file to
# file, and each comes round again a few spans later.
OPEN_SOURCES_PER_READER = 8

Opener = Callable[[str, IOPolicy], Source]


class BufferPool:
    """Up to ``count`` page-aligned buffers of ``size`` bytes, made on first use."""

    def __init__(self, count: int, size: int) -> None:
        self.count, self.size = count, size
        self._free: list[tuple[mmap.mmap, memoryview]] = []
        self._made: list[tuple[mmap.mmap, memoryview]] = []
        self._cond = threading.Condition()

    def take(self, cancel: threading.Event) -> tuple[mmap.mmap, memoryview]:
        with self._cond:
            while not self._free:
                if cancel.is_set():
                    raise Cancelled
                if len(self._made) < self.count:
                    buffer = aligned_buffer(self.size)
                    self._made.append((buffer, memoryview(buffer)))
                    return self._made[-1]
                self._cond.wait(0.1)
            return self._free.pop()

    def give(self, item: tuple[mmap.mmap, memoryview]) -> None:
        with self._cond:
            self._free.append(item)
            self._cond.notify()

    def close(self) -> None:
        for buffer, view in self._made:
            # A slice still referenced elsewhere (say, by an exception being raised)
            # keeps its buffer alive; it is freed with that reference instead.
            with contextlib.suppress(BufferError):
                view.release()
                buffer.close()
        self._made.clear()
        self._free.clear()


class OpenSources:
    """The sources one reader has open, the least recently used closed past a few."""

    def __init__(self, opener: Opener) -> None:
        self._opener = opener
        self._open: collections.OrderedDict[FileTask, Source] = collections.OrderedDict()

    def get(self, task: FileTask) -> Source:
        source = self._open.get(task)
        if source is not None:
            self._open.move_to_end(task)
            return source
        source = self._opener(task.src, task.policy)
        try:
            check_identity(task, source.identity())
        except BaseException:
            source.close()
            raise
        self._open[task] = source
        if len(self._open) > OPEN_SOURCES_PER_READER:
            _, oldest = self._open.popitem(last=False)
            oldest.close()
        return source

    def drop(self, task: FileTask) -> None:
        """Close ``task``'s source: after an error it may be in a bad state."""
        source = self._open.pop(task, None)
        if source is not None:
            source.close()

    def close(self) -> None:
        while self._open:
            _, source = self._open.popitem()
            source.close()
