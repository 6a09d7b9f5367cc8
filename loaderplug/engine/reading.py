"""Reading spans: one :class:`SpanReader` per reader thread.

Each span is read with ``pread`` from a source the reader opened itself (once per file
it reads from), in steps of :data:`READ_STEP`, into a pool buffer, or straight into the
memory of a sink that has its own (a tensor sink); each piece read is handed to the
writers. The source's identity is checked after every step. Transient errors are retried
per piece (:func:`retrying_io`), from a freshly opened source.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from loaderplug.engine.buffers import OpenSources
from loaderplug.engine.concurrency import Slot
from loaderplug.engine.file_task import FileTask, SpanProgress, check_identity
from loaderplug.engine.retry import LOAD_ERRNOS, Cancelled, RetryPolicy, retrying
from loaderplug.engine.sinks import PlacingSink
from loaderplug.engine.spans import Span
from loaderplug.errors import FileError
from loaderplug.units import KiB, MiB

if TYPE_CHECKING:
    import mmap

# Ranges are read in steps of this size (a multiple of every O_DIRECT alignment): reads
# straight into a sink's memory hand each step on, so tensors complete as their own bytes
# land, mid-range, and the adaptive limit sees throughput and latency step by step.
READ_STEP = 4 * MiB
# Buffers have this much room past a chunk, so a read padded up to the O_DIRECT alignment
# (at most 64 KiB, see storage.io_policy.direct_io_alignment) still fits.
READ_PADDING = 64 * KiB


@dataclass(eq=False)
class Piece:
    """Bytes read for the writers: ``length`` bytes of ``span`` at ``offset``, in a pool
    ``buffer`` (given back once written) or ``placed`` in a sink's own memory."""

    task: FileTask
    span: Span
    offset: int
    length: int
    buffer: tuple[mmap.mmap, memoryview] | None
    progress: SpanProgress
    placed: memoryview | None = None

    @property
    def data(self) -> memoryview | None:
        if self.placed is not None:
            return self.placed
        return self.buffer[1][: self.length] if self.buffer is not None else None


class ReadContext:
    """What every reader of one engine run shares."""

    def __init__(
        self,
        *,
        chunk: int,
        retry: RetryPolicy,
        cancel: threading.Event,
        take_buffer: Callable[[threading.Event], tuple[mmap.mmap, memoryview]],
        give_buffer: Callable[[tuple[mmap.mmap, memoryview]], None],
        hand_on: Callable[[Piece], None],
        count_retry: Callable[[], None],
        lock: threading.Lock,
    ) -> None:
        self.chunk, self.retry, self.cancel = chunk, retry, cancel
        self.take_buffer, self.give_buffer = take_buffer, give_buffer
        self.hand_on, self.count_retry, self.lock = hand_on, count_retry, lock


