"""The runner: executes any :class:`~loaderplug.jobs.plan.Plan`, the same way for every job.

It alone owns what every job shares:

1. the destination's check (a folder, not a file) and locks; a destination that takes
   no lock (read-only) is fine while nothing there needs writing;
2. the plan's ``around`` context (a sync's mark on the mirror);
3. listing the source (under the lock: a job that waited sees what the other left);
4. the current-file rule (:func:`~loaderplug.engine.sinks.is_current_copy`): a copy that is
   current is skipped, or, when the job loads tensors, read locally instead of from the
   source;
5. resuming what a killed run left (:mod:`loaderplug.jobs.partial`), and sweeping the rest;
6. the IO policy of every file, its sinks (a :class:`~loaderplug.engine.sinks.FileSink` for a
   copy, a :class:`~loaderplug.jobs.digest.DigestSink` where the plan expects a hash, the
   plan's tensor sink for a load) and, for a load, its header;
7. the engine's run, with a progress bar, and the tensors it hands over;
8. symlinks, refusals, the plan's ``finish`` step, every observer call, and the report.

A load's lock is let go as soon as nothing is left to publish, so ranks that find the
local copy current read it side by side.
"""

from __future__ import annotations

import contextlib
import errno
import os
import posixpath
import queue
import sys
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from loaderplug.engine.concurrency import AdaptiveLimit, ConcurrencyLimit, FixedLimit
from loaderplug.engine.executor import Engine, EngineStats, FileTask
from loaderplug.engine.retry import RetryPolicy, retrying
from loaderplug.engine.sinks import BudgetedSink, Sink
from loaderplug.engine.sizing import default_sizing, size_job
from loaderplug.engine.spans import Landed, Span, count_spans, file_major, offset_major
from loaderplug.errors import DestinationError, FormatError, HydrateError, TransferFailed
from loaderplug.jobs.current_copy import is_current_copy
from loaderplug.jobs.digest import DigestSink, ReorderWindow
from loaderplug.jobs.file_sink import FileSink, file_sink, temp_name_for, temps_of
from loaderplug.jobs.locks import Lock
from loaderplug.jobs.partial import read_landed
from loaderplug.jobs.plan import FileEntry, Listing, Plan
from loaderplug.plugins.manager import Plugins
from loaderplug.report import TransferReport
from loaderplug.settings import Settings
from loaderplug.storage.atomic import replace_with_link
from loaderplug.storage.mounts import is_network_type
from loaderplug.tensors.header import LENGTH_BYTES, Header, header_length, parse_header
from loaderplug.types import FileResult, Identity, IOPolicy, Source, Status


def run(plan: Plan, settings: Settings) -> TransferReport:
    """Execute a plan that loads no tensors; returns its report."""
    runner = Runner(plan, settings)
    for _ in runner.tensors():
        raise AssertionError("a copy job handed over a tensor")
    assert runner.report is not None
    return runner.report


@dataclass(frozen=True)
class TensorReady:
    """A tensor of the file ``rel``, whole, handed to the consumer."""

    rel: str
    name: str
    tensor: Any


@dataclass(frozen=True)
class FileFinished:
    """A file of a load was read to its end (every tensor of it handed over before), or
    failed."""

    result: FileResult


Event = TensorReady | FileFinished


@dataclass
class _Prepared:
    """A job's files once the lock is held: what the engine reads, what is mapped, and
    the results already known (skipped, refused, ...)."""

    tasks: list[FileTask] = field(default_factory=list)
    mapped: list[tuple[str, Header]] = field(default_factory=list)
    results: list[FileResult] = field(default_factory=list)
    header_retries: int = 0
    resumed: set[Path] = field(default_factory=set)  # partial copies and their journals


