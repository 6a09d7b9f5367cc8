"""The IO policy measured per mount: direct against buffered parallel reads, once.

The filesystem-type table (:mod:`loaderplug.storage.io_policy`) is a guess: on one
local disk parallel O_DIRECT reads beat buffered ones one day and lose the next, and
some FUSE filesystems read faster direct. So the first time a job reads a cold file of
a mount, :func:`measured_policy` reads part of it both ways with the engine's
parallelism, for a bounded cost (:data:`PROBE_BYTES` and about :data:`PROBE_SECONDS`),
and records the winner for the mount (its device and filesystem) in a small cache file
with the figures and the date; later jobs use what it recorded. A warm file, a file in
memory, a file too small to tell, or a mount that cannot be probed keeps the table's
answer, as does ``LOADERPLUG_IO_PROBE=off``; ``LOADERPLUG_DIRECT_IO=on|off`` overrides
both.

The cache file, its lock and its temp file are state files
(:mod:`loaderplug.storage.state_files`): never reached through a link, the temp file
created new, the cache read only as a regular file of at most :data:`CACHE_BYTES`.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loaderplug.storage.files import write_atomically
from loaderplug.storage.residency import WARM_FRACTION, cached_fraction
from loaderplug.storage.source import PosixSource, aligned_buffer
from loaderplug.storage.state_files import UnsafeFile, open_or_create, open_regular, read_capped
from loaderplug.types import IOPolicy
from loaderplug.units import MiB

log = logging.getLogger(__name__)

# Most bytes a probe reads (half each way), and about how long it may take.
PROBE_BYTES = 256 * MiB
PROBE_SECONDS = 1.0
# Readers and read size: the engine's own, so the figures are the engine's.
PROBE_READERS = 8
PROBE_STEP = 4 * MiB
# Files smaller than this cannot tell the two modes apart: each reader needs a read in
# each of the probe's four slices.
SMALLEST_PROBED = 4 * PROBE_READERS * PROBE_STEP
# A file this much in the page cache would flatter buffered reads: not probed.
COLDEST_PROBED = 0.05
# Files of a folder looked at for one to measure with.
MOST_LOOKED_AT = 1000
# The other mode must be this much faster to overturn the table's guess (noise).
MARGIN = 1.05

# The most the cache file holds: a few hundred bytes a mount; more is not read.
CACHE_BYTES = 1024 * 1024

_lock = threading.Lock()


@dataclass(frozen=True)
class Measurement:
    """One mount's probe: both modes' speeds, what it cost, and when it ran."""

    mount: str
    fs_type: str
    direct: bool
    direct_mib_s: float
    buffered_mib_s: float
    bytes_read: int
    seconds: float
    date: str
    sample: str

    @property
    def reason(self) -> str:
        winner = "direct" if self.direct else "buffered"
        return (
            f"measured on this mount ({self.date}): {winner} wins, direct "
            f"{self.direct_mib_s:.0f} MiB/s against buffered {self.buffered_mib_s:.0f} MiB/s "
            f"({self.bytes_read / MiB:.0f} MiB read in {self.seconds:.2f} s)"
        )


def cache_file() -> Path:
    """Where measurements are kept: one small JSON file per user."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "loaderplug" / "io-policy.json"


def mount_key(path: str, fs_type: str) -> str:
    """The mount a path is on: its device and filesystem type."""
    st = os.stat(path)
    return f"{os.major(st.st_dev)}:{os.minor(st.st_dev)} {fs_type}"


def recorded(key: str) -> Measurement | None:
    try:
        return Measurement(**_entries()[key])
    except (KeyError, TypeError):
        return None


# The cache file as last parsed, by its path and (mtime, size, inode): a job decides the
# policy of every file it reads, and reads the file again only once it changed.
_parsed: tuple[str, tuple[int, int, int], Any] | None = None


def _entries() -> Any:
    global _parsed
    path = cache_file()
    try:
        st = os.lstat(path)
    except OSError:
        return {}
    signature = (st.st_mtime_ns, st.st_size, st.st_ino)
    parsed = _parsed
    if parsed is not None and parsed[:2] == (str(path), signature):
        return parsed[2]
    entries = _read_entries(path)
    _parsed = (str(path), signature, entries)
    return entries


_warned: set[str] = set()


