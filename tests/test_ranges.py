from __future__ import annotations

import itertools

import pytest

from loaderplug.ranges import Span, count_spans, plan


def covered(spans: list[Span], file: int) -> list[tuple[int, int]]:
    return sorted((s.offset, s.offset + s.length) for s in spans if s.file == file)


@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, 10 * 4096 + 17])
def test_spans_cover_every_byte_once_including_a_final_partial_range(size: int) -> None:
    spans = list(plan([size], 4096, split_threshold=1))
    ranges = covered(spans, 0)
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert len(spans) == count_spans(size, 4096, 1)


def test_empty_file_is_one_empty_span() -> None:
    assert list(plan([0], 4096, 0)) == [Span(0, 0, 0)]


def test_small_files_are_one_whole_span() -> None:
    assert list(plan([100, 5000], 1024, split_threshold=1000)) == [
        Span(0, 0, 100),
        Span(1, 0, 1024),
        Span(1, 1024, 1024),
        Span(1, 2048, 1024),
        Span(1, 3072, 1024),
        Span(1, 4096, 904),
    ]


def test_spans_interleave_across_files_offset_major() -> None:
    spans = list(plan([3000, 1000, 2500], 1000, split_threshold=1))
    assert [(s.file, s.offset) for s in spans] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (0, 1000),
        (2, 1000),
        (0, 2000),
        (2, 2000),
    ]


def test_plan_is_lazy() -> None:
    # A petabyte of ranges would not fit in memory if the plan were materialised.
    spans = plan([1 << 50] * 4, 4096, split_threshold=1)
    assert [s.file for s in itertools.islice(spans, 6)] == [0, 1, 2, 3, 0, 1]
