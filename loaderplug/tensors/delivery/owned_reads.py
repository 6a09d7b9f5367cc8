"""Files read into memory of the load's own without the engine: by the process's
readers, or by the consumer's own thread.

A file the delivery serves itself (small, or in memory already: the page cache, tmpfs)
and does not map is read here into its tensor sink's arena, each byte once, in steps of
:data:`STEP` bytes. A file of one step is read by the consumer's thread: handing it to
another costs more than the read. A bigger one is read by the process's readers
(:mod:`loaderplug.tensors.delivery.read_threads`), each through a source of its own (its own
descriptor, readahead and identity checks) opened with the ``loaderplug_open_source``
hook.

The consumer takes each tensor as soon as its bytes landed; what is read ahead of the
tensors it took is bounded by the load's bytes in flight (a tensor larger than that
still loads). A reader's failure is the consumer's, once the tensors completed before
it are handed over.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from loaderplug.engine.buffers import Opener
from loaderplug.engine.reading import READ_PADDING
from loaderplug.engine.retry import Cancelled, RetryPolicy, retrying
from loaderplug.errors import FileError, FormatError
from loaderplug.jobs.plan import FileEntry
from loaderplug.tensors.delivery.read_threads import readers
from loaderplug.tensors.delivery.tensor_sinks import TensorSink
from loaderplug.tensors.format.header import Header
from loaderplug.types import IOPolicy, Source
from loaderplug.units import MiB

if TYPE_CHECKING:
    from loaderplug.tensors.device.path import DevicePath

# Bytes a reader takes at a time: a multiple of every O_DIRECT alignment and of a huge
# page, so two readers never fault in one huge page of the arena.
STEP = 8 * MiB
# How often a waiting consumer looks up (so it stays able to take Ctrl-C).
WAIT_S = 0.1


def gives_up(path: str, reading: str) -> Callable[[OSError, int | None], FileError]:
    """The error a read of ``path`` ends with once its retries are spent."""

    def give_up(exc: OSError, attempts: int | None) -> FileError:
        tries = f" after {attempts} attempts" if attempts else ""
        return FileError(
            f"{path}: {reading} failed{tries}: {exc.strerror or exc}", path=path, errno=exc.errno
        )

    return give_up


class FileReads:
    """Reads of one listed file from any thread, each through a source of the thread's
    own, opened at its first read. A read is retried like the engine's and followed by
    a check that the file is still the one listed; :attr:`retries` and
    :attr:`bytes_read` count them all."""

    def __init__(
        self, entry: FileEntry, policy: IOPolicy, open_source: Opener, retry: RetryPolicy
    ) -> None:
        self.path = str(entry.source)
        self._entry, self._policy = entry, policy
        self._open_source, self._retry = open_source, retry
        self._sources: dict[int, Source] = {}  # by reading thread
        self._lock = threading.Lock()
        self.cancel = threading.Event()  # set: a read under way stops at its next retry
        self.retries = 0
        self.bytes_read = 0

    def read(self, view: memoryview, offset: int) -> int:
        """Fill ``view`` from ``offset``: the bytes read (fewer only at the file's end)."""
        path = self.path

        def attempt() -> int:
            source = self._source()
            try:
                got = source.pread_into(view, offset)
                now = source.identity()
            except OSError:
                self._drop_source()  # the next attempt opens it again
                raise
            if not now.matches(self._entry.identity, inode=self._policy.stable_inodes):
                raise FileError(
                    f"{path}: changed while it was read (now {now.describe()})", path=path
                )
            return got

        give_up = gives_up(path, "reading it")
        got, retries = retrying(attempt, self._retry, give_up, cancel=self.cancel)
        with self._lock:
            self.retries += retries
            self.bytes_read += min(got, len(view))
        return got

    def _source(self) -> Source:
        thread = threading.get_ident()
        with self._lock:
            source = self._sources.get(thread)
        if source is None:
            source = self._open_source(self.path, self._policy)
            with self._lock:
                self._sources[thread] = source
        return source

    def _drop_source(self) -> None:
        with self._lock:
            source = self._sources.pop(threading.get_ident(), None)
        if source is not None:
            source.close()

    def close(self) -> None:
        """Close every thread's source (once no read is under way)."""
        with self._lock:
            sources, self._sources = list(self._sources.values()), {}
        for source in sources:
            source.close()


class ReadTensors(Iterator[tuple[str, Any]]):
    """Every tensor of a file, read by :func:`readers` (or, for a file of one step, by
    the consumer's thread) into memory of the load's own (a :class:`TensorSink`'s), as
    each completes. At most ``ahead`` bytes are read ahead of the tensors taken.

    An iterator object: nothing of it refers to a tensor it handed over, and no tensor
    depends on the file once it is read."""

    def __init__(
        self,
        header: Header,
        path: DevicePath,
        reads: FileReads,
        *,
        ahead: int,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self.header = header
        self._reads, self._ahead = reads, ahead
        self._on_close = on_close  # once the file is read, or left
        self._nbytes = {t.name: t.nbytes for t in header.tensors}
        self._cond = threading.Condition()
        self._ready: collections.deque[tuple[str, Any]] = collections.deque()
        self._steps = collections.deque(
            (offset, min(STEP, header.size - offset)) for offset in range(0, header.size, STEP)
        )
        self._unread = len(self._steps)  # steps not landed yet
        self._running = 0  # steps given to the readers and not finished
        self._futures: list[Future[None]] = []
        self._held = 0  # bytes read or being read, less those of the tensors taken
        self._error: BaseException | None = None
        self._sink: TensorSink | None = TensorSink(header, path, self._landed)
        self._sink.prepare()  # its empty tensors are ready at once

    def __iter__(self) -> ReadTensors:
        return self

    def __next__(self) -> tuple[str, Any]:
        while True:
            with self._cond:
                if self._ready:
                    name, tensor = self._ready.popleft()
                    self._held -= self._nbytes[name]
                    return name, tensor
                error, done = self._error, self._sink is None or not self._unread
            if error is not None:
                self.close()
                raise error
            if done:
                self._finish()
                raise StopIteration
            self._read_more()

    def _landed(self, name: str, tensor: Any) -> None:
        with self._cond:
            self._ready.append((name, tensor))
            self._cond.notify_all()

    def _read_more(self) -> None:
        """Read the next steps that fit ahead of the consumer: the only one of a file
        of one step here, others by the readers; then wait for a tensor or an error."""
        if len(self._steps) == self._unread == 1:
            with self._cond:
                self._running += 1
            self._read_step(*self._steps.popleft())
            return
        with self._cond:
            while self._steps and (self._held < self._ahead or not self._running):
                offset, length = self._steps.popleft()
                self._held += length
                self._running += 1
                self._futures.append(readers().submit(self._read_step, offset, length))
            if not self._ready and self._error is None and self._unread:
                self._cond.wait(WAIT_S)

    def _read_step(self, offset: int, length: int) -> None:
        """Read ``[offset, offset+length)`` into the sink, which emits the tensors it
        completes (in a reader, or the consumer's thread)."""
        error: BaseException | None = None
        try:
            sink = self._sink
            if sink is not None:
                # Padded for O_DIRECT: the sink has room past the file's end for it.
                padded = -(-length // READ_PADDING) * READ_PADDING
                view = sink.place(offset, padded, self._reads.cancel)
                got = self._reads.read(view, offset)
                if got < length:
                    raise FormatError(
                        f"{self.header.path}: ended at {offset + got} bytes, inside its "
                        f"tensors (the header says {self.header.size})"
                    )
                sink.write(view[:length], offset)
        except Cancelled:
            pass  # closed: nobody waits for it
        except BaseException as exc:
            error = exc
        with self._cond:
            self._running -= 1
            if error is None:
                self._unread -= 1
            elif self._error is None:
                self._error = error
            self._cond.notify_all()

    def _finish(self) -> None:
        sink, self._sink = self._sink, None
        if sink is not None:
            self._closed()
            sink.commit()

    def close(self) -> None:
        """Stop early: reading stops, and the file's memory not held by a tensor handed
        over goes back."""
        self._reads.cancel.set()
        futures, self._futures = self._futures, []
        cancelled = sum(future.cancel() for future in futures)
        with self._cond:
            self._running -= cancelled
            while self._running > 0:  # a read under way lands in memory still the file's
                self._cond.wait(WAIT_S)
            self._ready.clear()
        sink, self._sink = self._sink, None
        if sink is not None:
            self._closed()
            sink.abort()

    def _closed(self) -> None:
        self._reads.close()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()
