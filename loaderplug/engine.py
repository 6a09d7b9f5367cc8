"""The range executor: N readers pull spans from one lazy plan; writers land them in sinks.

* Memory is bounded by one pool of aligned buffers, ``bytes in flight / chunk`` of them:
  at most ``workers x chunk`` bytes are being read from the volume at once. How many
  readers read at once is a :mod:`loaderplug.concurrency` limit: fixed, or adaptive
  with ``LOADERPLUG_HYDRATE_WORKERS=auto``. When the
  budget holds more buffers than workers (small jobs get smaller ranges), the spares let
  a reader start its next range while its last one is still being written to disk.
* Each span is read with ``pread`` from a source the reader opened itself, into a
  buffer of its own, then written with ``pwrite`` to every sink of its file.
* ENOMEM, EIO and EAGAIN are retried per span with exponential backoff and full jitter;
  any other error, or exhausted retries, fails that file only. Its remaining spans are
  skipped and its sinks aborted; other files carry on.
* The source's identity, pinned before the copy, is checked at every open and after
  every read, and once more before commit: a file that changes underneath fails instead
  of publishing mixed bytes.
* Cancellation (Ctrl-C) is seen between reads and during backoff, so workers stop within
  about one span's time; unfinished sinks are aborted before the interrupt propagates.
"""

from __future__ import annotations

import contextlib
import errno as errno_mod
import functools
import logging
import mmap
import queue
import random
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import pluggy

from loaderplug.concurrency import (
    AdaptiveLimit,
    Cancelled,
    ConcurrencyLimit,
    FixedLimit,
    Slot,
)
from loaderplug.errors import HydrateError
from loaderplug.fs import IOPolicy, is_network_type
from loaderplug.plugins import first_result
from loaderplug.ranges import Span, count_spans, plan
from loaderplug.report import FileResult
from loaderplug.settings import Settings
from loaderplug.sinks import PlacingSink, Sink
from loaderplug.source import Identity, Source, aligned_buffer

TRANSIENT_ERRNOS = frozenset({errno_mod.ENOMEM, errno_mod.EIO, errno_mod.EAGAIN})
# Ranges are read in steps of this size (a multiple of every O_DIRECT alignment): reads
# straight into a sink's memory hand each step on, so tensors complete as their own bytes
# land, mid-range, and the adaptive limit sees throughput and latency step by step.
READ_STEP = 4 * 1024 * 1024
# Buffers have this much room past a chunk, so a read padded up to the O_DIRECT alignment
# (at most 64 KiB, see fs.direct_io_alignment) still fits.
READ_PADDING = 64 * 1024
log = logging.getLogger(__name__)


def backoff_s(settings: Settings, attempt: int) -> float:
    """Seconds to wait before retry ``attempt + 1``: exponential, with full jitter, so
    retries from many workers spread out instead of hitting the volume in lockstep."""
    ceiling_ms = min(settings.retry_max_ms, settings.retry_base_ms * 2**attempt)
    return random.uniform(0, ceiling_ms) / 1000


