"""``loaderplug bench PATH``: measure the user's storage and say which setting to use.

The best hydrate setting depends on the storage: a network volume wants a few large
ranges per stream, an object-store mount more streams, and a busy host answers too
many bytes in flight with ENOMEM. A short sweep finds out:

* Every setting (readers x span size, within a bytes-in-flight cap) reads the files
  under PATH for an equal slice of the time budget, with ``pread`` under the same IO
  policy a hydrate uses, and its throughput is what it read over that time.
* Each trial reads bytes no earlier trial read, so a page cache (local or a network
  client's) cannot flatter a later setting; when PATH is smaller than the sweep, its
  files are dropped from the local page cache before the cursor wraps around.
* Read-only: files are opened for reading and nothing is written anywhere.
* Bounded: the whole sweep stops at ``seconds`` or ``max_bytes``, whichever comes
  first; a trial that sees transient errors (ENOMEM, EIO, EAGAIN) reports them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from loaderplug.engine.retry import RetryPolicy, retrying
from loaderplug.errors import LoaderplugError
from loaderplug.plugins.manager import Plugins
from loaderplug.report import printable
from loaderplug.settings import Settings, from_env
from loaderplug.storage.io_policy import decide, direct_io_alignment
from loaderplug.storage.io_probe import in_parallel, remeasure
from loaderplug.storage.mounts import MEMORY_TYPES
from loaderplug.storage.source import aligned_buffer
from loaderplug.types import IOPolicy
from loaderplug.units import GiB, MiB, format_size

# The sweep: (readers, span size). Few large spans suit network volumes; many
# streams suit per-stream-capped object stores. Bytes in flight stay at or under 1 GiB,
# past which busy hosts answer with ENOMEM storms.
GRID: tuple[tuple[int, int], ...] = (
    (4, 64 * MiB),
    (8, 64 * MiB),
    (8, 16 * MiB),
    (16, 32 * MiB),
    (16, 16 * MiB),
    (32, 16 * MiB),
    (64, 8 * MiB),
    (128, 4 * MiB),
)


@dataclasses.dataclass
class Trial:
    readers: int
    span_bytes: int
    bytes_read: int = 0
    seconds: float = 0.0
    transient_errors: int = 0

    @property
    def mib_per_s(self) -> float:
        return self.bytes_read / MiB / self.seconds if self.seconds else 0.0

    def exports(self) -> list[str]:
        return [
            f"export LOADERPLUG_READERS={self.readers}",
            f"export LOADERPLUG_SPAN_BYTES={format_size(self.span_bytes).replace(' ', '')}",
            f"export LOADERPLUG_BYTES_IN_FLIGHT="
            f"{format_size(self.readers * self.span_bytes).replace(' ', '')}",
        ]


@dataclasses.dataclass
class BenchResult:
    path: str
    policy: str
    trials: list[Trial]
    measured: str | None = None  # direct against buffered, as measured and kept

    @property
    def best(self) -> Trial:
        # Errors are a warning sign even when retries would hide them: prefer clean runs.
        clean = [t for t in self.trials if not t.transient_errors] or self.trials
        return max(clean, key=lambda t: t.mib_per_s)

    def to_dict(self) -> dict[str, object]:
        return {
            "path": self.path,
            "policy": self.policy,
            "measured": self.measured,
            "trials": [dataclasses.asdict(t) | {"mib_per_s": t.mib_per_s} for t in self.trials],
            "best": dataclasses.asdict(self.best) | {"mib_per_s": self.best.mib_per_s},
        }

    def summary(self) -> str:
        # The policy's reason may name a file of the storage: shown escaped.
        lines = [printable(f"{self.path}: {self.policy}")]
        if self.measured is not None:
            lines.append(printable(f"IO policy kept for this mount: {self.measured}"))
        lines.append("readers  span      MiB/s  transient errors")
        for t in self.trials:
            lines.append(
                f"{t.readers:7d}  {format_size(t.span_bytes):8s} {t.mib_per_s:6.0f}  "
                f"{t.transient_errors}"
            )
        best = self.best
        lines.append(
            "# The default, LOADERPLUG_READERS=auto, adapts to the storage while it"
            " copies;\n# to pin the best fixed setting measured here instead:"
        )
        lines.append(f"# best: {best.mib_per_s:.0f} MiB/s")
        lines.extend(best.exports())
        return "\n".join(lines)


class _Cursor:
    """Hands out ranges that no trial has read yet, file by file, wrapping when PATH is
    exhausted (after dropping its files from the local page cache)."""

    def __init__(self, files: list[tuple[str, int]]) -> None:
        self.files = files
        self._index = 0
        self._offset = 0
        self._lock = threading.Lock()

    def next(self, length: int) -> tuple[str, int, int]:
        with self._lock:
            path, size = self.files[self._index]
            if self._offset >= size:
                self._index = (self._index + 1) % len(self.files)
                self._offset = 0
                if self._index == 0:
                    _drop_cached(self.files)
                path, size = self.files[self._index]
            offset = self._offset
            self._offset += length
            return path, offset, min(length, size - offset)


def _drop_cached(files: list[tuple[str, int]]) -> None:
    for path, _size in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _list_files(path: Path) -> list[tuple[str, int]]:
    if not path.exists():
        raise LoaderplugError(f"{path} does not exist; point bench at a model on your storage")
    candidates = [path] if path.is_file() else sorted(path.rglob("*"))
    # Symlinks are followed (a Hub snapshot is made of them), each file read once.
    files: dict[str, int] = {}
    for p in candidates:
        if p.is_file():
            files.setdefault(os.path.realpath(p), p.stat().st_size)
    found = [(p, size) for p, size in files.items() if size > 0]
    if not found:
        raise LoaderplugError(f"{path}: no files with data to read; point bench at a model")
    return found


def run_bench(
    path: str | os.PathLike[str],
    *,
    seconds: float = 30.0,
    max_bytes: int = 4 * GiB,
    grid: Sequence[tuple[int, int]] = GRID,
    settings: Settings | None = None,
) -> BenchResult:
    """Sweep ``grid`` over the files under ``path``, read-only, within the budgets."""
    settings = settings or from_env()
    files = _list_files(Path(path))
    plugins = Plugins(settings)
    measured = _measure_io(files[0][0], settings)
    policy = plugins.io_policy(files[0][0])
    cursor = _Cursor(files)
    slice_s = seconds / len(grid)
    byte_budget = max_bytes // len(grid)
    retry = RetryPolicy.of(settings)
    trials = [
        _trial(Trial(w, c), cursor, policy, plugins, retry, slice_s, byte_budget) for w, c in grid
    ]
    mode = "direct" if policy.direct else "buffered"
    return BenchResult(str(path), f"read {mode} ({policy.reason})", trials, measured)


def _measure_io(path: str, settings: Settings) -> str | None:
    """Direct against buffered on this mount, measured now and kept for later jobs
    (see :mod:`loaderplug.storage.io_probe`); None where probing is off or impossible."""
    if not settings.io_probe or settings.direct_io != "auto":
        return None
    guess = decide(path, "auto")
    if guess.fs_type in MEMORY_TYPES:
        return None
    found = remeasure(path, guess, direct_io_alignment(path))
    return found.reason if found is not None else None


def _trial(
    trial: Trial,
    cursor: _Cursor,
    policy: IOPolicy,
    plugins: Plugins,
    retry: RetryPolicy,
    seconds: float,
    byte_budget: int,
) -> Trial:
    lock = threading.Lock()
    started = time.monotonic()
    deadline = started + seconds
    reserved = [0]  # bytes claimed by reads started, so the budget is never overshot
    failed = threading.Event()  # one worker failed: the others stop too

    def transient(exc: OSError) -> None:
        with lock:
            trial.transient_errors += 1

    def worker() -> None:
        buffer = aligned_buffer(trial.span_bytes)
        view = memoryview(buffer)
        try:
            while time.monotonic() < deadline and not failed.is_set():
                with lock:
                    claim = min(trial.span_bytes, byte_budget - reserved[0])
                    if claim <= 0:
                        return
                    reserved[0] += claim
                path, offset, length = cursor.next(claim)
                # Retried as a hydrate retries a range: the time it costs is the setting's.
                got = _read(plugins, path, policy, view, offset, length, retry, transient)
                with lock:
                    trial.bytes_read += got
        except BaseException as exc:  # raised after the trial: the bench stops
            # Drop the frames, so no slice of the buffer stays referenced by the error.
            traceback.clear_frames(exc.__traceback__)
            failed.set()
            raise
        finally:
            with contextlib.suppress(BufferError):  # a slice still held elsewhere
                view.release()
                buffer.close()

    in_parallel(trial.readers, worker)
    trial.seconds = time.monotonic() - started
    return trial


class _GaveUp(Exception):
    """A read still failing transiently after every retry: counted, and skipped."""


def _read(
    plugins: Plugins,
    path: str,
    policy: IOPolicy,
    view: memoryview,
    offset: int,
    n: int,
    retry: RetryPolicy,
    on_transient: Callable[[OSError], None],
) -> int:
    """Bytes read (0 when transient errors outlasted the retries); any other error ends
    the bench."""

    def read() -> int:
        source = plugins.open_source(path, policy)
        try:
            # Direct reads want whole blocks: round the length up (the buffer has room).
            want = -(-n // 4096) * 4096 if policy.direct else n
            return min(source.pread_into(view[: min(want, len(view))], offset), n)
        finally:
            source.close()

    def give_up(exc: OSError, attempts: int | None) -> Exception:
        if attempts is not None:
            return _GaveUp()
        return LoaderplugError(f"{path}: reading failed: {exc.strerror or exc}")

    try:
        got, _ = retrying(read, retry, give_up, on_transient=on_transient)
    except _GaveUp:
        return 0
    return got
