r"""The range executor: N readers pull spans from one lazy order; writers land them in sinks.

The engine receives what it uses and nothing more: a source opener, a concurrency limit,
a range size, a retry policy and an observer. It returns the :class:`EngineStats` of its
run. Locking, skipping, reporting and plugins are the runner's business
(:mod:`loaderplug.jobs.runner`). Reading is :mod:`.reading`'s; files are
:class:`~.file_task.FileTask`\ s.

* Memory is bounded by one pool of aligned buffers, ``bytes in flight / chunk`` of them:
  at most ``workers x chunk`` bytes are being read from the volume at once. How many
  readers read at once is a :mod:`loaderplug.engine.concurrency` limit: fixed, or adaptive.
  When the budget holds more buffers than readers (small jobs get smaller ranges), the
  spares let a reader start its next range while its last one is still being written.
* Each span is read with ``pread`` from a source the reader opened itself (once per file
  it reads from), into a buffer of its own, then written to every sink of its file.
* ENOMEM, EIO, EAGAIN and ESTALE are retried per span with exponential backoff and full
  jitter (:mod:`loaderplug.engine.retry`), each retry from a freshly opened source; any other
  error, or exhausted retries, fails that file only.
  Its remaining spans are skipped and its sinks aborted; other files carry on.
* The source's identity, pinned before the copy, is checked after every read step, and
  once more through a fresh open before commit: a file that changes underneath fails
  instead of publishing mixed bytes. Size and mtime always count; the inode only where
  the filesystem keeps inode numbers (not FUSE: :attr:`IOPolicy.stable_inodes`).
* Cancellation (Ctrl-C, :meth:`Engine.cancel`) is seen between reads and during backoff,
  so workers stop within about one span's time; every unfinished sink is aborted before
  :meth:`Engine.run` returns or raises.
"""

from __future__ import annotations

import logging
import queue
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from loaderplug.engine.buffers import BufferPool, Opener, OpenSources
from loaderplug.engine.concurrency import ConcurrencyLimit
from loaderplug.engine.file_task import EngineStats, FileTask, check_identity
from loaderplug.engine.reading import READ_PADDING, Piece, ReadContext, SpanReader, retrying_io
from loaderplug.engine.retry import Cancelled, RetryPolicy
from loaderplug.engine.spans import Order, Span, offset_major
from loaderplug.errors import FileError
from loaderplug.types import FileResult

log = logging.getLogger(__name__)

__all__ = ["Engine", "EngineObserver", "EngineStats", "FileTask", "Opener"]


class EngineObserver(Protocol):
    """Hears of progress, on worker threads; must not raise (the runner's guards)."""

    def range_done(self, rel: str, offset: int, length: int, retries: int) -> None: ...

    def file_done(self, result: FileResult) -> None: ...


