"""The runner: executes any :class:`~loaderplug.jobs.plan.Plan`, the same way for every job.

It alone owns what every job shares:

1. the destination's check (a folder, not a file) and locks; a destination that takes
   no lock (read-only) is fine while nothing there needs writing;
2. the plan's ``around`` context (a sync's mark on the mirror);
3. listing the source (under the lock: a job that waited sees what the other left);
4. the current-copy rule (:mod:`loaderplug.jobs.current_copy`): a copy that is current
   is skipped, or, when the job delivers its files' contents, read locally instead of
   from the source;
5. resuming what a killed run left (:mod:`loaderplug.jobs.partial`), and sweeping the
   rest;
6. the IO policy of every file and its sinks (a :class:`~loaderplug.jobs.file_sink.FileSink`
   for a copy, a :class:`~loaderplug.jobs.digest.DigestSink` where the plan expects a
   hash, the delivery's sink for a file whose contents go to a consumer);
7. the engine's run, with a progress bar; a plan with a delivery lets it run the engine
   and hand over what lands (:mod:`loaderplug.tensors.delivery.choice` and
   :mod:`loaderplug.tensors.delivery.hand_over` for a load);
8. symlinks, refusals, the plan's ``finish`` step, every observer call, and the report.

A delivering job's lock is let go as soon as nothing is left to publish, so ranks that
find the local copy current read it side by side.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from loaderplug.engine.concurrency import AdaptiveLimit, ConcurrencyLimit, FixedLimit
from loaderplug.engine.executor import Engine, EngineStats, FileTask
from loaderplug.engine.reading import READ_STEP
from loaderplug.engine.retry import RetryPolicy
from loaderplug.engine.sinks import Sink
from loaderplug.engine.sizing import Sizing, default_sizing, size_job
from loaderplug.engine.spans import Landed, count_spans, file_major, head_in_steps, offset_major
from loaderplug.errors import TransferFailed
from loaderplug.jobs.current_copy import is_current_copy
from loaderplug.jobs.digest import DigestSink, ReorderWindow
from loaderplug.jobs.file_sink import file_sink, temps_of
from loaderplug.jobs.locks import Lock
from loaderplug.jobs.partial import read_landed
from loaderplug.jobs.placing import (
    READ_ONLY_ERRNOS,
    check_destination,
    check_nothing_to_write,
    make_dirs,
    place_symlinks,
)
from loaderplug.jobs.plan import FileEntry, Listing, Plan
from loaderplug.jobs.progress import ProgressBar
from loaderplug.plugins.manager import Plugins
from loaderplug.report import TransferReport
from loaderplug.settings import Settings
from loaderplug.storage.mounts import is_network_type
from loaderplug.storage.residency import NOT_ASKED
from loaderplug.storage.safe_paths import LinkOnPath, guard_root, unlink_below
from loaderplug.types import FileResult, Identity, IOPolicy, Status


def run(plan: Plan, settings: Settings) -> TransferReport:
    """Execute a plan that delivers nothing; returns its report."""
    runner = Runner(plan, settings)
    for _ in runner.run():
        raise AssertionError("a copy job handed something over")
    assert runner.report is not None
    return runner.report


@dataclass
class _Prepared:
    """A job's files once the lock is held: what the engine reads and the results
    already known (skipped, refused, ...)."""

    tasks: list[FileTask] = field(default_factory=list)
    results: list[FileResult] = field(default_factory=list)
    resumed: set[Path] = field(default_factory=set)  # partial copies and their journals

    @property
    def stale(self) -> list[str]:
        """The files it publishes."""
        return [t.rel for t in self.tasks if t.outcome == "restored"]


class Runner:
    """One execution of a plan. :meth:`run` runs it (yielding what the plan's delivery
    hands over, if it has one); afterwards :attr:`report` and :attr:`io_modes` tell what
    happened."""

    def __init__(self, plan: Plan, settings: Settings) -> None:
        self.plan = plan
        self.settings = settings
        self.plugins = Plugins(settings)
        self.report: TransferReport | None = None
        self.io_modes: dict[str, str] = {}  # source path -> how it was read, and why
        self.resumed_bytes = 0  # bytes a killed run had copied, not read again
        self._policies: dict[str, IOPolicy] = {}
        self._sizing: Sizing = default_sizing(settings)
        # Early ranges kept aside to hash files in order (see loaderplug.jobs.digest).
        self._window = ReorderWindow(settings.bytes_in_flight)
        self._progress = ProgressBar(settings.progress, f"{plan.job} {Path(plan.source).name}")

    def run(self) -> Generator[Any, None, None]:
        """Run the job, yielding whatever its delivery hands over (nothing for a copy)."""
        plan, settings = self.plan, self.settings
        if plan.destination is not None:
            check_destination(plan.job, plan.destination)
        # In order: planners list lock files so that jobs sharing some never deadlock.
        locks = [Lock(path, settings.lock_timeout_s) for path in plan.locks]
        guard = contextlib.ExitStack()
        try:
            waited, read_only = _acquire(locks)
            if plan.around is not None:
                guard.enter_context(plan.around())
            # We hold the lock: whatever these are, a run that died left them.
            leftovers = [] if read_only else plan.leftovers()
            listing = plan.list_files()
            started = time.monotonic()
            prepared = self._prepare(listing)
            for leftover in leftovers:
                if leftover not in prepared.resumed:  # a partial copy resumed stays
                    _sweep(plan.destination, leftover)
            if read_only:
                check_nothing_to_write(plan.job, plan.destination, prepared.stale, read_only)
            if plan.delivery is not None and not prepared.stale:
                for lock in locks:  # nothing left to publish: others may read side by side
                    lock.release()
            stats = yield from self._execute(prepared)
            report = self._conclude(listing, prepared, stats, started, waited)
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
        prepared = _Prepared(results=make_dirs(self.plan.destination, listing.dirs))
        if self.plan.delivery is not None:
            self._finish_partial_copies(listing, prepared)
        for entry in listing.files:
            requested, copy_to, note = str(entry.source), entry.copy_to, ""
            if copy_to is not None and self._is_current(copy_to, entry.identity):
                if self.plan.delivery is None:
                    prepared.results.append(FileResult(entry.rel, "skipped", entry.identity.size))
                    continue
                # Read the current local copy instead of the source: nothing to publish.
                local = Identity.of(os.stat(copy_to))
                entry = replace(entry, source=copy_to, identity=local, copy_to=None)
                note = f", from the current local copy {copy_to}"
            self._prepare_entry(entry, prepared, requested, note)
        return prepared

    def _finish_partial_copies(self, listing: Listing, prepared: _Prepared) -> None:
        """A delivering job's files that a killed run left partly copied are finished
        first, as a copy (only what had not landed is read from the source); their
        contents are then read from the local copy, like those of any current copy."""
        partial = [
            e
            for e in listing.files
            if e.copy_to is not None
            and not self._is_current(e.copy_to, e.identity)
            and read_landed(e.copy_to, e.identity) is not None
        ]
        if not partial:
            return
        finish = replace(
            self.plan,
            list_files=lambda: Listing(files=partial),  # the locks are held already
            locks=(),
            leftovers=lambda: [],
            delivery=None,
            finish=None,
            around=None,
        )
        report = run(finish, self.settings)
        prepared.resumed.update(p for e in partial if e.copy_to for p in temps_of(e.copy_to))
        if not report.ok:
            raise TransferFailed(report)

    def _is_current(self, copy_to: Path, identity: Identity) -> bool:
        # Reached as it is written: a copy behind a link in the destination is none.
        return is_current_copy(copy_to, identity, root=self.plan.destination)

    def _prepare_entry(
        self, entry: FileEntry, prepared: _Prepared, requested: str, note: str
    ) -> None:
        """The file's sinks and how it is read; ``io_modes`` says so under the path the
        job was asked to read (``requested``), with ``note`` when another is read."""
        delivery = self.plan.delivery
        cached: float | None = NOT_ASKED
        if self.plan.source_policy is not None and isinstance(entry.source, str):
            policy = self.plan.source_policy  # an object (a current local copy is a file)
        elif delivery is None:
            policy = self._policy(Path(entry.source))
        else:  # whether a file to load is in the page cache is its own
            policy, cached = self.plugins.file_policy(Path(entry.source))
        sinks, resume = self._copy_sinks(entry, prepared)
        mode = f"{'direct' if policy.direct else 'buffered'} ({policy.reason}){note}"
        if delivery is not None:
            sink = delivery.prepare(
                entry,
                policy,
                self.plan.open_source or self.plugins.open_source,
                cached=cached,
                plain=self._plain_sources,
            )
            if sink is None:
                self.io_modes[requested] = f"{delivery.served_as} ({policy.reason}){note}"
                return
            sinks.append(sink)
        self.io_modes[requested] = mode
        outcome: Status = "restored" if entry.copy_to is not None else "loaded"
        task = FileTask(entry.rel, str(entry.source), entry.identity, sinks, policy, outcome)
        task.landed = resume or Landed()
        prepared.tasks.append(task)

    def _copy_sinks(
        self, entry: FileEntry, prepared: _Prepared
    ) -> tuple[list[Sink], Landed | None]:
        """The sinks that publish ``entry``'s copy (none without ``copy_to``), and what a
        killed run already landed of it."""
        if entry.copy_to is None:
            return [], None
        resume = read_landed(entry.copy_to, entry.identity)
        if resume is not None:
            prepared.resumed.update(temps_of(entry.copy_to))
            self.resumed_bytes += resume.nbytes
        file = file_sink(
            entry.copy_to,
            entry.identity,
            self._policy(entry.copy_to),
            fsync=self.settings.fsync,
            mode=entry.mode,
            resume=resume,
            root=self.plan.destination,
        )
        expected = self.plan.expect(entry.rel) if self.plan.expect is not None else None
        if expected is None:
            return [file], resume
        # First: a copy that does not hash right is refused before it is published.
        size = entry.identity.size
        return [DigestSink(entry.rel, size, expected, self._window, file.blocks), file], resume

    def _policy(self, path: Path) -> IOPolicy:
        """One IO-policy decision per folder (a destination folder may not exist yet: its
        policy is decided from the nearest existing parent)."""
        key = str(path.parent)
        if key not in self._policies:
            self._policies[key] = self.plugins.io_policy(path)
        return self._policies[key]

    @property
    def _plain_sources(self) -> bool:
        """Whether the built-in opens every source: a file's bytes are then those of the
        file on its filesystem, and a delivery may read them through a descriptor of
        its own."""
        return self.plan.open_source is None and self.plugins.builtin_alone(
            "loaderplug_open_source"
        )

    # -- the engine ---------------------------------------------------------------------

    def _execute(self, prepared: _Prepared) -> Generator[Any, None, EngineStats]:
        """Run the engine over the prepared files (through the plan's delivery, if it has
        one); returns the engine's stats."""
        engine = None
        if prepared.tasks:
            on_bytes = self._progress.start(sum(t.size for t in prepared.tasks))
            engine, self._sizing = _engine_for(self, prepared.tasks, on_bytes)
        try:
            delivery = self.plan.delivery
            if delivery is None:
                return engine.run(prepared.tasks) if engine else _no_stats(self.settings)
            notify = self.plugins.notify_tensor_ready
            job = self.plan.job
            stats = yield from delivery.deliver(
                (lambda: engine.run(prepared.tasks)) if engine else None,
                self._cancel(engine),
                (lambda rel, name, item: notify(job, rel, name, item))
                if self.plugins.watches_tensors()
                else None,
            )
            prepared.results.extend(delivery.served())
            return stats or _no_stats(self.settings)
        finally:
            self._progress.close()

    def _cancel(self, engine: Engine | None) -> Callable[[], None]:
        """What stops the engine, and the plan's own source's waits with it."""
        cancel_source = getattr(self.plan.open_source, "cancel", None)

        def cancel() -> None:
            if engine is not None:
                engine.cancel()
            if cancel_source is not None:
                cancel_source()

        return cancel

    # -- after the engine ---------------------------------------------------------------

    def _conclude(
        self,
        listing: Listing,
        prepared: _Prepared,
        stats: EngineStats,
        started: float,
        waited: float,
    ) -> TransferReport:
        """Place symlinks, report refusals, tell observers, run the plan's ``finish``."""
        plan = self.plan
        results = prepared.results + stats.results
        failed = {r.path for r in results if r.status == "failed"} | set(listing.refused)
        root = plan.destination
        others = place_symlinks(root, listing.symlinks, failed) if root is not None else []
        others += [
            FileResult(rel, "failed", reason=reason)
            for rel, reason in sorted(listing.refused.items())
        ]
        # The engine told observers of the files it read; these are the rest.
        for result in prepared.results + others:
            self.plugins.notify_file_done(plan.job, result)
        report = TransferReport(
            job=plan.job,
            source=plan.source,
            destination=str(plan.destination or ""),
            # A fixed count is reported as set (fewer readers run for fewer spans); an
            # adaptive one where it ended, with the range it moved in.
            readers=stats.workers if stats.readers_range else self._sizing.workers,
            span_bytes=stats.chunk,
            results=results + others,
            bytes_copied=stats.bytes_copied,
            seconds=time.monotonic() - started,
            retries=stats.retries + (plan.delivery.retries if plan.delivery else 0),
            waited_for_lock_s=waited,
            readers_range=stats.readers_range,
        )
        if plan.finish is not None:
            plan.finish(listing, report)
        return report


