"""What a sink is: where the engine lands a file's bytes.

A sink receives the ranges of one file in any order, from any worker thread, then is
either committed (every range landed and the source held still) or aborted. Some sinks
take on more: memory the engine reads straight into (:class:`PlacingSink`), a memory
budget a span waits for (:class:`BudgetedSink`), a journal of durable spans
(:class:`JournalingSink`). A file's sinks' roles are stated once, when its task is made
(:class:`SinkRoles`), not looked up per span.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


class Sink(Protocol):
    def prepare(self) -> None:
        """Called once, before the first write."""

    def write(self, data: memoryview, offset: int) -> None:
        """Store ``data`` at ``offset``. Thread-safe; ranges arrive in any order."""

    def commit(self) -> None:
        """Every byte landed: make the result visible."""

    def abort(self) -> None:
        """Drop everything written. Idempotent; safe before ``prepare``."""


@runtime_checkable
class PlacingSink(Sink, Protocol):
    """A sink with memory of its own: the engine reads ranges straight into it."""

    def place(self, offset: int, length: int, cancel: threading.Event) -> memoryview:
        """Writable, page-aligned-at-aligned-offsets memory for ``[offset, offset+length)``;
        a later ``write`` of that very memory only records that it landed. May wait for
        memory to come free (raising :class:`~loaderplug.engine.retry.Cancelled` once
        ``cancel`` is set, or once the sink was aborted)."""
        ...

    def placed_read_done(self, offset: int) -> None:
        """The reader of the memory placed at ``offset`` is done with it: every step read
        was handed to the writers, or the read was given up. The sink may reuse memory
        once its reader is done and what was read of it has been written (or the sink
        aborted): never while a ``pread`` may still be filling it."""
        ...


@runtime_checkable
class BudgetedSink(Sink, Protocol):
    """A sink that holds what it receives in a memory budget: a span is admitted to it
    before it is read, and may wait there (see :mod:`loaderplug.tensors.memory.budget`)."""

    def admit(self, offset: int, length: int, cancel: threading.Event) -> None: ...


@runtime_checkable
class JournalingSink(Sink, Protocol):
    """A sink that records each span once it is durable, so a killed run can resume."""

    def span_landed(self, offset: int, length: int) -> None: ...


@dataclass(frozen=True)
class SinkRoles:
    """What a file's sinks do besides taking bytes, found once per file."""

    placer: PlacingSink | None = None
    budgeted: tuple[BudgetedSink, ...] = ()
    journals: tuple[JournalingSink, ...] = ()

    @staticmethod
    def of(sinks: list[Sink]) -> SinkRoles:
        return SinkRoles(
            placer=next((s for s in sinks if isinstance(s, PlacingSink)), None),
            budgeted=tuple(s for s in sinks if isinstance(s, BudgetedSink)),
            journals=tuple(s for s in sinks if isinstance(s, JournalingSink)),
        )