class Engine:
    """Runs one job's spans over a pool of reader threads and a pool of writer threads."""

    def __init__(
        self,
        *,
        open_source: Opener,
        limit: ConcurrencyLimit,
        chunk: int,
        split_threshold: int,
        buffers: int,
        retry: RetryPolicy,
        observer: EngineObserver,
        order: Order = offset_major,
        on_bytes: Callable[[int], None] | None = None,
        name: str = "job",
    ) -> None:
        self.open_source = open_source
        self.limit = limit
        self.chunk = chunk
        self.split_threshold = split_threshold
        self.observer = observer
        self.order = order
        self.on_bytes = on_bytes
        self.name = name
        self.retries = 0
        self.bytes_copied = 0
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        # Spans are handed out one reader at a time, in order, memory budgets included.
        self._handout = threading.Lock()
        self._spans: Iterator[Span] = iter(())
        self._tasks: Sequence[FileTask] = ()
        self._pieces: queue.SimpleQueue[Piece | None] = queue.SimpleQueue()
        self._pool = BufferPool(max(buffers, limit.ceiling), chunk + READ_PADDING)
        self._crash: BaseException | None = None
        self._reads = ReadContext(
            chunk=chunk,
            retry=retry,
            cancel=self._cancel,
            take_buffer=self._pool.take,
            give_buffer=self._pool.give,
            hand_on=self._pieces.put,
            count_retry=self._count_retry,
            lock=self._lock,
        )

    def cancel(self) -> None:
        """Stop from another thread: readers stop within about one range's time."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    # -- orchestration ------------------------------------------------------------

    def run(self, tasks: Sequence[FileTask]) -> EngineStats:
        """Copy every file. Re-raises KeyboardInterrupt (and a worker's crash) after
        aborting every unfinished file's sinks."""
        self._plan_spans(tasks)
        count = self.limit.ceiling
        readers = [self._thread(self._reader, f"read-{i}") for i in range(count)]
        writers = [self._thread(self._writer, f"write-{i}") for i in range(count)]
        try:
            for t in readers + writers:
                t.start()
            _join(readers)
            for _ in writers:
                self._pieces.put(None)
            _join(writers)
        except BaseException:
            self._cancel.set()
            for _ in writers:
                self._pieces.put(None)
            _join(readers + writers)
            raise
        finally:
            for task in tasks:
                task.abort_unfinished()
            self._pool.close()
        if self._crash is not None:
            raise self._crash
        return _stats(self, tasks)

    def _plan_spans(self, tasks: Sequence[FileTask]) -> None:
        """Count each file's spans to read (those a killed run landed are skipped) and
        finish at once the files with none left."""
        sizes = [t.size for t in tasks]

        def to_read() -> Iterator[Span]:
            for span in self.order(sizes, self.chunk, self.split_threshold):
                if not tasks[span.file].landed.covers(span.offset, span.length):
                    yield span

        left = [0] * len(tasks)
        for span in to_read():
            left[span.file] += 1
        for task, count in zip(tasks, left, strict=True):
            task.expect_spans(count)
        self._tasks, self._spans = tasks, to_read()
        for task, count in zip(tasks, left, strict=True):
            if count == 0:  # a killed run had landed all of it: only the publish is left
                try:
                    task.begin()
                except Exception as exc:
                    self._fail(task, exc, None)
                else:
                    self._finish(task)

    def _thread(self, target: Callable[[], None], name: str) -> threading.Thread:
        def guarded() -> None:
            try:
                target()
            except BaseException as exc:  # a bug, not an IO error: stop the whole job
                # Drop the frames so no buffer slice stays referenced from the traceback.
                traceback.clear_frames(exc.__traceback__)
                self._crash = exc
                self._cancel.set()

        return threading.Thread(target=guarded, name=f"loaderplug-{self.name}-{name}", daemon=True)

    def _next(self) -> tuple[FileTask, Span] | None:
        with self._handout:
            for span in self._spans:
                task = self._tasks[span.file]
                if task.failed:
                    continue
                # A span a sink holds in a memory budget waits there for room first.
                try:
                    for sink in task.roles.budgeted:
                        sink.admit(span.offset, span.length, self._cancel)
                except Cancelled:
                    if self._cancel.is_set():
                        raise
                    continue  # its file failed meanwhile: the next file's span instead
                return task, span
            return None

    def _fail(self, task: FileTask, exc: BaseException, span: Span | None) -> None:
        if task.fail(exc, span) and task.result is not None:
            self.observer.file_done(task.result)

    def _count_retry(self) -> None:
        with self._lock:
            self.retries += 1

    # -- reading ----------------------------------------------------------------------

    def _reader(self) -> None:
        sources = OpenSources(self.open_source)
        reader = SpanReader(self._reads, sources)
        self.limit.enter()
        try:
            while not self._cancel.is_set():
                slot = self.limit.acquire(self._cancel)
                try:
                    item = self._next()
                    if item is None:
                        return
                    task, span = item
                    try:
                        task.begin()
                        reader.read_span(task, span, slot)
                    except Cancelled:
                        continue
                    except Exception as exc:
                        sources.drop(task)
                        self._fail(task, exc, span)
                finally:
                    self.limit.release(slot)
        except Cancelled:
            return
        finally:
            self.limit.leave()
            sources.close()

    # -- writing ----------------------------------------------------------------------

    def _writer(self) -> None:
        while (piece := self._pieces.get()) is not None:
            try:
                if self._cancel.is_set() or piece.task.failed or not self._write(piece):
                    continue
            finally:
                if piece.buffer is not None:
                    self._pool.give(piece.buffer)
            self._landed(piece)

    def _write(self, piece: Piece) -> bool:
        """Land ``piece`` in every sink of its file; False if the file failed or the job
        was cancelled meanwhile."""
        task, data = piece.task, piece.data
        if data is None:
            return True

        def land() -> None:
            for sink in task.sinks:
                sink.write(data, piece.offset)

        try:
            retries = retrying_io(
                task, piece.offset, piece.length, "writing", land, self._reads, None
            )
        except Cancelled:
            return False
        except FileError as exc:
            self._fail(task, exc, piece.span)
            return False
        with self._lock:
            piece.progress.retries += retries
        return True

    def _landed(self, piece: Piece) -> None:
        with self._lock:
            self.bytes_copied += piece.length
            if self.on_bytes is not None:
                self.on_bytes(piece.length)
            piece.progress.pieces_left -= 1
            span_done, retries = piece.progress.pieces_left == 0, piece.progress.retries
        if not span_done:
            return
        task, span = piece.task, piece.span
        try:
            for journal in task.roles.journals:
                journal.span_landed(span.offset, span.length)
        except OSError as exc:
            self._fail(task, exc, span)
            return
        self.observer.range_done(task.rel, span.offset, span.length, retries)
        if task.span_done():
            self._finish(task)

    def _finish(self, task: FileTask) -> None:
        try:
            # A fresh open: a source replaced on the volume since the copy began shows
            # up here, where the readers' open descriptors still see the old file.
            source = self.open_source(task.src, task.policy)
            try:
                check_identity(task, source.identity())
            finally:
                source.close()
            for sink in task.sinks:
                sink.commit()
        except Exception as exc:
            task.fail(exc, None)
        else:
            task.finished(FileResult(task.rel, task.outcome, task.size))
        if task.result is not None:
            self.observer.file_done(task.result)


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        # A timed join keeps the main thread able to take Ctrl-C.
        while t.is_alive():
            t.join(0.1)


def _stats(engine: Engine, tasks: Sequence[FileTask]) -> EngineStats:
    limit = engine.limit
    return EngineStats(
        results=[t.result for t in tasks if t.result is not None],
        bytes_copied=engine.bytes_copied,
        retries=engine.retries,
        chunk=engine.chunk,
        workers=limit.limit,
        readers_range=(limit.lowest, limit.highest) if limit.adaptive else None,
        cancelled=engine.cancelled,
    )
