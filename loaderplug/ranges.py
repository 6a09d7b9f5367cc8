"""Planning a job's reads: how big its ranges are, how many readers read them, and in
which order, generated lazily.

Sizing. Bytes in flight (readers x range size) is the knob that matters: a derived range
is the budget split over the readers (at most 64 MiB), shrunk for small jobs so every
reader gets several ranges; an explicit range size is never rescaled.

Order. A copy reads offset-major (range 0 of every file, then range 1 of every file,
...): the readers spread across files, so per-stream bandwidth caps on a network volume
add up instead of queueing behind one file. A load reads file-major (every range of
file 0, then of file 1, ...): the readers still read side by side, each through a
descriptor of its own, so the caps add up just as well, and what is in flight is one
window of the model, which its memory budget bounds (:mod:`loaderplug.budget`). Orders
are generators: memory stays O(files), never one object per range.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

from loaderplug.units import KiB, MiB

# Derived chunks shrink until a job has about this many ranges per worker.
RANGES_PER_WORKER = 8
# The largest derived range: longer ones stop helping and delay the first finished file.
MAX_DERIVED_CHUNK = 64 * MiB
# Nor shorter than this for a small job, where per-request overhead starts to dominate.
MIN_FITTED_CHUNK = 4 * MiB
# Ranges stay a multiple of this, so O_DIRECT offsets stay aligned.
CHUNK_ALIGNMENT = 4 * KiB
# With LOADERPLUG_HYDRATE_WORKERS=auto, readers the budget is split for when the source
# is on a network filesystem: many streams beat a per-stream cap, and the adaptive limit
# may climb this high (fewer when an explicit chunk leaves less room in the budget).
AUTO_MAX_WORKERS = 32
# ... and when it is on a local disk, which has no per-stream cap: few long ranges beat
# many short ones there (8 x 64 MiB was the best fixed setting on local disk in five of
# six runs of benchmarks/auto_bench.py, and 5-29% ahead of 8 x 16 MiB in all six).
AUTO_LOCAL_WORKERS = 8
# ... and where auto starts, which small jobs' ranges are fitted for. A model of a GiB
# is copied in a few seconds, too few windows to climb from far below: starting at 16
# reached 32 x 16 MiB's speed on the network volume where starting at 8 fell 10-20%
# behind, and an object store that refuses more than 6 reads in flight costs about ten
# retries and no failed file (benchmarks/auto_bench.py).
AUTO_START_WORKERS = 16


class SizingSettings(Protocol):
    """The settings sizing reads (:class:`loaderplug.settings.Settings` has them)."""

    @property
    def hydrate_workers(self) -> int | Literal["auto"]: ...

    @property
    def bytes_in_flight(self) -> int: ...

    @property
    def chunk_bytes(self) -> int | None: ...


@dataclass(frozen=True)
class Sizing:
    """A job's range size and the most readers that may read at once."""

    chunk: int
    workers: int
    adaptive: bool  # auto workers: the limit moves between 1 and ``workers``


def is_adaptive(settings: SizingSettings) -> bool:
    """``LOADERPLUG_HYDRATE_WORKERS=auto``: the engine adapts concurrency as it runs."""
    return settings.hydrate_workers == "auto"


def _split_workers(settings: SizingSettings, *, network: bool) -> int:
    """The worker count the budget is divided by to derive a range size: with auto,
    the most readers it may climb to from a ``network`` source or a local one."""
    if settings.hydrate_workers != "auto":
        return settings.hydrate_workers
    return AUTO_MAX_WORKERS if network else AUTO_LOCAL_WORKERS


def _fit_workers(settings: SizingSettings) -> int:
    """The worker count a small job's ranges are fitted for."""
    workers = settings.hydrate_workers
    return AUTO_START_WORKERS if workers == "auto" else workers


