"""Planning: files → byte ranges, offset-major, generated lazily.

Offset-major order (range 0 of every file, then range 1 of every file, ...) spreads the
workers across files, so per-stream bandwidth caps on a network volume add up instead of
queueing behind one file. The plan is a generator: memory stays O(files), never one
object per range.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import NamedTuple


class Span(NamedTuple):
    """``length`` bytes of file number ``file`` starting at ``offset``."""

    file: int
    offset: int
    length: int


def is_split(size: int, split_threshold: int) -> bool:
    """Files at or over the threshold are split; empty files never are."""
    return size > 0 and size >= split_threshold


def count_spans(size: int, chunk: int, split_threshold: int) -> int:
    return -(-size // chunk) if is_split(size, split_threshold) else 1


def plan(sizes: Sequence[int], chunk: int, split_threshold: int) -> Iterator[Span]:
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