class Runner:
    """One execution of a plan. :meth:`tensors` runs it (yielding tensors, for a load);
    afterwards :attr:`report`, :attr:`first_tensor_s` and :attr:`io_modes` tell what
    happened."""

    def __init__(self, plan: Plan, settings: Settings) -> None:
        self.plan = plan
        self.settings = settings
        self.plugins = Plugins(settings)
        self.report: TransferReport | None = None
        self.first_tensor_s: float | None = None
        self.io_modes: dict[str, str] = {}  # source path -> how it was read, and why
        self.resumed_bytes = 0  # bytes a killed run had copied, not read again
        self._policies: dict[str, IOPolicy] = {}
        self._sizing = default_sizing(settings)
        # Early ranges kept aside to hash files in order (see loaderplug.jobs.digest).
        self._window = ReorderWindow(settings.bytes_in_flight)
        # Events from the engine's threads for the consumer's; None: the engine is done;
        # an exception: raise it (see interrupt).
        self._ready: queue.SimpleQueue[Event | BaseException | None] = queue.SimpleQueue()
        self._interrupted: BaseException | None = None

    def tensors(self) -> Iterator[tuple[str, Any]]:
        """Run the job; for a load, yield ``(name, tensor)`` as each completes."""
        for event in self.events():
            if isinstance(event, TensorReady):
                item = [(event.name, event.tensor)]
                del event
                yield item.pop()  # see Runner._hand_over

    def interrupt(self, exc: BaseException) -> None:
        """From any thread: stop a load, raising ``exc`` to its consumer where it waits
        for the next tensor, or as soon as it asks for one (before any it has not taken
        yet). Ranks sharing a load call it when one of them dies."""
        self._interrupted = exc
        self._ready.put(exc)

    def events(self) -> Generator[Event, None, None]:
        """Run the job, yielding each tensor as it completes and each file of a load
        once it is done (for callers that act per file: ranks sharing a load)."""
        plan, settings = self.plan, self.settings
        if plan.destination is not None:
            check_destination(plan.job, plan.destination)
        # In order: planners list lock files so that jobs sharing some never deadlock.
        locks = [Lock(path, settings.lock_timeout_s) for path in plan.locks]
        waited, read_only = 0.0, ""
        guard = contextlib.ExitStack()
        try:
            try:
                for lock in locks:
                    waited += lock.acquire()
            except OSError as exc:
                if exc.errno not in READ_ONLY_ERRNOS:
                    raise
                # Nothing can be written there: fine if nothing needs to be (checked below).
                read_only = f"{exc.strerror or exc}: {exc.filename}"
            if plan.around is not None:
                guard.enter_context(plan.around())
            # We hold the lock: whatever these are, a run that died left them.
            leftovers = [] if read_only else plan.leftovers()
            listing = plan.list_files()
            started = time.monotonic()
            prepared = self._prepare(listing)
            for leftover in leftovers:
                if leftover not in prepared.resumed:  # a partial copy resumed stays
                    leftover.unlink(missing_ok=True)
            if read_only:
                _check_nothing_to_write(plan, prepared, read_only)
            if plan.tensors is not None and not self._publishes(prepared):
                for lock in locks:  # nothing left to publish: others may read side by side
                    lock.release()
            stats = yield from self._execute(prepared, started)
            results = prepared.results + stats.results
            failed = {r.path for r in results if r.status == "failed"} | set(listing.refused)
            others = [
                self._place_symlink(rel, target, failed)
                for rel, target in sorted(listing.symlinks.items())
            ]
            others += [
                FileResult(rel, "failed", reason=reason)
                for rel, reason in sorted(listing.refused.items())
            ]
            # The engine told observers of the files it read; these are the rest.
            for result in prepared.results + others:
                self.plugins.notify_file_done(plan.job, result)
            report = self._report(results + others, stats, prepared, started, waited)
            if plan.finish is not None:
                plan.finish(listing, report)
        except BaseException as exc:
            guard.__exit__(type(exc), exc, exc.__traceback__)
            raise
        else:
            guard.close()
        finally:
            for lock in reversed(locks):
                lock.release()
        self.report = report
        self.plugins.notify_job_done(report)

    # -- before the engine --------------------------------------------------------------

    def _prepare(self, listing: Listing) -> _Prepared:
        prepared = _Prepared(results=self._make_dirs(listing.dirs))
        if self.plan.tensors is not None:
            self._finish_partial_copies(listing, prepared)
        for entry in listing.files:
            requested, copy_to, note = str(entry.source), entry.copy_to, ""
            if copy_to is not None and is_current_copy(copy_to, entry.identity):
                if self.plan.tensors is None:
                    prepared.results.append(FileResult(entry.rel, "skipped", entry.identity.size))
                    continue
                # Read the current local copy instead of the source: nothing to publish.
                local = Identity.of(os.stat(copy_to))
                entry = replace(entry, source=copy_to, identity=local, copy_to=None)
                note = f", from the current local copy {copy_to}"
            self._prepare_entry(entry, prepared, requested, note)
        return prepared

    def _finish_partial_copies(self, listing: Listing, prepared: _Prepared) -> None:
        """A load's files that a killed run left partly copied are finished first, as a
        copy (only what had not landed is read from the source); their tensors are then
        read from the local copy, like those of any current copy."""
        partial = [
            e
            for e in listing.files
            if e.copy_to is not None
            and not is_current_copy(e.copy_to, e.identity)
            and read_landed(e.copy_to, e.identity) is not None
        ]
        if not partial:
            return
        plan = self.plan
        finish = Plan(
            job=plan.job,
            source=plan.source,
            destination=plan.destination,
            list_files=lambda: Listing(files=partial),  # the locks are held already
            expect=plan.expect,
        )
        report = run(finish, self.settings)
        prepared.resumed.update(p for e in partial if e.copy_to for p in temps_of(e.copy_to))
        if not report.ok:
            raise TransferFailed(report)

    def _prepare_entry(
        self, entry: FileEntry, prepared: _Prepared, requested: str, note: str
    ) -> None:
        """The file's sinks and how it is read; ``io_modes`` says so under the path the
        job was asked to read (``requested``), with ``note`` when another is read."""
        plan, settings = self.plan, self.settings
        policy = self._policy(entry.source, per_file=plan.tensors is not None)
        sinks: list[Sink] = []
        resume: Landed | None = None
        if entry.copy_to is not None:
            target = self._policy(entry.copy_to)
            resume = read_landed(entry.copy_to, entry.identity)
            if resume is not None:
                prepared.resumed.update(temps_of(entry.copy_to))
                self.resumed_bytes += resume.nbytes
            sinks.append(
                file_sink(
                    entry.copy_to,
                    entry.identity,
                    target,
                    fsync=settings.fsync,
                    mode=entry.mode,
                    resume=resume,
                )
            )
            expected = plan.expect(entry.rel) if plan.expect is not None else None
            if expected is not None:
                # First: a copy that does not hash right is refused before it is published.
                file = sinks[-1]
                assert isinstance(file, FileSink)
                digest = DigestSink(
                    entry.rel, entry.identity.size, expected, self._window, file.blocks
                )
                sinks.insert(0, digest)
        mode = f"{'direct' if policy.direct else 'buffered'} ({policy.reason}){note}"
        if plan.tensors is not None:
            header, retries = self._read_header(entry, policy)
            prepared.header_retries += retries
            if entry.copy_to is None and plan.tensors.maps(policy):
                self.io_modes[requested] = f"mapped ({policy.reason}){note}"
                prepared.mapped.append((entry.rel, header))
                return
            rel = entry.rel
            sinks.append(
                plan.tensors.sink(
                    header, lambda name, t: self._ready.put(TensorReady(rel, name, t))
                )
            )
        self.io_modes[requested] = mode
        outcome: Status = "restored" if entry.copy_to is not None else "loaded"
        prepared.tasks.append(
            FileTask(
                entry.rel,
                str(entry.source),
                entry.identity,
                sinks,
                policy,
                outcome=outcome,
                landed=resume or Landed(),
            )
        )

    def _policy(self, path: Path, *, per_file: bool = False) -> IOPolicy:
        """One IO-policy decision per folder (a destination folder may not exist yet: its
        policy is decided from the nearest existing parent), or with ``per_file`` per
        file: whether a file to load is in the page cache is its own."""
        key = str(path if per_file else path.parent)
        if key not in self._policies:
            self._policies[key] = self.plugins.io_policy(path)
        return self._policies[key]

    def _read_header(self, entry: FileEntry, policy: IOPolicy) -> tuple[Header, int]:
        """The file's header (two small reads), retried like any read; a file that
        changed since it was listed fails here."""
        path = str(entry.source)

        def read() -> Header:
            source = self.plugins.open_source(path, policy)
            try:
                if not source.identity().matches(entry.identity, inode=policy.stable_inodes):
                    raise HydrateError(
                        f"{path}: changed since it was listed (now {source.identity().describe()})",
                        path=path,
                    )
                return _read_header(source, path)
            finally:
                source.close()

        def give_up(exc: OSError, attempts: int | None) -> HydrateError:
            tries = f" after {attempts} attempts" if attempts else ""
            return HydrateError(
                f"{path}: reading the header failed{tries}: {exc.strerror or exc}",
                path=path,
                errno=exc.errno,
            )

        return retrying(read, RetryPolicy.of(self.settings), give_up)

    def _make_dirs(self, dirs: list[str]) -> list[FileResult]:
        """Create the source's folders (empty ones included); a clash is that path's failure."""
        failures: list[FileResult] = []
        root = self.plan.destination
        if root is None:
            return failures
        for rel in dirs:
            try:
                (root / rel).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                reason = f"cannot create the folder: {exc.strerror or exc}"
                failures.append(FileResult(rel, "failed", reason=reason, errno=exc.errno))
        return failures

    @staticmethod
    def _publishes(prepared: _Prepared) -> bool:
        return any(t.outcome == "restored" for t in prepared.tasks)

    # -- the engine ---------------------------------------------------------------------

    def _engine(self, tasks: list[FileTask]) -> Engine:
        settings = self.settings
        total = sum(t.size for t in tasks)
        # Whether any source is on a network filesystem: auto splits the budget for many
        # readers there, for few long ranges on a local disk.
        network = any(is_network_type(t.policy.fs_type) for t in tasks)
        sizing = self._sizing = size_job(settings, total, network=network)
        threshold = settings.split_threshold_bytes
        spans = sum(count_spans(t.size, sizing.chunk, threshold) for t in tasks)
        readers = max(1, min(sizing.workers, spans))
        limit: ConcurrencyLimit = AdaptiveLimit(readers) if sizing.adaptive else FixedLimit(readers)
        return Engine(
            open_source=self.plugins.open_source,
            limit=limit,
            chunk=sizing.chunk,
            split_threshold=threshold,
            buffers=settings.bytes_in_flight // sizing.chunk,
            retry=RetryPolicy.of(settings),
            observer=_Observer(self.plugins, self.plan.job, self._file_finished),
            # A load reads file by file within its memory budget; a copy spreads its
            # readers across files.
            order=file_major if self.plan.tensors is not None else offset_major,
            gate=_admit if self.plan.tensors is not None else None,
            on_bytes=self._progress(total),
            name=self.plan.job,
        )

    def _execute(self, prepared: _Prepared, started: float) -> Generator[Event, None, EngineStats]:
        """Run the engine over the prepared files, handing over tensors as they complete;
        returns the engine's stats (through ``yield from``)."""
        if not prepared.tasks:
            yield from self._hand_over_mapped(prepared, started)
            return _empty_stats(self.settings)
        engine = self._engine(prepared.tasks)
        try:
            if self.plan.tensors is None:
                return engine.run(prepared.tasks)
            outcome: dict[str, Any] = {}

            def run_engine() -> None:
                try:
                    outcome["stats"] = engine.run(prepared.tasks)
                except BaseException as exc:
                    outcome["error"] = exc
                finally:
                    self._ready.put(None)

            worker = threading.Thread(target=run_engine, name="loaderplug-load", daemon=True)
            worker.start()
            try:
                yield from self._hand_over_mapped(prepared, started)
                while (event := self._next_event()) is not None:
                    if isinstance(event, TensorReady):
                        self.plan.tensors.taken(event.tensor)
                        self._hand_over(event, started)
                    item = [event]
                    del event
                    yield item.pop()  # see Runner._hand_over
            finally:
                if worker.is_alive():  # the consumer stopped early, or an error: stop
                    engine.cancel()
                while worker.is_alive():
                    worker.join(0.1)
            if "error" in outcome:
                raise outcome["error"]
            stats: EngineStats = outcome["stats"]
            return stats
        finally:
            self._close_progress()

    def _next_event(self) -> Event | None:
        if self._interrupted is not None:
            raise self._interrupted
        event = self._ready.get()
        if isinstance(event, BaseException):
            raise event
        return event

    def _hand_over_mapped(self, prepared: _Prepared, started: float) -> Iterator[Event]:
        for rel, header in prepared.mapped:
            assert self.plan.tensors is not None
            for name, tensor in self.plan.tensors.mapped(header):
                item = [TensorReady(rel, name, tensor)]
                del tensor
                self._hand_over(item[0], started)
                yield item.pop()  # see Runner._hand_over
            result = FileResult(rel, "loaded", header.size)
            prepared.results.append(result)
            yield FileFinished(result)

    def _hand_over(self, event: TensorReady, started: float) -> None:
        """Note the tensor's hand-over (first tensor, observers).

        Every generator on the way to the consumer yields a tensor out of a one-element
        list it pops in the ``yield`` itself, never from a local variable: a suspended
        generator keeps its locals, and a tensor the consumer has dropped must be freed
        then, not when the next one comes (the memory budget counts on it).
        """
        if self.first_tensor_s is None:
            self.first_tensor_s = time.monotonic() - started
        self.plugins.notify_tensor_ready(self.plan.job, event.rel, event.name, event.tensor)

    def _file_finished(self, result: FileResult) -> None:
        """On an engine thread: a file is done; for a load, the consumer hears of it after
        the tensors it emitted."""
        if self.plan.tensors is not None:
            self._ready.put(FileFinished(result))

    # -- after the engine ---------------------------------------------------------------

    def _place_symlink(self, rel: str, target: str, failed: set[str]) -> FileResult:
        """Recreate one relative symlink, unless what it points at failed to copy."""
        pointee = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
        if pointee in failed:
            return FileResult(
                rel, "failed", reason=f"not linked: its target {pointee} failed to copy"
            )
        assert self.plan.destination is not None
        dst = self.plan.destination / rel
        try:
            if os.path.islink(dst) and os.readlink(dst) == target:
                return FileResult(rel, "skipped")
            dst.parent.mkdir(parents=True, exist_ok=True)
            replace_with_link(dst, target, temp=temp_name_for(dst))
        except OSError as exc:
            return FileResult(
                rel, "failed", reason=f"cannot create symlink: {exc}", errno=exc.errno
            )
        return FileResult(rel, "linked")

    def _report(
        self,
        results: list[FileResult],
        stats: EngineStats,
        prepared: _Prepared,
        started: float,
        waited: float,
    ) -> TransferReport:
        plan = self.plan
        return TransferReport(
            job=plan.job,
            source=plan.source,
            destination=str(plan.destination or ""),
            # A fixed count is reported as set (fewer readers run for fewer spans); an
            # adaptive one where it ended, with the range it moved in.
            workers=stats.workers if stats.workers_range else self._sizing.workers,
            chunk_bytes=stats.chunk,
            results=results,
            bytes_copied=stats.bytes_copied,
            seconds=time.monotonic() - started,
            retries=stats.retries + prepared.header_retries,
            waited_for_lock_s=waited,
            workers_range=stats.workers_range,
        )

    # -- progress -----------------------------------------------------------------------

    _bar: Any = None

    def _progress(self, total: int) -> Callable[[int], None] | None:
        if not (self.settings.progress and sys.stderr.isatty()) or total == 0:
            return None
        from tqdm.auto import tqdm

        desc = f"{self.plan.job} {Path(self.plan.source).name}"
        self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc)
        return self._bar.update  # type: ignore[no-any-return]

    def _close_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class _Observer:
    """The engine's observer: every call goes to the plugins' (guarded) observe hooks;
    a finished file goes to ``finished`` too."""

    def __init__(self, plugins: Plugins, job: str, finished: Callable[[FileResult], None]) -> None:
        self.plugins, self.job, self.finished = plugins, job, finished

    def range_done(self, rel: str, offset: int, length: int, retries: int) -> None:
        self.plugins.notify_range_done(self.job, rel, offset, length, retries)

    def file_done(self, result: FileResult) -> None:
        self.plugins.notify_file_done(self.job, result)
        self.finished(result)


