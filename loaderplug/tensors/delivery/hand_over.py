"""The consumer's side of a load: the events a load hands over, :class:`HandOver`, which
serves them, and the consumer's iterators over them (:class:`ReadyOf`, :class:`TensorsOf`).

How each file is served (mapped, read whole into memory of the load's own, or by the
engine) is :mod:`loaderplug.tensors.delivery.choice`'s; the files it serves in the
consumer's thread come here (each a :class:`HereFile`), the engine's tensors through the
delivery's queue.

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
from types import TracebackType
from typing import Any, Protocol

from loaderplug.engine.file_task import EngineStats
from loaderplug.engine.sizing import Sizing
from loaderplug.errors import LoaderplugError
from loaderplug.tensors.format.header import Header
from loaderplug.types import FileResult


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


class Serving(Protocol):
    """What :class:`HandOver` reads and fills of the load's delivery
    (:class:`loaderplug.tensors.delivery.choice.TensorDelivery`)."""

    served_here: list[HereFile]
    results: list[FileResult]
    ready: queue.SimpleQueue[Event | BaseException | None]
    interrupted: BaseException | None
    idle_after_s: float | None
    first_tensor_s: float | None
    started: float | None
    bytes_read_here: int
    sizing: Sizing

    def taken(self, event: TensorReady) -> None: ...


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
        delivery: Serving,
        run_engine: Callable[[], EngineStats] | None,
        cancel: Callable[[], None],
        notify: Callable[[str, str, Any], None] | None,
    ) -> None:
        self._delivery = delivery
        self._run_engine, self._cancel, self._notify = run_engine, cancel, notify
        self._here = iter(delivery.served_here)
        self._file: tuple[HereFile, Iterator[tuple[str, Any]]] | None = None
        self._worker: threading.Thread | None = None
        self._outcome: dict[str, Any] = {}
        self._done = False

    def send(self, value: None) -> Event:
        return self.__next__()

    def __next__(self) -> Event:
        # Here, not through send as Generator's own __next__ would: one call less for
        # each tensor.
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
        if self._notify is not None:
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
