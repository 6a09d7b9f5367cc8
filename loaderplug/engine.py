"""The range executor: N workers pull spans from one lazy plan and copy them to sinks.

* Memory is bounded by the workers' buffers: ``workers x chunk`` never exceeds the
  bytes-in-flight budget (see :attr:`Settings.effective_workers`).
* Each span is read with ``pread`` into the worker's own aligned buffer, from a source
  the worker opened itself, and written to every sink of its file.
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

import errno as errno_mod
import os
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import pluggy

from loaderplug.errors import HydrateError
from loaderplug.fs import IOPolicy
from loaderplug.plugins import first_result
from loaderplug.ranges import Span, count_spans, plan
from loaderplug.report import FileResult
from loaderplug.settings import Settings
from loaderplug.sinks import Sink
from loaderplug.source import Identity, Source, aligned_buffer

TRANSIENT_ERRNOS = frozenset({errno_mod.ENOMEM, errno_mod.EIO, errno_mod.EAGAIN})
# Reads are padded to this so O_DIRECT requests stay aligned; buffers have room for it.
READ_PADDING = 64 * 1024


class Cancelled(Exception):
    """Raised inside a worker when the job was cancelled."""


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


class Engine:
    """Runs one job's spans over a pool of worker threads."""

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
        self._crash: BaseException | None = None

    # -- orchestration ------------------------------------------------------------

    def run(self, files: Sequence[FileJob]) -> list[FileResult]:
        """Copy every file; returns one result per file. Re-raises KeyboardInterrupt."""
        threshold = self.settings.split_threshold_bytes
        self.chunk = self.settings.chunk_for_job(sum(f.size for f in files))
        self.workers = self.settings.workers_for_chunk(self.chunk)
        spans_per_file = [count_spans(f.size, self.chunk, threshold) for f in files]
        for job, count in zip(files, spans_per_file, strict=True):
            job.expect_spans(count)
        self._files = files
        self._spans = plan([f.size for f in files], self.chunk, threshold)
        total = sum(spans_per_file)
        threads = [
            threading.Thread(target=self._worker, name=f"loaderplug-{self.job}-{i}", daemon=True)
            for i in range(min(self.workers, total))
        ]
        try:
            for t in threads:
                t.start()
            for t in threads:
                # A timed join keeps the main thread able to take Ctrl-C.
                while t.is_alive():
                    t.join(0.1)
        except BaseException:
            self._cancel.set()
            try:
                for t in threads:
                    while t.is_alive():
                        t.join(0.1)
            finally:
                for job in files:
                    job.abort_unfinished()
            raise
        if self._crash is not None:
            raise self._crash
        return [job.result for job in files if job.result is not None]

    def _next(self) -> tuple[FileJob, Span] | None:
        with self._lock:
            for span in self._spans:
                job = self._files[span.file]
                if not job.failed:
                    return job, span
            return None

    def _worker(self) -> None:
        capacity = self.chunk + READ_PADDING
        buffer = aligned_buffer(capacity)
        view = memoryview(buffer)
        try:
            while not self._cancel.is_set():
                item = self._next()
                if item is None:
                    return
                job, span = item
                try:
                    job.begin()
                    self._copy_span(job, span, view)
                except Cancelled:
                    continue
                except Exception as exc:
                    if job.fail(exc, span):
                        self.pm.hook.loaderplug_on_file_done(job=self.job, result=job.result)
                    continue
                if job.span_done():
                    self._finish(job)
        except BaseException as exc:  # a bug, not an IO error: stop the whole job
            self._crash = exc
            self._cancel.set()
        finally:
            view.release()
            buffer.close()

    def _finish(self, job: FileJob) -> None:
        try:
            check_identity(job, Identity.of(os.stat(job.src)))
            for sink in job.sinks:
                sink.commit()
        except Exception as exc:
            job.fail(exc, None)
        else:
            job.mark_restored()
        self.pm.hook.loaderplug_on_file_done(job=self.job, result=job.result)

    # -- copying one span -----------------------------------------------------------

    def _copy_span(self, job: FileJob, span: Span, view: memoryview) -> None:
        retries = 0
        end = span.offset + span.length
        # A whole-file span of a small file is read in chunk-sized pieces.
        for offset in range(span.offset, end, self.chunk):
            length = min(self.chunk, end - offset)
            retries += self._with_retries(job, offset, length, view)
        self.pm.hook.loaderplug_on_range_done(
            job=self.job, path=job.rel, offset=span.offset, length=span.length, retries=retries
        )

    def _with_retries(self, job: FileJob, offset: int, length: int, view: memoryview) -> int:
        attempts = self.settings.retry_attempts
        for attempt in range(attempts):
            if self._cancel.is_set():
                raise Cancelled
            try:
                self._copy_piece(job, offset, length, view)
                return attempt
            except OSError as exc:
                transient = exc.errno in TRANSIENT_ERRNOS
                if not transient or attempt + 1 == attempts:
                    tries = f" after {attempt + 1} attempts" if transient else ""
                    raise HydrateError(
                        f"copying bytes {offset}-{offset + length} failed{tries}: "
                        f"{exc.strerror or exc}",
                        path=job.src,
                        range=(offset, length),
                        errno=exc.errno,
                    ) from exc
                with self._lock:
                    self.retries += 1
                self._backoff(attempt)
        raise AssertionError("unreachable")

    def _backoff(self, attempt: int) -> None:
        ceiling_ms = min(self.settings.retry_max_ms, self.settings.retry_base_ms * 2**attempt)
        # Full jitter: retries from many workers spread out instead of hitting the
        # volume again in lockstep.
        if self._cancel.wait(random.uniform(0, ceiling_ms) / 1000):
            raise Cancelled

    def _copy_piece(self, job: FileJob, offset: int, length: int, view: memoryview) -> None:
        source: Source = first_result(
            self.pm, "loaderplug_open_source", path=job.src, policy=job.policy
        )
        try:
            check_identity(job, source.identity())
            padded = -(-length // 4096) * 4096
            got = source.pread_into(view[:padded], offset)
            if got < length:
                raise HydrateError(
                    f"source is shorter than expected: read ended at byte {offset + got} "
                    f"of {job.size}; the mirror file is truncated or still being written",
                    path=job.src,
                    range=(offset, length),
                )
            check_identity(job, source.identity())
        finally:
            source.close()
        data = view[:length]
        for sink in job.sinks:
            sink.write(data, offset)
        with self._lock:
            self.bytes_copied += length
            if self.on_bytes is not None:
                self.on_bytes(length)
