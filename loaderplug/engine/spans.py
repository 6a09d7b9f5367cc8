"""The order a job's spans are read in, generated lazily.

A copy reads offset-major (range 0 of every file, then range 1 of every file, ...): the
readers spread across files, so per-stream bandwidth caps on a network volume add up
instead of queueing behind one file. A load reads file-major (every range of file 0,
then of file 1, ...): the readers still read side by side, each through a descriptor of
its own, so the caps add up just as well, and what is in flight is one window of the
model, which its memory budget bounds (:mod:`loaderplug.tensors.memory.budget`). Orders are
generators: memory stays O(files), never one object per range.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple


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


def head_in_steps(order: Order, head: int, step: int) -> Order:
    """``order``, with every split range that starts within its first ``head`` bytes
    cut whole into spans of at most ``step`` bytes (whole-file spans count towards the
    head but are never cut).

    The readers start on the first spans of the order side by side, so with whole
    ranges a tensor at the start of the first file lands only when the whole first wave
    of ranges does (readers x range bytes at the storage's pace: 0.4 s at 2 ranks from
    the FUSE mirror); in steps they work through the head nearly in order, and the first
    tensors land at about their own bytes' pace (first tensor 0.38-0.41 s against
    0.51-0.66 s at 2 ranks, the load's time unchanged). Past the head, ranges keep their
    size: the head only moves the first tensor (each step is a span of its own, so a one
    pass syncs and journals it as one: a few more of those, once per load).
    """
    if step <= 0:
        raise ValueError(f"step must be positive, got {step}")

    def ordered(sizes: Sequence[int], chunk: int, split_threshold: int) -> Iterator[Span]:
        left = head
        for span in order(sizes, chunk, split_threshold):
            cut = left > 0 and span.length > step and is_split(sizes[span.file], split_threshold)
            left -= span.length
            if not cut:
                yield span
                continue
            end = span.offset + span.length
            for offset in range(span.offset, end, step):
                yield Span(span.file, offset, min(step, end - offset))

    return ordered


@dataclass(frozen=True)
class Landed:
    """Byte ranges already durable in a partial copy, merged and sorted."""

    ranges: tuple[tuple[int, int], ...] = ()

    @staticmethod
    def of(pairs: list[tuple[int, int]]) -> Landed:
        merged: list[tuple[int, int]] = []
        for begin, end in sorted(p for p in pairs if p[1] > p[0]):
            if merged and begin <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((begin, end))
        return Landed(tuple(merged))

    @property
    def nbytes(self) -> int:
        return sum(end - begin for begin, end in self.ranges)

    def covers(self, offset: int, length: int) -> bool:
        """Whether ``[offset, offset + length)`` landed already (an empty range never
        did: an empty file is still written and published)."""
        i = bisect.bisect_right(self.ranges, (offset, float("inf"))) - 1
        return length > 0 and i >= 0 and self.ranges[i][1] >= offset + length