@dataclass(eq=False)
class FileJob:
    """One file to copy: where it comes from, what it must look like, where it goes."""

    rel: str
    src: str
    identity: Identity
    sinks: list[Sink]
    policy: IOPolicy
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

    def mark_restored(self) -> None:
        with self._lock:
            self.result = FileResult(self.rel, "restored", self.size)
            self._done = True

    def abort_unfinished(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        for sink in self.sinks:
            sink.abort()


def _describe(identity: Identity) -> str:
    return f"size {identity.size}, mtime_ns {identity.mtime_ns}, inode {identity.inode}"


def check_identity(job: FileJob, now: Identity) -> None:
    if now != job.identity:
        raise HydrateError(
            f"source changed while being copied (was {_describe(job.identity)}, "
            f"now {_describe(now)}); run again once the mirror holds still",
            path=job.src,
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

    job: FileJob
    span: Span
    offset: int
    length: int
    buffer: tuple[mmap.mmap, memoryview] | None  # a pool buffer to give back, if any
    span_left: list[int]  # [pieces not yet written, retries so far], under Engine._lock
    placed: memoryview | None = None  # bytes read straight into a sink's own memory


class Engine:
    """Runs one job's spans over a pool of reader threads and a pool of writer threads."""

    def __init__(
        self,
        settings: Settings,
        pm: pluggy.PluginManager,
        *,
        job: str,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        self.settings = settings
        self.pm = pm
        self.job = job
        self.chunk = settings.effective_chunk_bytes
        self.workers = settings.effective_workers
        self.on_bytes = on_bytes
        self.retries = 0
        self.bytes_copied = 0
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self._spans: Iterator[Span] = iter(())
        self._files: Sequence[FileJob] = ()
        self._writes: queue.SimpleQueue[_Write | None] = queue.SimpleQueue()
        self._pool = BufferPool(0, 0)
        self.limit: ConcurrencyLimit = FixedLimit(self.workers)
        self._crash: BaseException | None = None

    def cancel(self) -> None:
        """Stop from another thread: readers stop within about one range's time."""
        self._cancel.set()

    # -- orchestration ------------------------------------------------------------

    def run(self, files: Sequence[FileJob]) -> list[FileResult]:
        """Copy every file; returns one result per file. Re-raises KeyboardInterrupt."""
        threshold = self.settings.split_threshold_bytes
        # Whether any source is on a network filesystem: auto splits the budget for many
        # readers there, for few long ranges on a local disk.
        network = any(is_network_type(f.policy.fs_type) for f in files)
        self.chunk = self.settings.chunk_for_job(sum(f.size for f in files), network=network)
        self.workers = self.settings.workers_for_chunk(self.chunk)
        spans_per_file = [count_spans(f.size, self.chunk, threshold) for f in files]
        for job, count in zip(files, spans_per_file, strict=True):
            job.expect_spans(count)
        self._files = files
        self._spans = plan([f.size for f in files], self.chunk, threshold)
        count = min(self.workers, sum(spans_per_file))
        self.limit = AdaptiveLimit(count) if self.settings.adaptive_workers else FixedLimit(count)
        buffers = max(count, self.settings.bytes_in_flight // self.chunk)
        self._pool = BufferPool(buffers, self.chunk + READ_PADDING)
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
            try:
                for _ in writers:
                    self._writes.put(None)
                self._join(readers + writers)
            finally:
                for job in files:
                    job.abort_unfinished()
            raise
        finally:
            self._pool.close()
        if self._crash is not None:
            for job in files:
                job.abort_unfinished()
            raise self._crash
        return [job.result for job in files if job.result is not None]

    def _thread(self, target: Callable[[], None], name: str) -> threading.Thread:
        def guarded() -> None:
            try:
                target()
            except BaseException as exc:  # a bug, not an IO error: stop the whole job
                # Drop the frames so no buffer slice stays referenced from the traceback.
                traceback.clear_frames(exc.__traceback__)
                self._crash = exc
                self._cancel.set()

        return threading.Thread(target=guarded, name=f"loaderplug-{self.job}-{name}", daemon=True)

    @staticmethod
    def _join(threads: list[threading.Thread]) -> None:
        for t in threads:
            # A timed join keeps the main thread able to take Ctrl-C.
            while t.is_alive():
                t.join(0.1)

    def _next(self) -> tuple[FileJob, Span] | None:
        with self._lock:
            for span in self._spans:
                job = self._files[span.file]
                if not job.failed:
                    return job, span
            return None

    def _fail(self, job: FileJob, exc: BaseException, span: Span | None) -> None:
        if job.fail(exc, span):
            self._notify("loaderplug_on_file_done", job=self.job, result=job.result)

    def _notify(self, hook: str, **kwargs: object) -> None:
        """Call an observe hook; an observer that raises is logged, never fatal to a copy."""
        try:
            getattr(self.pm.hook, hook)(**kwargs)
        except Exception:
            log.warning("a plugin's %s raised; the copy goes on", hook, exc_info=True)

    # -- reading ----------------------------------------------------------------------

    def _reader(self) -> None:
        self.limit.enter()
        try:
            while not self._cancel.is_set():
                slot = self.limit.acquire(self._cancel)
                try:
                    item = self._next()
                    if item is None:
                        return
                    job, span = item
                    try:
                        job.begin()
                        self._read_span(job, span, slot)
                    except Cancelled:
                        continue
                    except Exception as exc:
                        self._fail(job, exc, span)
                finally:
                    self.limit.release(slot)
        except Cancelled:
            return
        finally:
            self.limit.leave()

    def _read_span(self, job: FileJob, span: Span, slot: Slot) -> None:
        end = span.offset + span.length
        # A whole-file span of a small file is read in chunk-sized pieces.
        offsets = range(span.offset, end, self.chunk)
        span_left = [max(1, len(offsets)), 0]
        if not offsets:  # an empty file: nothing to read, one empty write completes it
            self._writes.put(_Write(job, span, 0, 0, None, span_left))
            return
        placer = next((s for s in job.sinks if isinstance(s, PlacingSink)), None)
        if placer is not None:
            span_left[0] = sum(-(-min(self.chunk, end - o) // READ_STEP) for o in offsets)
        for offset in offsets:
            length = min(self.chunk, end - offset)
            if placer is not None:
                self._read_placed(job, span, offset, length, placer, span_left, slot)
                continue
            buffer = self._pool.take(self._cancel)
            try:
                retries = self._retrying(
                    job,
                    offset,
                    length,
                    "reading",
                    functools.partial(self._read_piece, job, offset, length, buffer[1], slot),
                    slot=slot,
                )
            except BaseException:
                self._pool.give(buffer)
                raise
            with self._lock:
                span_left[1] += retries
            self._writes.put(_Write(job, span, offset, length, buffer, span_left))

    def _retrying(
        self,
        job: FileJob,
        offset: int,
        length: int,
        action: str,
        op: Callable[[], None],
        *,
        slot: Slot | None = None,
    ) -> int:
        """Run ``op`` until it succeeds, retrying transient errnos; returns the retries.

        Reads and writes are both retried: ``pread`` and ``pwrite`` at a fixed offset
        can be repeated, and a sync's destination is as flaky as a hydrate's source.
        A read's ``slot`` hears of every transient error (the storage may be overloaded)
        and, before the retry, waits if the limit has dropped since.
        """
        attempts = self.settings.retry_attempts
        for attempt in range(attempts):
            if self._cancel.is_set() or job.failed:
                raise Cancelled
            try:
                op()
                return attempt
            except OSError as exc:
                transient = exc.errno in TRANSIENT_ERRNOS
                if not transient or attempt + 1 == attempts:
                    tries = f" after {attempt + 1} attempts" if transient else ""
                    raise HydrateError(
                        f"{action} bytes {offset}-{offset + length} failed{tries}: "
                        f"{exc.strerror or exc}",
                        path=job.src,
                        range=(offset, length),
                        errno=exc.errno,
                    ) from exc
                with self._lock:
                    self.retries += 1
                if slot is not None:
                    slot.transient_error()
                self._backoff(attempt)
                if slot is not None:
                    slot.renew(self._cancel)
        raise AssertionError("unreachable")

    def _backoff(self, attempt: int) -> None:
        if self._cancel.wait(backoff_s(self.settings, attempt)):
            raise Cancelled

    def _read_placed(
        self,
        job: FileJob,
        span: Span,
        offset: int,
        length: int,
        placer: PlacingSink,
        span_left: list[int],
        slot: Slot,
    ) -> None:
        """Read straight into the sink's memory (no staging buffer, no copy), handing each
        step to the writers as soon as it lands, so a tensor is complete as soon as its
        own bytes are, not when the whole range is. A retry resumes at the failed step."""
        size = _padded(job, length) if offset + length >= job.size else length
        target = placer.place(offset, size)
        done = 0

        def landed(n: int) -> None:
            nonlocal done
            self._writes.put(
                _Write(job, span, offset + done, n, None, span_left, target[done : done + n])
            )
            done += n

        def read_rest() -> None:
            self._read_piece(job, offset + done, length - done, target[done:], slot, landed)

        retries = self._retrying(job, offset, length, "reading", read_rest, slot=slot)
        with self._lock:
            span_left[1] += retries

    def _read_piece(
        self,
        job: FileJob,
        offset: int,
        length: int,
        view: memoryview,
        slot: Slot,
        landed: Callable[[int], None] | None = None,
    ) -> None:
        """Read ``length`` bytes at ``offset`` into ``view`` from a freshly opened source,
        in steps of ``READ_STEP``, checking the source's identity before and after each;
        ``slot`` hears how long each step took, and ``landed(n)`` after each."""
        source: Source = first_result(
            self.pm, "loaderplug_open_source", path=job.src, policy=job.policy
        )
        try:
            check_identity(job, source.identity())
            pos = 0
            while pos < length:
                n = min(READ_STEP, length - pos)
                last = pos + n >= length
                want = view[pos : pos + (_padded(job, n) if last else n)]
                started = time.perf_counter()
                got = source.pread_into(want, offset + pos)
                slot.landed(got, time.perf_counter() - started)
                if got < n:
                    raise HydrateError(
                        f"source is shorter than expected: read ended at byte "
                        f"{offset + pos + got} of {job.size}; the mirror file is truncated "
                        f"or still being written",
                        path=job.src,
                        range=(offset, length),
                    )
                check_identity(job, source.identity())
                pos += n
                if landed is not None:
                    landed(n)
        finally:
            source.close()

    # -- writing ----------------------------------------------------------------------

    def _writer(self) -> None:
        while True:
            write = self._writes.get()
            if write is None:
                return
            job = write.job
            try:
                if self._cancel.is_set() or job.failed:
                    continue
                data = write.placed
                if data is None and write.buffer is not None:
                    data = write.buffer[1][: write.length]
                if data is not None:
                    land = functools.partial(_write_all, job.sinks, data, write.offset)
                    try:
                        retries = self._retrying(job, write.offset, write.length, "writing", land)
                    except Cancelled:
                        continue
                    except HydrateError as exc:
                        self._fail(job, exc, write.span)
                        continue
                    with self._lock:
                        write.span_left[1] += retries
            finally:
                if write.buffer is not None:
                    self._pool.give(write.buffer)
            self._landed(write)

    def _landed(self, write: _Write) -> None:
        with self._lock:
            self.bytes_copied += write.length
            if self.on_bytes is not None:
                self.on_bytes(write.length)
            write.span_left[0] -= 1
            span_done, retries = write.span_left[0] == 0, write.span_left[1]
        if not span_done:
            return
        span = write.span
        self._notify(
            "loaderplug_on_range_done",
            job=self.job,
            path=write.job.rel,
            offset=span.offset,
            length=span.length,
            retries=retries,
        )
        if write.job.span_done():
            self._finish(write.job)

    def _finish(self, job: FileJob) -> None:
        try:
            source = first_result(
                self.pm, "loaderplug_open_source", path=job.src, policy=job.policy
            )
            try:
                check_identity(job, source.identity())
            finally:
                source.close()
            for sink in job.sinks:
                sink.commit()
        except Exception as exc:
            job.fail(exc, None)
        else:
            job.mark_restored()
        self._notify("loaderplug_on_file_done", job=self.job, result=job.result)


def _padded(job: FileJob, length: int) -> int:
    """``length`` rounded up to the O_DIRECT alignment of the job's source."""
    align = max(4096, job.policy.alignment)
    return -(-length // align) * align


def _write_all(sinks: Sequence[Sink], data: memoryview, offset: int) -> None:
    for sink in sinks:
        sink.write(data, offset)
