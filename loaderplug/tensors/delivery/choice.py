"""Which way a load serves each file: the :class:`~loaderplug.jobs.plan.Delivery` of a
load.

For each file the runner plans, :class:`TensorDelivery` reads its header (two small
reads, retried like any read) and gives the runner a tensor sink for it, or serves it
itself in the consumer's thread. A file in memory already (tmpfs, or mostly in the page
cache) that stays put while the load lives is handed over as tensors over a mapping of
it, as safetensors does: loaderplug's own published local copies, and with
``LOADERPLUG_OWNED=auto`` a user's file on a local filesystem
(:mod:`loaderplug.tensors.delivery.map_rule` says which, and why). A file that can change under
the load (a network or FUSE volume, the mirror) is never mapped unless
``LOADERPLUG_OWNED=map``: a tensor over a mapping of a file someone shrinks kills the
process that touches it (SIGBUS; docs/guarantees.md). A small file, or one in memory
that is not mapped, is read into memory of the load's own by the process's readers
(:mod:`loaderplug.tensors.delivery.owned_reads`), with no engine. A file to map whose
bytes no plugin serves is opened once: its header is read from the descriptor it is
then mapped through. The consumer's side, the tensors handed over as they complete, is
:mod:`loaderplug.tensors.delivery.hand_over`'s.
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loaderplug.engine.buffers import Opener
from loaderplug.engine.file_task import EngineStats
from loaderplug.engine.retry import RetryPolicy, retrying
from loaderplug.engine.sinks import Sink
from loaderplug.engine.sizing import default_sizing
from loaderplug.errors import FileError
from loaderplug.jobs.partial import partial_for
from loaderplug.jobs.plan import FileEntry
from loaderplug.settings import Settings
from loaderplug.storage.held import HeldFile
from loaderplug.storage.mounts import MEMORY_TYPES
from loaderplug.storage.residency import NOT_ASKED, WARM_FRACTION, cached_fraction
from loaderplug.storage.state_files import open_regular
from loaderplug.tensors.delivery.hand_over import (
    Event,
    FileFinished,
    HandOver,
    HereFile,
    TensorReady,
)
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
from loaderplug.tensors.format.read import header_of_fd, read_header
from loaderplug.tensors.format.torch_dtypes import TorchLayout, torch_layout
from loaderplug.tensors.memory.budget import MemoryBudget, device_limit
from loaderplug.types import FileResult, Identity, IOPolicy
from loaderplug.units import MiB


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

    def prepare(
        self,
        entry: FileEntry,
        policy: IOPolicy,
        open_source: Opener,
        *,
        cached: float | None = NOT_ASKED,
        plain: bool = False,
    ) -> Sink | None:
        if self.started is None:
            self.started = time.monotonic()
        # An object in a store is no file to map or to read whole: the engine reads it.
        here = (
            entry.copy_to is None and not policy.object_store and (self.may_map or self.serves_here)
        )
        # None is (a load to a device with a backend): its page cache is not measured.
        in_memory = here and self._in_memory(policy, Path(entry.source), cached)
        why = (
            self.map_rule.why_mapped(Path(entry.source), policy, in_memory)
            if here and self.may_map
            else None
        )
        held: HeldFile | None = None
        if why is not None and plain:
            header, held = self._held_header(entry, policy)
            seen = held.identity
        else:
            header, seen = self._read_header(entry, policy, open_source)
        try:
            # A dtype or shape this torch cannot hold fails the load as a bad file, at
            # once, whichever sink would have met it.
            layout = torch_layout(header)
            if why is not None and held is None:
                # Held from now on: a file renamed over this name before the consumer
                # comes to it leaves the load the version whose header it read.
                held = HeldFile.open(str(entry.source), seen, stable_inodes=policy.stable_inodes)
        except BaseException:
            if held is not None:
                held.close()
            raise
        self.headers[entry.rel] = header
        if held is not None and why is not None:
            self._serve_mapped(entry, header, held, layout, in_memory, why)
            return None
        if here and self._serve_read(entry, policy, header, in_memory, open_source):
            return None
        return self._sink(entry, policy, header, seen)

    def _sink(self, entry: FileEntry, policy: IOPolicy, header: Header, seen: Identity) -> Sink:
        """The sink the engine lands the file's bytes in."""
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

    def _serve_mapped(
        self,
        entry: FileEntry,
        header: Header,
        held: HeldFile,
        layout: TorchLayout,
        in_memory: bool,
        why: str,
    ) -> None:
        """Serve the file in the consumer's thread as tensors over a mapping of ``held``
        (the file its header was read from, held open from now on), as the load's rule
        says (``why``)."""
        self.served_as = f"mapped, {why}"
        path, size = str(entry.source), entry.identity.size

        def mapped() -> MappedTensors:
            # A cold file's pages are asked for once the consumer comes to it, not at
            # planning: the page cache holds the files being used, not the model.
            if not in_memory:
                prefetch(path, size)
            return MappedTensors(header, held, layout)

        self.served_here.append(HereFile(entry.rel, header, "mapped", mapped, held.close))

    def _serve_read(
        self,
        entry: FileEntry,
        policy: IOPolicy,
        header: Header,
        in_memory: bool,
        open_source: Opener,
    ) -> bool:
        """Read the file into memory of the load's own without the engine if it is small
        or in memory already; :attr:`served_as` says how."""
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
        if shares_page_cache(policy) and self.map_rule.is_own_copy(Path(entry.source)):
            return str(entry.source)
        return None

    def _in_memory(self, policy: IOPolicy, path: Path, cached: float | None) -> bool:
        """Whether the file's bytes are in memory already (tmpfs, or a local file mostly
        in the page cache): they are then read, or mapped, faster than the engine's
        threads hand them over. A file that is not is read by the engine, or mapped
        with its pages asked for ahead (see :mod:`loaderplug.tensors.delivery.map_rule`).
        ``cached``: the share of it in the page cache, where the policy asked already."""
        if not shares_page_cache(policy):
            return False
        if policy.fs_type in MEMORY_TYPES:
            return True
        if cached == NOT_ASKED:
            cached = cached_fraction(str(path))
        return cached is not None and cached >= WARM_FRACTION

    def _held_header(self, entry: FileEntry, policy: IOPolicy) -> tuple[Header, HeldFile]:
        """The header of a file to map that no plugin serves, read from the descriptor
        it is then mapped through, retried like any read: the tensors are cut from the
        very file the header was read from. A file that changed since it was listed, or
        while its header was read, fails here as in :meth:`_read_header`."""
        path = str(entry.source)
        inode = policy.stable_inodes

        def read() -> tuple[Header, HeldFile]:
            # A regular file only, and without blocking: a source swapped for a FIFO or a
            # device since it was listed fails here instead of hanging the load.
            fd = open_regular(path, os.O_RDONLY, follow=True)
            try:
                now = Identity.of(os.fstat(fd))
                if not now.matches(entry.identity, inode=inode):
                    raise FileError(
                        f"{path}: changed since it was listed (now {now.describe()})", path=path
                    )
                header = header_of_fd(path, fd, now.size)
                if not Identity.of(os.fstat(fd)).matches(now, inode=inode):
                    raise FileError(f"{path}: changed while its header was read", path=path)
            except BaseException:
                os.close(fd)
                raise
            return header, HeldFile(path, fd, now, stable_inodes=inode)

        (header, held), retries = retrying(read, self.retry, gives_up(path, "reading the header"))
        self.retries += retries
        return header, held

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
        notify: Callable[[str, str, Any], None] | None,
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
