"""The range executor: N readers pull spans from one lazy order; writers land them in sinks.

The engine receives what it uses and nothing more: a source opener, a concurrency limit,
a range size, a retry policy and an observer. It returns the :class:`EngineStats` of its
run. Locking, skipping, reporting and plugins are the runner's business
(:mod:`loaderplug.jobs.runner`).

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

import collections
import contextlib
import functools
import logging
import mmap
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from loaderplug.engine.concurrency import ConcurrencyLimit, Slot
from loaderplug.engine.retry import LOAD_ERRNOS, Cancelled, RetryPolicy, retrying
from loaderplug.engine.sinks import JournalingSink, PlacingSink, Sink
from loaderplug.engine.spans import Landed, Order, Span, offset_major
from loaderplug.errors import HydrateError
from loaderplug.storage.source import aligned_buffer
from loaderplug.types import FileResult, Identity, IOPolicy, Source, Status
from loaderplug.units import KiB, MiB

# Ranges are read in steps of this size (a multiple of every O_DIRECT alignment): reads
# straight into a sink's memory hand each step on, so tensors complete as their own bytes
# land, mid-range, and the adaptive limit sees throughput and latency step by step.
READ_STEP = 4 * MiB
# Buffers have this much room past a chunk, so a read padded up to the O_DIRECT alignment
# (at most 64 KiB, see fs.direct_io_alignment) still fits.
READ_PADDING = 64 * KiB
# Sources a reader keeps open at once: offset-major order moves a reader from file to
# file, and each comes round again a few spans later.
OPEN_SOURCES_PER_READER = 8
log = logging.getLogger(__name__)

Opener = Callable[[str, IOPolicy], Source]
# Called as each span is handed out, in order, before it is read; may wait (a memory
# budget), and raises Cancelled if the job is cancelled while it does.
Gate = Callable[["FileTask", Span, threading.Event], None]


class EngineObserver(Protocol):
    """Hears of progress, on worker threads; must not raise (the runner's guards)."""

    def range_done(self, rel: str, offset: int, length: int, retries: int) -> None: ...

    def file_done(self, result: FileResult) -> None: ...


@dataclass(frozen=True)
class EngineStats:
    """What one run did: a result per finished file, bytes landed, retries, and the
    concurrency it ended at (with an adaptive limit, the range it moved in)."""

    results: list[FileResult]
    bytes_copied: int
    retries: int
    chunk: int
    workers: int
    workers_range: tuple[int, int] | None
    cancelled: bool


@dataclass(eq=False)
class FileTask:
    """One file of a job: where it comes from, what it must look like, where it goes."""

    rel: str
    src: str
    identity: Identity
    sinks: list[Sink]
    policy: IOPolicy
    # What the file's result says once every sink committed: restored when one of them
    # published a copy, loaded when they only took its bytes (tensors).
    outcome: Status = "restored"
    # Ranges a killed run left durable in the partial copy: not read again.
    landed: Landed = field(default_factory=Landed)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _begun: bool = False
    _remaining: int = 0
    _done: bool = False
    result: FileResult | None = None

    @property
    def size(self) -> int:
        return self.identity.size

    @property
    def failed(self) -> bool:
        return self.result is not None and self.result.status == "failed"

    def begin(self) -> None:
        """Prepare every sink exactly once, before the first write from any worker."""
        with self._lock:
            if self.failed or self._done:
                raise Cancelled
            if self._begun:
                return
            for sink in self.sinks:
                sink.prepare()
            self._begun = True

    def expect_spans(self, count: int) -> None:
        self._remaining = count

    def span_done(self) -> bool:
        """Count a landed span; True for the one caller that must finish the file."""
        with self._lock:
            if self.failed:
                return False
            self._remaining -= 1
            return self._remaining == 0

    def fail(self, exc: BaseException, span: Span | None) -> bool:
        """Mark the file failed and abort its sinks; False if it had already ended."""
        with self._lock:
            if self.result is not None:
                return False
            err = exc if isinstance(exc, HydrateError) else None
            os_errno = err.errno if err else getattr(exc, "errno", None)
            rng = err.range if err else ((span.offset, span.length) if span else None)
            self.result = FileResult(
                self.rel, "failed", self.size, str(exc), errno=os_errno, range=rng
            )
            self._done = True
        for sink in self.sinks:
            sink.abort()
        return True

    def finished(self, result: FileResult) -> None:
        with self._lock:
            self.result = result
            self._done = True

    def abort_unfinished(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        for sink in self.sinks:
            sink.abort()


def check_identity(task: FileTask, now: Identity) -> None:
    if not now.matches(task.identity, inode=task.policy.stable_inodes):
        raise HydrateError(
            f"source changed while being copied (was {task.identity.describe()}, "
            f"now {now.describe()}); run again once the mirror holds still",
            path=task.src,
        )


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


@dataclass(eq=False)
class _Write:
    """One read piece waiting for the writers; ``span_left`` is shared by its span."""

    task: FileTask
    span: Span
    offset: int
    length: int
    buffer: tuple[mmap.mmap, memoryview] | None  # a pool buffer to give back, if any
    span_left: list[int]  # [pieces not yet written, retries so far], under Engine._lock
    placed: memoryview | None = None  # bytes read straight into a sink's own memory


class _OpenSources:
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
        gate: Gate | None = None,
        on_bytes: Callable[[int], None] | None = None,
        name: str = "job",
    ) -> None:
        self.open_source = open_source
        self.limit = limit
        self.chunk = chunk
        self.split_threshold = split_threshold
        self.retry = retry
        self.observer = observer
        self.order = order
        self.gate = gate
        self.on_bytes = on_bytes
        self.name = name
        self._retries = 0
        self._bytes_copied = 0
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        # Spans are handed out one reader at a time, in order, gate included.
        self._handout = threading.Lock()
        self._spans: Iterator[Span] = iter(())
        self._tasks: Sequence[FileTask] = ()
        self._writes: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self._pool = BufferPool(max(buffers, limit.ceiling), chunk + READ_PADDING)
        self._crash: BaseException | None = None

    def cancel(self) -> None:
        """Stop from another thread: readers stop within about one range's time."""
        self._cancel.set()

    # -- orchestration ------------------------------------------------------------

    def run(self, tasks: Sequence[FileTask]) -> EngineStats:
        """Copy every file. Re-raises KeyboardInterrupt (and a worker's crash) after
        aborting every unfinished file's sinks."""
        sizes = [t.size for t in tasks]
        left = [0] * len(tasks)
        for span in self.order(sizes, self.chunk, self.split_threshold):
            left[span.file] += not tasks[span.file].landed.covers(span.offset, span.length)
        for task, count in zip(tasks, left, strict=True):
            task.expect_spans(count)
        self._tasks = tasks
        self._spans = (
            span
            for span in self.order(sizes, self.chunk, self.split_threshold)
            if not tasks[span.file].landed.covers(span.offset, span.length)
        )
        for task, count in zip(tasks, left, strict=True):
            if count == 0:  # a killed run had landed all of it: only the publish is left
                try:
                    task.begin()
                except Exception as exc:
                    self._fail(task, exc, None)
                else:
                    self._finish(task)
        count = self.limit.ceiling
        readers = [self._thread(self._reader, f"read-{i}") for i in range(count)]
        writers = [self._thread(self._writer, f"write-{i}") for i in range(count)]
        try:
            for t in readers + writers:
                t.start()
            self._join(readers)
            for _ in writers:
                self._writes.put(None)
            self._join(writers)
        except BaseException:
            self._cancel.set()
            for _ in writers:
                self._writes.put(None)
            self._join(readers + writers)
            raise
        finally:
            for task in tasks:
                task.abort_unfinished()
            self._pool.close()
        if self._crash is not None:
            raise self._crash
        return self._stats(tasks)

    def _stats(self, tasks: Sequence[FileTask]) -> EngineStats:
        limit = self.limit
        return EngineStats(
            results=[t.result for t in tasks if t.result is not None],
            bytes_copied=self._bytes_copied,
            retries=self._retries,
            chunk=self.chunk,
            workers=limit.limit,
            workers_range=(limit.lowest, limit.highest) if limit.adaptive else None,
            cancelled=self._cancel.is_set(),
        )

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

    @staticmethod
    def _join(threads: list[threading.Thread]) -> None:
        for t in threads:
            # A timed join keeps the main thread able to take Ctrl-C.
            while t.is_alive():
                t.join(0.1)

    def _next(self) -> tuple[FileTask, Span] | None:
        with self._handout:
            for span in self._spans:
                task = self._tasks[span.file]
                if task.failed:
                    continue
                if self.gate is not None:
                    self.gate(task, span, self._cancel)
                return task, span
            return None

    def _fail(self, task: FileTask, exc: BaseException, span: Span | None) -> None:
        if task.fail(exc, span) and task.result is not None:
            self.observer.file_done(task.result)

    def _count_retries(self, retries: int, span_left: list[int] | None = None) -> None:
        with self._lock:
            self._retries += retries
            if span_left is not None:
                span_left[1] += retries

    # -- reading ----------------------------------------------------------------------

    def _reader(self) -> None:
        sources = _OpenSources(self.open_source)
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
                        self._read_span(task, span, slot, sources)
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

    def _read_span(self, task: FileTask, span: Span, slot: Slot, sources: _OpenSources) -> None:
        end = span.offset + span.length
        # A whole-file span of a small file is read in chunk-sized pieces.
        offsets = range(span.offset, end, self.chunk)
        span_left = [max(1, len(offsets)), 0]
        if not offsets:  # an empty file: nothing to read, one empty write completes it
            self._writes.put(_Write(task, span, 0, 0, None, span_left))
            return
        placer = next((s for s in task.sinks if isinstance(s, PlacingSink)), None)
        if placer is not None:
            span_left[0] = sum(-(-min(self.chunk, end - o) // READ_STEP) for o in offsets)
        for offset in offsets:
            length = min(self.chunk, end - offset)
            if placer is not None:
                self._read_placed(task, span, offset, length, placer, span_left, slot, sources)
                continue
            buffer = self._pool.take(self._cancel)
            try:
                read = functools.partial(
                    self._read_piece, task, offset, length, buffer[1], slot, sources
                )
                self._retrying(task, offset, length, "reading", read, slot, span_left)
            except BaseException:
                self._pool.give(buffer)
                raise
            self._writes.put(_Write(task, span, offset, length, buffer, span_left))

    def _retrying(
        self,
        task: FileTask,
        offset: int,
        length: int,
        action: str,
        op: Callable[[], None],
        slot: Slot | None,
        span_left: list[int],
    ) -> None:
        """Run ``op`` until it succeeds, retrying transient errnos; counts the retries.

        Reads and writes are both retried: ``pread`` and ``pwrite`` at a fixed offset
        can be repeated, and a sync's destination is as flaky as a hydrate's source.
        A read's ``slot`` hears of every transient error (the storage may be overloaded)
        and, before the retry, waits if the limit has dropped since.
        """

        def attempt() -> None:
            if task.failed:  # another worker failed the file: stop reading it
                raise Cancelled
            op()

        def give_up(exc: OSError, attempts: int | None) -> HydrateError:
            tries = f" after {attempts} attempts" if attempts else ""
            return HydrateError(
                f"{action} bytes {offset}-{offset + length} failed{tries}: {exc.strerror or exc}",
                path=task.src,
                range=(offset, length),
                errno=exc.errno,
            )

        def transient(exc: OSError) -> None:
            self._count_retries(1)
            if slot is not None and exc.errno in LOAD_ERRNOS:
                slot.transient_error()

        renew = (lambda: slot.renew(self._cancel)) if slot is not None else None
        _, retries = retrying(
            attempt,
            self.retry,
            give_up,
            cancel=self._cancel,
            on_transient=transient,
            before_retry=renew,
        )
        with self._lock:
            span_left[1] += retries

    def _read_placed(
        self,
        task: FileTask,
        span: Span,
        offset: int,
        length: int,
        placer: PlacingSink,
        span_left: list[int],
        slot: Slot,
        sources: _OpenSources,
    ) -> None:
        """Read straight into the sink's memory (no staging buffer, no copy), handing each
        step to the writers as soon as it is read, so a tensor is complete as soon as its
        own bytes are, not when the whole range is. A retry resumes at the failed step."""
        size = _padded(task, length) if offset + length >= task.size else length
        target = placer.place(offset, size)
        done = 0

        def step_read(n: int) -> None:
            nonlocal done
            self._writes.put(
                _Write(task, span, offset + done, n, None, span_left, target[done : done + n])
            )
            done += n

        def read_rest() -> None:
            self._read_piece(
                task, offset + done, length - done, target[done:], slot, sources, step_read
            )

        self._retrying(task, offset, length, "reading", read_rest, slot, span_left)

    def _read_piece(
        self,
        task: FileTask,
        offset: int,
        length: int,
        view: memoryview,
        slot: Slot,
        sources: _OpenSources,
        step_read: Callable[[int], None] | None = None,
    ) -> None:
        """Read ``length`` bytes at ``offset`` into ``view`` in steps of ``READ_STEP``,
        checking the source's identity after each; ``slot`` hears how long each step
        took, and ``step_read(n)`` of each step read."""
        try:
            source = sources.get(task)
            pos = 0
            while pos < length:
                n = min(READ_STEP, length - pos)
                last = pos + n >= length
                want = view[pos : pos + (_padded(task, n) if last else n)]
                started = time.perf_counter()
                got = source.pread_into(want, offset + pos)
                slot.read_done(got, time.perf_counter() - started)
                if got < n:
                    raise HydrateError(
                        f"source is shorter than expected: read ended at byte "
                        f"{offset + pos + got} of {task.size}; the mirror file is truncated "
                        f"or still being written",
                        path=task.src,
                        range=(offset, length),
                    )
                check_identity(task, source.identity())
                pos += n
                if step_read is not None:
                    step_read(n)
        except OSError:
            sources.drop(task)  # a retry starts from a fresh descriptor
            raise

    # -- writing ----------------------------------------------------------------------

    def _writer(self) -> None:
        while True:
            write = self._writes.get()
            if write is None:
                return
            task = write.task
            try:
                if self._cancel.is_set() or task.failed:
                    continue
                data = write.placed
                if data is None and write.buffer is not None:
                    data = write.buffer[1][: write.length]
                if data is not None:
                    land = functools.partial(_write_all, task.sinks, data, write.offset)
                    try:
                        self._retrying(
                            task, write.offset, write.length, "writing", land, None, write.span_left
                        )
                    except Cancelled:
                        continue
                    except HydrateError as exc:
                        self._fail(task, exc, write.span)
                        continue
            finally:
                if write.buffer is not None:
                    self._pool.give(write.buffer)
            self._landed(write)

    def _landed(self, write: _Write) -> None:
        with self._lock:
            self._bytes_copied += write.length
            if self.on_bytes is not None:
                self.on_bytes(write.length)
            write.span_left[0] -= 1
            span_done, retries = write.span_left[0] == 0, write.span_left[1]
        if not span_done:
            return
        span = write.span
        try:
            for sink in write.task.sinks:
                if isinstance(sink, JournalingSink):
                    sink.span_landed(span.offset, span.length)
        except OSError as exc:
            self._fail(write.task, exc, span)
            return
        self.observer.range_done(write.task.rel, span.offset, span.length, retries)
        if write.task.span_done():
            self._finish(write.task)

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


def _padded(task: FileTask, length: int) -> int:
    """``length`` rounded up to the O_DIRECT alignment of the task's source."""
    align = max(4096, task.policy.alignment)
    return -(-length // align) * align


def _write_all(sinks: Sequence[Sink], data: memoryview, offset: int) -> None:
    for sink in sinks:
        sink.write(data, offset)
