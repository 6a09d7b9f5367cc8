"""How a load hands its tensors over: the :class:`~loaderplug.jobs.plan.Delivery` of a
load, and the consumer's side of it.

For each file the runner plans, :class:`TensorDelivery` reads its header (two small
reads, retried like any read) and gives the runner a tensor sink for it, or serves it
itself in the consumer's thread. A file in memory already (tmpfs, or mostly in the page
cache) that stays put while the load lives is handed over as tensors over a mapping of
it, as safetensors does: loaderplug's own published local copies, and with
``LOADERPLUG_OWNED=auto`` a user's file on a local filesystem
(:mod:`loaderplug.tensors.delivery.map_rule` says which, and why). A file that can change under
the load (a network or FUSE volume, the mirror) is never mapped unless
``LOADERPLUG_OWNED=off``: a tensor over a mapping of a file someone shrinks kills the
process that touches it (SIGBUS; docs/guarantees.md). A small file, or one in memory
that is not mapped, is read into memory of the load's own by the process's readers
(:mod:`loaderplug.tensors.delivery.owned_reads`), with no engine. While the engine runs on a
thread of its own, :class:`HandOver` gives the consumer each tensor the moment a sink
emits it, then tells of each file once it is done.

The hand-over is made of iterator objects, not generator functions: a suspended
generator keeps its locals, and a tensor the consumer has dropped must be freed then,
not when the next one comes (the memory budget counts on it). Nothing between the sink
and the consumer keeps a reference to a tensor handed over.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any

from loaderplug.engine.buffers import Opener
from loaderplug.engine.file_task import EngineStats
from loaderplug.engine.retry import RetryPolicy, retrying
from loaderplug.engine.sinks import Sink
from loaderplug.engine.sizing import default_sizing
from loaderplug.errors import FileError, LoaderplugError
from loaderplug.jobs.partial import partial_for
from loaderplug.jobs.plan import FileEntry
from loaderplug.settings import Settings
from loaderplug.storage.held import HeldFile
from loaderplug.storage.mounts import MEMORY_TYPES
from loaderplug.storage.residency import WARM_FRACTION, cached_fraction
from loaderplug.tensors.delivery.map_rule import MapRule, shares_page_cache
from loaderplug.tensors.delivery.owned_reads import STEP, FileReads, ReadTensors, gives_up
from loaderplug.tensors.delivery.read_threads import prefetch
from loaderplug.tensors.delivery.tensor_sinks import (
    MappedTensors,
    PageCacheTensorSink,
    TensorSink,
)
from loaderplug.tensors.device.path import DevicePath
from loaderplug.tensors.device.sink import DeviceTensorSink
from loaderplug.tensors.format.header import Header
from loaderplug.tensors.format.read import read_header
from loaderplug.tensors.format.torch_dtypes import torch_dtypes
from loaderplug.tensors.memory.budget import MemoryBudget, device_limit
from loaderplug.types import FileResult, Identity, IOPolicy
from loaderplug.units import MiB


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


@dataclass(frozen=True)
class Idle:
    """Nothing landed within the delivery's ``idle_after_s``: the consumer may do other
    work and ask again (a rank streaming a shared load steps on without a tensor of its
    own, so the others' reach it)."""


Event = TensorReady | FileFinished | Idle


@dataclass(frozen=True)
class HereFile:
    """A file the delivery serves in the consumer's thread: ``status`` ``mapped`` (an
    own local copy in memory) or ``loaded`` (read there); ``tensors`` starts serving
    it."""

    rel: str
    header: Header
    status: str
    tensors: Callable[[], Iterator[tuple[str, Any]]]
    # Lets go of what the file holds (its descriptor) if it is never served.
    release: Callable[[], None] = lambda: None


class TensorDelivery:
    """A load's delivery (see :class:`loaderplug.jobs.plan.Delivery`). ``map_rule``:
    which files in memory it maps (see :mod:`loaderplug.tensors.delivery.map_rule`)."""

    served_as = "mapped"

    def __init__(
        self,
        device: DevicePath,
        settings: Settings,
        *,
        may_map: bool = True,
        through_page_cache: bool = False,
        map_rule: MapRule = MapRule(),  # noqa: B008 - frozen, so a shared default is safe
    ) -> None:
        self.device = device
        self.retry = RetryPolicy.of(settings)
        self.retries = 0
        self.sizing = default_sizing(settings)  # what a load with no engine reports
        # Host memory for tensors being assembled or not yet taken by the consumer; a
        # load with a device backend holds pinned buffers instead, as many bytes at most,
        # and device memory for tensors not yet taken within a budget of its own.
        self.budget = MemoryBudget(settings.bytes_in_flight)
        self.device_budget = MemoryBudget(device_limit(settings))
        self.staged = device.backend is not None
        self.may_map = may_map and device.on_host
        self.serves_here = may_map and not self.staged
        # A file smaller than this is read without the engine, whatever its cache.
        self.small_file = min(settings.split_threshold_bytes, SMALL_FILE)
        self.map_rule = map_rule
        # Ranks sharing a host's page cache: files are read into it (or, in a one pass,
        # written to the copy through it) and handed over as mappings of it (see
        # PageCacheTensorSink), outside the budget.
        self.through_page_cache = through_page_cache and self.may_map
        self._in_page_cache: set[str] = set()  # files handed over so, by name in the job
        self.served_here: list[HereFile] = []
        self.headers: dict[str, Header] = {}  # every file's, by its name in the job
        self.results: list[FileResult] = []
        self.bytes_read_here = 0
        self.first_tensor_s: float | None = None
        self.started: float | None = None
        # Events from the engine's threads for the consumer's; None: the engine is done;
        # an exception: raise it (see interrupt).
        self.ready: queue.SimpleQueue[Event | BaseException | None] = queue.SimpleQueue()
        self.interrupted: BaseException | None = None
        # How long the consumer waits for the next event before it is handed Idle
        # (None: as long as it takes).
        self.idle_after_s: float | None = None

    # -- planning (the runner's thread) -------------------------------------------------

    def prepare(self, entry: FileEntry, policy: IOPolicy, open_source: Opener) -> Sink | None:
        if self.started is None:
            self.started = time.monotonic()
        header, seen = self._read_header(entry, policy, open_source)
        # A dtype or shape this torch cannot hold fails the load as a bad file, at once,
        # whichever sink would have met it.
        torch_dtypes(header)
        self.headers[entry.rel] = header
        if entry.copy_to is None and self._serve_here(entry, policy, header, seen, open_source):
            return None
        rel = entry.rel

        def emit(name: str, tensor: Any) -> None:
            self.ready.put(TensorReady(rel, name, tensor))

        if self.staged:
            return DeviceTensorSink(
                header, self.device, emit, self.budget.limit, self.device_budget
            )
        pages = self._shared_pages(entry, policy)
        if pages is not None:
            self._in_page_cache.add(rel)
            # A file read in place is mapped as the header saw it; the copy a one pass
            # writes is the load's own.
            read_in_place = entry.copy_to is None
            held = (
                HeldFile.open(pages, seen, stable_inodes=policy.stable_inodes)
                if read_in_place
                else None
            )
            return PageCacheTensorSink(header, emit, pages, held)
        return TensorSink(header, self.device, emit, self.budget)

    def _serve_here(
        self,
        entry: FileEntry,
        policy: IOPolicy,
        header: Header,
        seen: Identity,
        open_source: Opener,
    ) -> bool:
        """Serve the file in the consumer's thread: mapped where the load's rule says
        (the file ``seen`` as its header was read, held open from now on), else read
        without the engine if it is small or in memory already; :attr:`served_as` says
        how."""
        if not (self.may_map or self.serves_here):
            # None is (a load to a device with a backend): its page cache is not measured.
            return False
        in_memory = self._in_memory(policy, entry.source)
        why = self.map_rule.why_mapped(entry.source, policy, in_memory) if self.may_map else None
        if why is not None:
            self.served_as = f"mapped, {why}"
            path, size = str(entry.source), entry.identity.size
            # Held from now on: a file renamed over this name before the consumer comes
            # to it leaves the load the version whose header it read.
            held = HeldFile.open(path, seen, stable_inodes=policy.stable_inodes)

            def mapped() -> MappedTensors:
                # A cold file's pages are asked for once the consumer comes to it, not
                # at planning: the page cache holds the files being used, not the model.
                if not in_memory:
                    prefetch(path, size)
                return MappedTensors(header, held)

            self.served_here.append(HereFile(entry.rel, header, "mapped", mapped, held.close))
            return True
        if not self.serves_here or not (in_memory or entry.identity.size < self.small_file):
            return False
        reads = FileReads(entry, policy, open_source, self.retry)
        self.served_as = (
            "read in the consumer's thread"
            if header.size <= STEP
            else "read by the process's readers"
        )

        def tensors() -> ReadTensors:
            return ReadTensors(
                header,
                self.device,
                reads,
                ahead=self.budget.limit,
                on_close=lambda: self._count(reads),
            )

        self.served_here.append(HereFile(entry.rel, header, "loaded", tensors))
        return True

    def _count(self, reads: FileReads) -> None:
        """A file read without the engine is done: its reads count in the load's."""
        self.retries += reads.retries
        self.bytes_read_here += reads.bytes_read

    def _shared_pages(self, entry: FileEntry, policy: IOPolicy) -> str | None:
        """With :attr:`through_page_cache`, the file whose page cache the tensors are to
        be views of: the copy a one pass writes (its folder is on a local filesystem:
        the load's planner checked), or an own local copy read in place if it is read
        buffered from a local filesystem; else None (any other file may shrink under
        its mapping)."""
        if not self.through_page_cache:
            return None
        if entry.copy_to is not None:
            return str(partial_for(entry.copy_to))
        if shares_page_cache(policy) and self.map_rule.is_own_copy(entry.source):
            return str(entry.source)
        return None

    def _in_memory(self, policy: IOPolicy, path: Path) -> bool:
        """Whether the file's bytes are in memory already (tmpfs, or a local file mostly
        in the page cache): they are then read, or mapped, faster than the engine's
        threads hand them over. A file that is not is read by the engine, or mapped
        with its pages asked for ahead (see :mod:`loaderplug.tensors.delivery.map_rule`)."""
        if not shares_page_cache(policy):
            return False
        if policy.fs_type in MEMORY_TYPES:
            return True
        cached = cached_fraction(str(path))
        return cached is not None and cached >= WARM_FRACTION

    def _read_header(
        self, entry: FileEntry, policy: IOPolicy, open_source: Opener
    ) -> tuple[Header, Identity]:
        """The file's header, retried like any read, and the file's identity as it was
        read; a file that changed since it was listed, or while its header was read,
        fails here."""
        path = str(entry.source)

        def read() -> tuple[Header, Identity]:
            source = open_source(path, policy)
            try:
                now = source.identity()
                if not now.matches(entry.identity, inode=policy.stable_inodes):
                    raise FileError(
                        f"{path}: changed since it was listed (now {now.describe()})", path=path
                    )
                header = read_header(source, path)
                if not source.identity().matches(now, inode=policy.stable_inodes):
                    raise FileError(f"{path}: changed while its header was read", path=path)
                return header, now
            finally:
                source.close()

        (header, seen), retries = retrying(read, self.retry, gives_up(path, "reading the header"))
        self.retries += retries
        return header, seen

    # -- running ------------------------------------------------------------------------

    def deliver(
        self,
        run_engine: Callable[[], EngineStats] | None,
        cancel: Callable[[], None],
        notify: Callable[[str, str, Any], None],
    ) -> HandOver:
        return HandOver(self, run_engine, cancel, notify)

    def file_done(self, result: FileResult) -> None:
        # The consumer hears of a file after the tensors it emitted.
        self.ready.put(FileFinished(result))

    def served(self) -> list[FileResult]:
        return list(self.results)

    def interrupt(self, exc: BaseException) -> None:
        """From any thread: stop the load, raising ``exc`` to its consumer where it waits
        for the next tensor, or as soon as it asks for one (before any it has not taken
        yet). Ranks sharing a load call it when one of them dies."""
        self.interrupted = exc
        self.ready.put(exc)

    def has_waiting(self) -> bool:
        """Whether an event waits for the consumer: taking the next would not block."""
        return not self.ready.empty()

    def taken(self, event: TensorReady) -> None:
        """The consumer received ``event``'s tensor, one a sink emitted: it leaves the
        budget it was held in (the host's, or the device's) once its consumer has it."""
        if event.rel not in self._in_page_cache:
            budget = self.device_budget if self.staged else self.budget
            budget.release(event.tensor.untyped_storage().nbytes())


# Files under this size are read without the engine (see TensorDelivery), unless the
# split threshold is smaller: starting the engine's threads and handing its tensors back
# costs more than the read.
SMALL_FILE = 8 * MiB


class HandOver(Generator[Event, None, "EngineStats | None"]):
    """The consumer's side of a load: the tensors of the files served in its own thread
    first, then the engine's, each as it completes, and each file once it is done. Its
    return value (through ``yield from``) is the engine's stats, with the bytes read in
    the consumer's thread counted in.

    Closing it (the consumer stopped early) or an error cancels the engine and waits for
    its threads, so every unfinished file's sinks are aborted before it returns, and
    drops the tensors the consumer did not take."""

    def __init__(
        self,
        delivery: TensorDelivery,
        run_engine: Callable[[], EngineStats] | None,
        cancel: Callable[[], None],
        notify: Callable[[str, str, Any], None],
    ) -> None:
        self._delivery = delivery
        self._run_engine, self._cancel, self._notify = run_engine, cancel, notify
        self._here = iter(delivery.served_here)
        self._file: tuple[HereFile, Iterator[tuple[str, Any]]] | None = None
        self._worker: threading.Thread | None = None
        self._outcome: dict[str, Any] = {}
        self._done = False

    def send(self, value: None) -> Event:
        if self._done:
            raise StopIteration
        try:
            return self._next_mapped() or self._next_from_engine()
        except StopIteration:
            self._done = True
            raise
        except BaseException:
            self._stop()
            raise

    def throw(
        self,
        typ: Any,
        val: Any = None,
        tb: TracebackType | None = None,
    ) -> Event:
        self._stop()
        raise val if val is not None else typ

    def close(self) -> None:
        self._stop()

    def _next_mapped(self) -> Event | None:
        """The next event of the files served here, None once they are all handed over.
        A file that fails there is told as failed, like one the engine read."""
        while True:
            if self._file is None:
                here = next(self._here, None)
                if here is None:
                    return None
                try:
                    self._file = (here, here.tensors())
                except (LoaderplugError, OSError) as exc:  # its mapping or memory
                    here.release()
                    return self._finished(FileResult(here.rel, "failed", reason=str(exc)))
            here, tensors = self._file
            try:
                item = next(tensors, None)
            except (LoaderplugError, OSError) as exc:
                self._close_file()
                return self._finished(FileResult(here.rel, "failed", reason=str(exc)))
            if item is not None:
                return self._handed(TensorReady(here.rel, *item))
            self._file = None
            return self._finished(FileResult(here.rel, here.status, here.header.size))  # type: ignore[arg-type]

    def _finished(self, result: FileResult) -> FileFinished:
        self._delivery.results.append(result)
        return FileFinished(result)

    def _close_file(self) -> None:
        """Stop serving the file being served here: its unserved memory goes back."""
        file, self._file = self._file, None
        close = getattr(file[1], "close", None) if file is not None else None
        if close is not None:
            close()

    def _next_from_engine(self) -> Event:
        if self._run_engine is None:
            raise StopIteration(self._counted(None))
        if self._worker is None:
            self._start()
        delivery = self._delivery
        if delivery.interrupted is not None:
            raise delivery.interrupted
        try:
            event = delivery.ready.get(timeout=delivery.idle_after_s)
        except queue.Empty:
            return Idle()
        if isinstance(event, BaseException):
            raise event
        if event is None:
            self._stop()
            if "error" in self._outcome:
                raise self._outcome["error"]
            raise StopIteration(self._counted(self._outcome["stats"]))
        if isinstance(event, TensorReady):
            delivery.taken(event)
            return self._handed(event)
        return event

    def _counted(self, stats: EngineStats | None) -> EngineStats | None:
        """The engine's stats with the bytes read in the consumer's thread added."""
        read_here = self._delivery.bytes_read_here
        if not read_here:
            return stats
        if stats is None:
            sizing = self._delivery.sizing
            return EngineStats(
                [], read_here, 0, sizing.chunk, sizing.workers, None, cancelled=False
            )
        return replace(stats, bytes_copied=stats.bytes_copied + read_here)

    def _handed(self, event: TensorReady) -> TensorReady:
        delivery = self._delivery
        if delivery.first_tensor_s is None:
            delivery.first_tensor_s = time.monotonic() - (delivery.started or time.monotonic())
        self._notify(event.rel, event.name, event.tensor)
        return event

    def _start(self) -> None:
        run_engine = self._run_engine
        assert run_engine is not None

        def run() -> None:
            try:
                self._outcome["stats"] = run_engine()
            except BaseException as exc:
                self._outcome["error"] = exc
            finally:
                self._delivery.ready.put(None)

        self._worker = threading.Thread(target=run, name="loaderplug-load", daemon=True)
        self._worker.start()

    def _stop(self) -> None:
        """Cancel the engine if it still runs (the consumer stopped early, or an error)
        and wait for it; close the file being served here."""
        self._done = True
        self._close_file()
        for here in self._here:  # never reached: their files go now
            here.release()
        worker = self._worker
        if worker is None:
            return
        if worker.is_alive():
            self._cancel()
        while worker.is_alive():
            worker.join(0.1)  # timed: the consumer's thread stays able to take Ctrl-C
        self._drop_untaken()

    def _drop_untaken(self) -> None:
        """The tensors emitted but never taken go now, not when the load object dies:
        their memory (on the device, for a load to one) is freed at once."""
        while True:
            try:
                self._delivery.ready.get_nowait()
            except queue.Empty:
                return


class ReadyOf(Iterator[TensorReady]):
    """The :class:`TensorReady` events among a load's events (each names its file).

    With ``pause_at_files`` an iteration ends at each file finished (:attr:`finished`
    tells which) and the next one resumes after it; :attr:`done` is set once the events
    are exhausted. Without, finished files are passed over and a failed one raises
    :class:`~loaderplug.errors.LoaderplugError`.
    """

    def __init__(self, events: Iterator[Any], *, pause_at_files: bool = False) -> None:
        self._events = events
        self._pause = pause_at_files
        self.finished: FileResult | None = None
        self.done = False

    def __next__(self) -> TensorReady:
        self.finished = None
        for event in self._events:
            if isinstance(event, TensorReady):
                return event
            if self._pause:
                self.finished = event.result
                raise StopIteration
            raise_if_failed(event)
        self.done = True
        raise StopIteration


def raise_if_failed(event: FileFinished) -> None:
    """A file that failed ends the consumer's iteration with its error."""
    if event.result.status == "failed":
        raise LoaderplugError(f"{event.result.path}: {event.result.reason}")


class TensorsOf(Iterator[tuple[str, Any]]):
    """The ``(name, tensor)`` pairs among a load's events, as :class:`ReadyOf` finds
    them (``pause_at_files``, :attr:`finished` and :attr:`done` as there)."""

    def __init__(self, events: Iterator[Any], *, pause_at_files: bool = False) -> None:
        self._ready = ReadyOf(events, pause_at_files=pause_at_files)

    @property
    def finished(self) -> FileResult | None:
        return self._ready.finished

    @property
    def done(self) -> bool:
        return self._ready.done

    @done.setter
    def done(self, value: bool) -> None:
        self._ready.done = value

    def __next__(self) -> tuple[str, Any]:
        event = next(self._ready)
        return event.name, event.tensor