class _Observer:
    """The engine's observer: every call goes to the plugins' (guarded) observe hooks;
    a finished file goes to the plan's delivery too."""

    def __init__(self, plugins: Plugins, plan: Plan) -> None:
        self.plugins, self.job, self.delivery = plugins, plan.job, plan.delivery

    def range_done(self, rel: str, offset: int, length: int, retries: int) -> None:
        self.plugins.notify_span_done(self.job, rel, offset, length, retries)

    def file_done(self, result: FileResult) -> None:
        self.plugins.notify_file_done(self.job, result)
        if self.delivery is not None:
            self.delivery.file_done(result)


def _engine_for(
    runner: Runner, tasks: list[FileTask], on_bytes: Callable[[int], None] | None
) -> tuple[Engine, Sizing]:
    """The engine for ``tasks``, sized for them, and its sizing."""
    settings, plan, plugins = runner.settings, runner.plan, runner.plugins
    total = sum(t.size for t in tasks)
    # Whether any source is on a network filesystem: auto splits the budget for many
    # readers there, for few long ranges on a local disk.
    network = any(is_network_type(t.policy.fs_type) for t in tasks)
    objects = any(t.policy.object_store for t in tasks)
    sizing = size_job(settings, total, network=network, requests=objects)
    threshold = settings.split_threshold_bytes
    spans = sum(count_spans(t.size, sizing.chunk, threshold) for t in tasks)
    readers = max(1, min(sizing.workers, spans))
    limit: ConcurrencyLimit = AdaptiveLimit(readers) if sizing.adaptive else FixedLimit(readers)
    engine = Engine(
        open_source=plan.open_source or plugins.open_source,
        limit=limit,
        chunk=sizing.chunk,
        split_threshold=threshold,
        buffers=settings.bytes_in_flight // sizing.chunk,
        retry=RetryPolicy.of(settings),
        observer=_Observer(plugins, plan),
        # A delivery reads file by file, within its memory budget, its first wave in
        # steps so that its first tensors land early; a copy spreads its readers
        # across files.
        order=(
            head_in_steps(file_major, limit.limit * READ_STEP, READ_STEP)
            if plan.delivery is not None
            else offset_major
        ),
        on_bytes=on_bytes,
        name=plan.job,
    )
    return engine, sizing


def _acquire(locks: list[Lock]) -> tuple[float, str]:
    """Take the locks in order: the seconds waited, and why the destination is read-only
    if it cannot take a lock file (nothing may then need writing there)."""
    waited = 0.0
    try:
        for lock in locks:
            waited += lock.acquire()
    except OSError as exc:
        if exc.errno not in READ_ONLY_ERRNOS:
            raise
        return waited, f"{exc.strerror or exc}: {exc.filename}"
    return waited, ""


def _sweep(root: Path | None, leftover: Path) -> None:
    """Remove what a killed run left, reached without following a link in ``root``:
    one found through a link is not this job's (its file fails on its own)."""
    with contextlib.suppress(FileNotFoundError, NotADirectoryError, LinkOnPath):
        unlink_below(guard_root(root, leftover), leftover)


def _no_stats(settings: Settings) -> EngineStats:
    sizing = default_sizing(settings)
    return EngineStats([], 0, 0, sizing.chunk, sizing.workers, None, cancelled=False)