# A destination that cannot take a lock file: a read-only filesystem or folder.
READ_ONLY_ERRNOS = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})


def check_destination(job: str, destination: Path) -> None:
    """A destination must be a folder, or not exist yet under folders."""
    for folder in (destination, *destination.parents):
        if folder.exists() and not folder.is_dir():
            where = "is" if folder == destination else f"is under {folder}, which is"
            raise DestinationError(
                f"{job} destination {destination} {where} a file, not a folder; "
                f"pick a folder (or remove the file)"
            )
        if folder.exists():
            return


def _check_nothing_to_write(plan: Plan, prepared: _Prepared, why: str) -> None:
    """A read-only destination serves a job only if every copy there is current."""
    stale = [t.rel for t in prepared.tasks if t.outcome == "restored"]
    if stale:
        shown = ", ".join(stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
        raise DestinationError(
            f"{plan.job} destination {plan.destination} cannot be written ({why}) and "
            f"{len(stale)} file(s) there are missing or out of date: {shown}"
        )


def _admit(task: FileTask, span: Span, cancel: threading.Event) -> None:
    """The engine's gate: a span waits for room in its file's memory budget."""
    for sink in task.sinks:
        if isinstance(sink, BudgetedSink):
            sink.admit(span.offset, span.length, cancel)


def _empty_stats(settings: Settings) -> EngineStats:
    sizing = default_sizing(settings)
    return EngineStats([], 0, 0, sizing.chunk, sizing.workers, None, cancelled=False)


def _read_header(source: Source, path: str) -> Header:
    """Read and validate the header of an open source (two small reads)."""
    size = source.size
    first = bytearray(min(size, LENGTH_BYTES))
    got = source.pread_into(memoryview(first), 0)
    n = header_length(path, bytes(first[:got]), size)
    raw = bytearray(n)
    if source.pread_into(memoryview(raw), LENGTH_BYTES) < n:
        raise FormatError(f"{path}: file ended inside its header")
    return parse_header(path, bytes(raw), size)