class SpanReader:
    """One reader thread's reading: the sources it has open and the span it reads."""

    def __init__(self, context: ReadContext, sources: OpenSources) -> None:
        self.context = context
        self.sources = sources

    def read_span(self, task: FileTask, span: Span, slot: Slot) -> None:
        context = self.context
        end = span.offset + span.length
        # A whole-file span of a small file is read in chunk-sized pieces.
        offsets = range(span.offset, end, context.chunk)
        progress = SpanProgress(max(1, len(offsets)))
        if not offsets:  # an empty file: nothing to read, one empty write completes it
            context.hand_on(Piece(task, span, 0, 0, None, progress))
            return
        placer = task.roles.placer
        if placer is not None:
            progress.pieces_left = sum(
                -(-min(context.chunk, end - o) // READ_STEP) for o in offsets
            )
        for offset in offsets:
            length = min(context.chunk, end - offset)
            if placer is not None:
                self._read_placed(task, span, offset, length, placer, progress, slot)
            else:
                self._read_buffered(task, span, offset, length, progress, slot)

    def _read_buffered(
        self,
        task: FileTask,
        span: Span,
        offset: int,
        length: int,
        progress: SpanProgress,
        slot: Slot,
    ) -> None:
        context = self.context
        buffer = context.take_buffer(context.cancel)
        try:
            self._retrying(
                task,
                offset,
                length,
                progress,
                slot,
                lambda: self._read_piece(task, offset, length, buffer[1], slot),
            )
        except BaseException:
            context.give_buffer(buffer)
            raise
        context.hand_on(Piece(task, span, offset, length, buffer, progress))

    def _read_placed(
        self,
        task: FileTask,
        span: Span,
        offset: int,
        length: int,
        placer: PlacingSink,
        progress: SpanProgress,
        slot: Slot,
    ) -> None:
        """Read straight into the sink's memory (no staging buffer, no copy), handing each
        step to the writers as soon as it is read, so a tensor is complete as soon as its
        own bytes are, not when the whole range is. A retry resumes at the failed step."""
        size = padded(task, length) if offset + length >= task.size else length
        target = placer.place(offset, size, self.context.cancel)
        try:
            self._read_into_place(task, span, offset, length, target, progress, slot)
        finally:
            del target  # the sink may reuse the memory once we are done with it
            placer.placed_read_done(offset)

    def _read_into_place(
        self,
        task: FileTask,
        span: Span,
        offset: int,
        length: int,
        target: memoryview,
        progress: SpanProgress,
        slot: Slot,
    ) -> None:
        done = 0

        def step_read(n: int) -> None:
            nonlocal done
            piece = Piece(task, span, offset + done, n, None, progress, target[done : done + n])
            self.context.hand_on(piece)
            done += n

        def read_rest() -> None:
            self._read_piece(task, offset + done, length - done, target[done:], slot, step_read)

        self._retrying(task, offset, length, progress, slot, read_rest)

    def _retrying(
        self,
        task: FileTask,
        offset: int,
        length: int,
        progress: SpanProgress,
        slot: Slot,
        op: Callable[[], None],
    ) -> None:
        retries = retrying_io(task, offset, length, "reading", op, self.context, slot)
        with self.context.lock:
            progress.retries += retries

    def _read_piece(
        self,
        task: FileTask,
        offset: int,
        length: int,
        view: memoryview,
        slot: Slot,
        step_read: Callable[[int], None] | None = None,
    ) -> None:
        """Read ``length`` bytes at ``offset`` into ``view`` in steps of ``READ_STEP``,
        checking the source's identity after each; ``slot`` hears how long each step
        took, and ``step_read(n)`` of each step read."""
        try:
            source = self.sources.get(task)
            # A source that reads by requests (an object store's) makes the span one.
            will_read = getattr(source, "will_read", None)
            if will_read is not None:
                will_read(offset, length)
            pos = 0
            while pos < length:
                n = min(READ_STEP, length - pos)
                last = pos + n >= length
                want = view[pos : pos + (padded(task, n) if last else n)]
                started = time.perf_counter()
                got = source.pread_into(want, offset + pos)
                slot.read_done(got, time.perf_counter() - started)
                if got < n:
                    raise FileError(
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
            self.sources.drop(task)  # a retry starts from a fresh descriptor
            raise


def retrying_io(
    task: FileTask,
    offset: int,
    length: int,
    action: str,
    op: Callable[[], None],
    context: ReadContext,
    slot: Slot | None,
) -> int:
    """Run ``op`` until it succeeds, retrying transient errnos; returns the retries.

    Reads and writes are both retried: ``pread`` and ``pwrite`` at a fixed offset can be
    repeated, and a sync's destination is as flaky as a hydrate's source. A read's
    ``slot`` hears of every transient error (the storage may be overloaded) and, before
    the retry, waits if the limit has dropped since.
    """

    def attempt() -> None:
        if task.failed:  # another worker failed the file: stop reading it
            raise Cancelled
        op()

    def give_up(exc: OSError, attempts: int | None) -> FileError:
        tries = f" after {attempts} attempts" if attempts else ""
        return FileError(
            f"{action} bytes {offset}-{offset + length} failed{tries}: {exc.strerror or exc}",
            path=task.src,
            range=(offset, length),
            errno=exc.errno,
        )

    def transient(exc: OSError) -> None:
        context.count_retry()
        if slot is not None and exc.errno in LOAD_ERRNOS:
            slot.transient_error()

    renew = (lambda: slot.renew(context.cancel)) if slot is not None else None
    _, retries = retrying(
        attempt,
        context.retry,
        give_up,
        cancel=context.cancel,
        on_transient=transient,
        before_retry=renew,
    )
    return retries


def padded(task: FileTask, length: int) -> int:
    """``length`` rounded up to the O_DIRECT alignment of the task's source."""
    align = max(4096, task.policy.alignment)
    return -(-length // align) * align
