"""A plan: everything a job is, stated before anything runs.

Every job (hydrate, sync, a selection of files, a load, a one pass) is a planner that
builds a :class:`Plan`; the runner (:mod:`loaderplug.jobs.runner`) executes any plan the same
way. A plan names its destination and lock, how to find the leftovers of a killed run,
and how to list its files, which the runner calls under the lock so that a job that
waited for another sees what that one left. A plan whose files' contents go to a
consumer (a load) names its :class:`Delivery`; the runner knows nothing more of it.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from loaderplug.engine.buffers import Opener
from loaderplug.engine.file_task import EngineStats
from loaderplug.engine.sinks import Sink
from loaderplug.jobs.digest import Expected
from loaderplug.types import FileResult, Identity, IOPolicy

if TYPE_CHECKING:
    from loaderplug.report import TransferReport

# What a copied file must hash to, by its path relative to the destination (None: not
# checked); checked as it is copied, before it is published (see loaderplug.jobs.digest).
Expect = Callable[[str], Expected | None]


@dataclass(frozen=True)
class FileEntry:
    """One file of a job: where its bytes are, what they must be, where a copy goes.

    ``rel`` names the file in the report (its path under the destination, or its name
    for a load). ``source`` is a path, or an object's URL (a ``str``), which only the
    plan's ``open_source`` opens. With ``copy_to`` the file is published there, unless
    the copy there is current already; without it the file is only read. A copy gets
    the source's permission bits (``mode``), within the umask.
    """

    rel: str
    source: Path | str
    identity: Identity
    copy_to: Path | None = None
    mode: int = 0o644

    @staticmethod
    def of(rel: str, source: Path, st: os.stat_result, copy_to: Path | None = None) -> FileEntry:
        """The entry for a file whose ``stat`` is ``st``: its identity and permission
        bits (never setuid, setgid or sticky: a copy must not gain privileges)."""
        return FileEntry(rel, source, Identity.of(st), copy_to, stat.S_IMODE(st.st_mode) & 0o777)


@dataclass
class Listing:
    """What a job's source holds: files, relative symlinks to place, folders to create
    (all relative to the destination), and the paths refused, with why."""

    files: list[FileEntry] = field(default_factory=list)
    symlinks: dict[str, str] = field(default_factory=dict)
    dirs: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)


class Delivery(Protocol):
    """How a job hands its files' contents to a consumer as they land (a load hands
    tensors). The runner asks it about each file it reads, then lets it run the engine:
    the delivery yields to the consumer meanwhile."""

    # How the job's report of IO modes names a file the delivery serves itself.
    served_as: str
    # Transient errors the delivery retried while preparing files.
    retries: int

    def prepare(
        self,
        entry: FileEntry,
        policy: IOPolicy,
        open_source: Opener,
        *,
        cached: float | None = ...,
        plain: bool = False,
    ) -> Sink | None:
        """The sink that takes ``entry``'s bytes for the consumer; None: the delivery
        serves the file itself (it is in memory already), and the engine does not read
        it. ``cached``: the share of the file in the page cache, where the policy asked
        (see :func:`loaderplug.storage.io_policy.decided`); ``plain``: no plugin opens
        sources, so the file's bytes are those of the file itself."""
        ...

    def deliver(
        self,
        run_engine: Callable[[], EngineStats] | None,
        cancel: Callable[[], None],
        notify: Callable[[str, str, Any], None] | None,
    ) -> Generator[Any, None, EngineStats | None]:
        """Run the engine (None: nothing for it to read) while handing over what lands,
        ``notify`` (None: nobody) hearing of each item handed over; returns the engine's
        stats."""
        ...

    def file_done(self, result: FileResult) -> None:
        """On an engine thread: a file the engine read is done."""
        ...

    def served(self) -> list[FileResult]:
        """The results of the files the delivery served itself, once delivered."""
        ...


@dataclass(frozen=True)
class Plan:
    """A job for the runner.

    ``destination`` is where folders and symlinks are made (None: the job writes no
    tree). ``locks`` are the lock files held while the job publishes, in order (none:
    nothing is published; see :mod:`loaderplug.jobs.locks`).
    ``leftovers`` lists the temp files a killed run of this job may have left; they are
    removed once the lock is held. ``finish`` runs under the lock once every file is
    done (a sync writes its manifest there). ``around`` makes a context the whole job
    runs in, once the locks are held (a sync's mark on the mirror). ``delivery`` hands
    the files' contents over as they land (a load). ``open_source`` replaces the
    plugins' sources for the job's reads.
    """

    job: str
    source: str
    destination: Path | None
    list_files: Callable[[], Listing]
    locks: tuple[Path, ...] = ()
    leftovers: Callable[[], list[Path]] = lambda: []
    expect: Expect | None = None
    delivery: Delivery | None = None
    finish: Callable[[Listing, TransferReport], None] | None = None
    around: Callable[[], AbstractContextManager[Any]] | None = None
    # The engine reads the files' bytes through this instead of the plugins' sources
    # (a load split across hosts: the exchange answers its reads; objects in a store);
    # with a ``cancel()``, called when the engine is cancelled, so that no read waits on
    # after it.
    open_source: Opener | None = None
    # How every source is read where no filesystem decides it (objects in a store).
    source_policy: IOPolicy | None = None