def _read_entries(path: Path) -> dict[str, Any]:
    """The file's measurements by mount; a file that is not such a table (torn, garbage,
    another program's) counts as none, said once: the mounts are measured again."""
    try:
        entries = json.loads(read_capped(path, CACHE_BYTES, "the IO-policy cache")[0])
    except FileNotFoundError:
        return {}
    except UnsafeFile as exc:
        entries = exc.strerror
    except (OSError, ValueError) as exc:
        entries = exc
    if isinstance(entries, dict):
        return entries
    _warn_once(str(path), f"ignoring {path}, which is not a table of measurements "
               f"({entries}); mounts will be measured again")  # fmt: skip
    return {}


def _warn_once(path: str, message: str) -> None:
    if path not in _warned:
        _warned.add(path)
        log.warning("loaderplug: %s", message)


def _record(key: str, measurement: Measurement, *, replace: bool = False) -> Measurement:
    """Keep ``measurement`` for the mount, unless another process kept one first (and
    this is no ``replace``): the kept one, which every process then uses. The file is
    rewritten under a lock beside it, whole, by a rename; a home that cannot be written
    keeps nothing."""
    path = cache_file()
    with _lock:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(open_or_create(path.with_name(f".{path.name}.lock")), "rb") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                entries = _read_entries(path)
                kept = entries.get(key)
                if isinstance(kept, dict) and not replace:
                    with contextlib.suppress(TypeError):
                        return Measurement(**kept)
                entries[key] = asdict(measurement)
                temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                write_atomically(path, json.dumps(entries, indent=1), temp=temp, fsync=False)
        except UnsafeFile as exc:  # a link or a FIFO planted in the cache: said once
            _warn_once(str(exc.filename), f"not keeping the measurement: {exc}")
        except OSError:
            pass  # a read-only home: the next job measures again
    return measurement


# Asks measured_policy to find out how much of the file is in the page cache.
UNKNOWN: Any = object()


def measured_policy(
    path: str, guess: IOPolicy, direct_alignment: int, *, cached: float | None = UNKNOWN
) -> IOPolicy:
    """The mount's measured policy for ``path`` (measuring it now if ``path`` is a cold
    file big enough and the mount has no measurement yet), else ``guess``. ``cached``:
    the share of the file in the page cache, where the caller has just asked."""
    try:
        key = mount_key(path, guess.fs_type)
    except OSError:
        return guess
    if cached is UNKNOWN:
        cached = cached_fraction(path) if os.path.isfile(path) else None
    if (cached or 0.0) >= WARM_FRACTION:
        return guess  # served from memory: no measurement of the disk applies
    found = recorded(key)
    sample = _sample(path) if found is None else None
    if sample is not None:
        found = probe(sample, key, guess, direct_alignment)
        if found is not None:
            found = _record(key, found)
    if found is None:
        return guess
    alignment = direct_alignment if found.direct else 1
    return IOPolicy(found.direct, alignment, guess.fs_type, found.reason)


# Folders whose files are all too small to measure with, by the folder's mtime then: a
# load of many small files looks for a sample once, not once per file.
_too_small: dict[str, int] = {}