def chunk_for_source(settings: SizingSettings, *, network: bool = True) -> int:
    """The range size: an explicit chunk as given, else bytes in flight / workers.

    The derived size is capped at 64 MiB and rounded down to 4 KiB. With auto workers
    the budget is split for the most readers auto may run from a ``network`` source or a
    local one.
    """
    if settings.chunk_bytes is not None:
        return settings.chunk_bytes
    share = min(
        MAX_DERIVED_CHUNK, settings.bytes_in_flight // _split_workers(settings, network=network)
    )
    return max(CHUNK_ALIGNMENT, share // CHUNK_ALIGNMENT * CHUNK_ALIGNMENT)


def chunk_for_job(settings: SizingSettings, total_bytes: int, *, network: bool = True) -> int:
    """The range size for a job of ``total_bytes``; ``network``: whether a source is
    on a network filesystem.

    A derived chunk also shrinks for small jobs, so that every worker (with auto,
    each of the readers it starts with) gets about eight ranges: on a volume with a
    per-stream cap, four 64 MiB ranges of a 256 MiB model would leave half of eight
    workers idle, and the last ranges, which land after every read is done, are
    short. An explicit chunk is used as is, and so is auto's long range from a local
    disk, where one reader gets the device's pace and no per-stream cap idles the others.
    """
    chunk = chunk_for_source(settings, network=network)
    if settings.chunk_bytes is not None or (is_adaptive(settings) and not network):
        return chunk
    per_worker = total_bytes // (_fit_workers(settings) * RANGES_PER_WORKER)
    # A power of two keeps ranges aligned for O_DIRECT and sizes predictable.
    fitted = max(MIN_FITTED_CHUNK, 1 << max(per_worker, 1).bit_length() - 1)
    return min(chunk, fitted)


def workers_for_chunk(settings: SizingSettings, chunk: int) -> int:
    """Workers that may run at once without exceeding the bytes-in-flight budget;
    with auto workers, the most the adaptive limit may climb to."""
    return min(_split_workers(settings, network=True), max(1, settings.bytes_in_flight // chunk))


def default_sizing(settings: SizingSettings) -> Sizing:
    """The sizing of a large job from a network filesystem: what a report of a job that
    read nothing shows, and what ``doctor`` prints."""
    chunk = chunk_for_source(settings)
    return Sizing(chunk, workers_for_chunk(settings, chunk), is_adaptive(settings))


def size_job(settings: SizingSettings, total_bytes: int, *, network: bool) -> Sizing:
    """The range size and reader count for a job of ``total_bytes``."""
    chunk = chunk_for_job(settings, total_bytes, network=network)
    return Sizing(chunk, workers_for_chunk(settings, chunk), is_adaptive(settings))


class Span(NamedTuple):
    """``length`` bytes of file number ``file`` starting at ``offset``: what one reader
    takes at a time."""

    file: int
    offset: int
    length: int


def is_split(size: int, split_threshold: int) -> bool:
    """Files at or over the threshold are split; empty files never are."""
    return size > 0 and size >= split_threshold


def count_spans(size: int, chunk: int, split_threshold: int) -> int:
    return -(-size // chunk) if is_split(size, split_threshold) else 1


def offset_major(sizes: Sequence[int], chunk: int, split_threshold: int) -> Iterator[Span]:
    """Yield every span of every file, offset-major.

    A file below ``split_threshold`` (and an empty file) is one span covering the whole
    file, copied by one worker; it is yielded in the first round.
    """
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    active = list(range(len(sizes)))
    offset = 0
    while active:
        still_active = []
        for index in active:
            size = sizes[index]
            if not is_split(size, split_threshold):
                yield Span(index, 0, size)
                continue
            yield Span(index, offset, min(chunk, size - offset))
            if offset + chunk < size:
                still_active.append(index)
        active = still_active
        offset += chunk


def file_major(sizes: Sequence[int], chunk: int, split_threshold: int) -> Iterator[Span]:
    """Yield every span of every file, file after file, each file's in offset order."""
    if chunk <= 0:
        raise ValueError(f"chunk must be positive, got {chunk}")
    for index, size in enumerate(sizes):
        if not is_split(size, split_threshold):
            yield Span(index, 0, size)
            continue
        for offset in range(0, size, chunk):
            yield Span(index, offset, min(chunk, size - offset))


# An order: the files' sizes, the range size and the split threshold -> every span.
Order = Callable[[Sequence[int], int, int], Iterator[Span]]
