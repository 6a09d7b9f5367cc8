"""A file of a job as the engine sees it, and what one run of the engine did.

A :class:`FileTask` is where a file's bytes come from, what the file must look like
(its identity, checked after every read step), the sinks its bytes go to and the ranges
a killed run already landed. Its state (begun, spans left, its result) is changed under
its own lock by whichever reader or writer gets there first.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from loaderplug.engine.retry import Cancelled
from loaderplug.engine.sinks import Sink, SinkRoles
from loaderplug.engine.spans import Landed, Span
from loaderplug.errors import FileError
from loaderplug.types import FileResult, Identity, IOPolicy, Status


@dataclass(frozen=True)
class EngineStats:
    """What one run did: a result per finished file, bytes landed, retries, and the
    concurrency it ended at (with an adaptive limit, the range it moved in)."""

    results: list[FileResult]
    bytes_copied: int
    retries: int
    chunk: int
    workers: int
    readers_range: tuple[int, int] | None
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
    # What its sinks do besides taking bytes: found once, here, not per span.
    roles: SinkRoles = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.roles = SinkRoles.of(self.sinks)

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
            err = exc if isinstance(exc, FileError) else None
            os_errno = err.errno if err else getattr(exc, "errno", None)
            rng = err.range if err else ((span.offset, span.length) if span else None)
            self.result = FileResult(
                self.rel, "failed", self.size, str(exc), errno=os_errno, range=rng
            )
            self._done = True
        # A failure that leaves what landed good (the load's source stopped answering,
        # not a bad byte) keeps a partial copy and its journal for a rerun to resume.
        keep = getattr(exc, "resumable", False)
        for sink in self.sinks:
            leave = getattr(sink, "leave", None)
            if keep and leave is not None:
                leave()
            else:
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
        raise FileError(
            f"source changed while being copied (was {task.identity.describe()}, "
            f"now {now.describe()}); run again once the mirror holds still",
            path=task.src,
        )


@dataclass
class SpanProgress:
    """One span on its way: pieces read but not yet written, and the retries it took.
    Shared by the span's pieces; changed under the engine's lock."""

    pieces_left: int
    retries: int = 0