def _sample(path: str) -> str | None:
    """The file to measure with: ``path`` if it is a cold file big enough, else the
    largest such file beside it (a job's first file is often a small config)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        signature: int | None = os.stat(folder).st_mtime_ns
    except OSError:
        signature = None
    known = signature is not None and _too_small.get(folder) == signature
    if known and _size(path) < SMALLEST_PROBED:
        return None
    found, too_small = _largest_cold(path, folder)
    if too_small and signature is not None:
        _too_small[folder] = signature
    return found


def _largest_cold(path: str, folder: str) -> tuple[str | None, bool]:
    """The largest cold file big enough among ``path`` and the files of ``folder``, and
    whether none was big enough."""
    candidates = [path] if os.path.isfile(path) else []
    try:
        with os.scandir(folder) as entries:
            for entry in itertools.islice(entries, MOST_LOOKED_AT):
                if entry.is_file(follow_symlinks=False):
                    candidates.append(entry.path)
    except OSError:
        pass
    for i, candidate in enumerate(sorted(set(candidates), key=_size, reverse=True)):
        if _size(candidate) < SMALLEST_PROBED:
            return None, i == 0  # the largest is too small: every file is
        cached = cached_fraction(candidate)
        if cached is not None and cached <= COLDEST_PROBED:
            return candidate, False
    return None, not candidates


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def probe(path: str, key: str, guess: IOPolicy, alignment: int) -> Measurement | None:
    """Read parts of ``path`` direct and buffered, each with :data:`PROBE_READERS`
    readers, within the budgets; None if it could not be read.

    The modes take turns in four slices (direct, buffered, buffered, direct) over four
    regions spread across the file: a disk whose speed drifts while it is measured (a
    neighbour starts reading, a cache fills) weighs on both modes alike, and neither
    gets only the fast or the slow part of the disk."""
    size = os.path.getsize(path)
    quarter = min(PROBE_BYTES, size) // 4 // PROBE_STEP * PROBE_STEP
    direct_policy = IOPolicy(True, alignment, guess.fs_type, "probe")
    buffered_policy = IOPolicy.buffered(guess.fs_type, "probe")
    slices = (direct_policy, buffered_policy, buffered_policy, direct_policy)
    figures = {True: [0, 0.0], False: [0, 0.0]}  # direct? -> [bytes, seconds]
    started = time.monotonic()
    try:
        for i, policy in enumerate(slices):
            start = i * size // 4 // PROBE_STEP * PROBE_STEP
            nbytes, seconds = _read_region(path, policy, start, quarter, PROBE_SECONDS / 4)
            figures[policy.direct][0] += nbytes
            figures[policy.direct][1] += seconds
            if not policy.direct:
                # The job's buffered reads must not find them cached: the whole file,
                # for readahead brings in pages past the slice's end too.
                _forget(path, 0, 0)
    except OSError:
        return None
    (direct_bytes, direct_s), (buffered_bytes, buffered_s) = figures[True], figures[False]
    direct_speed = direct_bytes / MiB / direct_s if direct_s else 0.0
    buffered_speed = buffered_bytes / MiB / buffered_s if buffered_s else 0.0
    if guess.direct:
        direct = buffered_speed < direct_speed * MARGIN
    else:
        direct = direct_speed > buffered_speed * MARGIN
    return Measurement(
        mount=key,
        fs_type=guess.fs_type,
        direct=direct,
        direct_mib_s=round(direct_speed, 1),
        buffered_mib_s=round(buffered_speed, 1),
        bytes_read=int(direct_bytes + buffered_bytes),
        seconds=round(time.monotonic() - started, 3),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        sample=path,
    )


def _read_region(
    path: str, policy: IOPolicy, start: int, length: int, seconds: float
) -> tuple[int, float]:
    """Read ``[start, start + length)`` with parallel readers for at most about
    ``seconds``; the bytes read and the seconds it took."""
    offsets = iter(range(start, start + length, PROBE_STEP))
    deadline = time.monotonic() + seconds
    lock = threading.Lock()
    done = [0]

    def reader() -> None:
        source = PosixSource(path, policy)
        buffer = aligned_buffer(PROBE_STEP)
        try:
            while time.monotonic() < deadline:
                with lock:
                    offset = next(offsets, None)
                if offset is None:
                    return
                got = source.pread_into(memoryview(buffer), offset)
                with lock:
                    done[0] += got
        finally:
            buffer.close()
            source.close()

    began = time.monotonic()
    in_parallel(PROBE_READERS, reader)
    return done[0], time.monotonic() - began


def in_parallel(count: int, work: Callable[[], None]) -> None:
    """Run ``work`` on ``count`` threads at once; once all are done, raise the first
    exception any of them raised."""
    failures: list[BaseException] = []

    def guarded() -> None:
        try:
            work()
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=guarded, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failures:
        raise failures[0]


def remeasure(path: str, guess: IOPolicy, direct_alignment: int) -> Measurement | None:
    """Measure the mount of ``path`` now, whatever was recorded (``loaderplug bench``),
    and record it; None where it cannot be measured (no cold file big enough)."""
    try:
        key = mount_key(path, guess.fs_type)
    except OSError:
        return None
    sample = _sample(path)
    found = probe(sample, key, guess, direct_alignment) if sample is not None else None
    if found is not None:
        _record(key, found, replace=True)
    return found


def _forget(path: str, start: int, length: int) -> None:
    try:
        fd = open_regular(path, follow=True)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, start, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
