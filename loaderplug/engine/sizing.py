"""Sizing a job's reads: how big its ranges are and how many readers read them.

Bytes in flight (readers x range size) is the knob that matters: a derived range is the
budget split over the readers (at most 64 MiB), shrunk for small jobs so every reader
gets several ranges; an explicit range size is never rescaled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from loaderplug.settings import AUTO_LOCAL_WORKERS, AUTO_MAX_WORKERS, AUTO_START_WORKERS
from loaderplug.units import KiB, MiB

# Derived chunks shrink until a job has about this many ranges per worker.
RANGES_PER_WORKER = 8
# The largest derived range: longer ones stop helping and delay the first finished file.
MAX_DERIVED_CHUNK = 64 * MiB
# Nor shorter than this for a small job, where per-request overhead starts to dominate.
MIN_FITTED_CHUNK = 4 * MiB
# Nor shorter than this from an object store, where each range is a request: 8 MiB
# ranges streamed read 594 MiB/s, 64 MiB ones 1040 MiB/s, from one local SeaweedFS
# (docs/benchmarks.md, "Object store clients").
MIN_REQUEST_CHUNK = 16 * MiB
# Ranges stay a multiple of this, so O_DIRECT offsets stay aligned.
CHUNK_ALIGNMENT = 4 * KiB


class SizingSettings(Protocol):
    """The settings sizing reads (:class:`loaderplug.settings.Settings` has them)."""

    @property
    def readers(self) -> int | Literal["auto"]: ...

    @property
    def bytes_in_flight(self) -> int: ...

    @property
    def span_bytes(self) -> int | None: ...


@dataclass(frozen=True)
class Sizing:
    """A job's range size and the most readers that may read at once."""

    chunk: int
    workers: int
    adaptive: bool  # auto workers: the limit moves between 1 and ``workers``


def is_adaptive(settings: SizingSettings) -> bool:
    """``LOADERPLUG_READERS=auto``: the engine adapts concurrency as it runs."""
    return settings.readers == "auto"


def _split_workers(settings: SizingSettings, *, network: bool) -> int:
    """The worker count the budget is divided by to derive a range size: with auto,
    the most readers it may climb to from a ``network`` source or a local one."""
    if settings.readers != "auto":
        return settings.readers
    return AUTO_MAX_WORKERS if network else AUTO_LOCAL_WORKERS


def _fit_workers(settings: SizingSettings) -> int:
    """The worker count a small job's ranges are fitted for."""
    workers = settings.readers
    return AUTO_START_WORKERS if workers == "auto" else workers


def chunk_for_source(settings: SizingSettings, *, network: bool = True) -> int:
    """The range size: an explicit chunk as given, else bytes in flight / workers.

    The derived size is capped at 64 MiB and rounded down to 4 KiB. With auto workers
    the budget is split for the most readers auto may run from a ``network`` source or a
    local one.
    """
    if settings.span_bytes is not None:
        return settings.span_bytes
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
    if settings.span_bytes is not None or (is_adaptive(settings) and not network):
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


def size_job(
    settings: SizingSettings, total_bytes: int, *, network: bool, requests: bool = False
) -> Sizing:
    """The range size and reader count for a job of ``total_bytes``; ``requests``: each
    range is a request to an object store, whose answer time is paid per range: a
    derived range is then no shorter than :data:`MIN_REQUEST_CHUNK`."""
    chunk = chunk_for_job(settings, total_bytes, network=network)
    if requests and settings.span_bytes is None:
        chunk = max(chunk, min(MIN_REQUEST_CHUNK, chunk_for_source(settings)))
    return Sizing(chunk, workers_for_chunk(settings, chunk), is_adaptive(settings))
