from __future__ import annotations

import itertools

import pytest

from loaderplug.engine.sizing import (
    chunk_for_job,
    chunk_for_source,
    default_sizing,
    is_adaptive,
    workers_for_chunk,
)
from loaderplug.engine.spans import Span, count_spans, file_major, head_in_steps, offset_major
from loaderplug.settings import from_env
from loaderplug.units import MiB


def covered(spans: list[Span], file: int) -> list[tuple[int, int]]:
    return sorted((s.offset, s.offset + s.length) for s in spans if s.file == file)


@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, 10 * 4096 + 17])
def test_spans_cover_every_byte_once_including_a_final_partial_range(size: int) -> None:
    spans = list(offset_major([size], 4096, split_threshold=1))
    ranges = covered(spans, 0)
    assert ranges[0][0] == 0 and ranges[-1][1] == size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert len(spans) == count_spans(size, 4096, 1)


def test_empty_file_is_one_empty_span() -> None:
    assert list(offset_major([0], 4096, 0)) == [Span(0, 0, 0)]


def test_small_files_are_one_whole_span() -> None:
    assert list(offset_major([100, 5000], 1024, split_threshold=1000)) == [
        Span(0, 0, 100),
        Span(1, 0, 1024),
        Span(1, 1024, 1024),
        Span(1, 2048, 1024),
        Span(1, 3072, 1024),
        Span(1, 4096, 904),
    ]


def test_spans_interleave_across_files_offset_major() -> None:
    spans = list(offset_major([3000, 1000, 2500], 1000, split_threshold=1))
    assert [(s.file, s.offset) for s in spans] == [
        (0, 0),
        (1, 0),
        (2, 0),
        (0, 1000),
        (2, 1000),
        (0, 2000),
        (2, 2000),
    ]


def test_the_head_is_read_in_steps_and_the_rest_in_whole_ranges() -> None:
    """The first ``head`` bytes of the order come in steps (a range that starts inside
    the head is cut whole); later ranges, and whole-file spans, keep their size."""
    order = head_in_steps(file_major, head=2500, step=400)
    spans = list(order([100, 3000, 2000], 1000, 1000))
    steps = [(0, 400), (400, 400), (800, 200)]  # each range of 1000 in steps of 400
    assert spans == [
        Span(0, 0, 100),  # a whole small file: never cut
        *(Span(1, start + o, n) for start in (0, 1000, 2000) for o, n in steps),
        Span(2, 0, 1000),  # past the head: whole ranges
        Span(2, 1000, 1000),
    ]


@pytest.mark.parametrize("head", [0, 1, 4096, 3 * 4096 + 5, 1 << 30])
def test_a_head_in_steps_still_covers_every_byte_once(head: int) -> None:
    sizes = [0, 5000, 4096 * 7 + 3, 4096 * 2]
    spans = list(head_in_steps(file_major, head, 1024)(sizes, 4096, 4096))
    for file, size in enumerate(sizes):
        ranges = covered(spans, file)
        assert ranges[0][0] == 0 and ranges[-1][1] == size
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    # Every step span that starts within the head's bytes is one step long at most (the
    # tail steps of the last range cut are covered by the first test).
    read = 0
    for span in spans:
        if read < head and sizes[span.file] >= 4096:
            assert span.length <= 1024
        read += span.length


def test_a_step_must_be_positive() -> None:
    with pytest.raises(ValueError, match="step must be positive"):
        head_in_steps(file_major, 4096, 0)


def test_plan_is_lazy() -> None:
    # A petabyte of ranges would not fit in memory if the plan were materialised.
    spans = offset_major([1 << 50] * 4, 4096, split_threshold=1)
    assert [s.file for s in itertools.islice(spans, 6)] == [0, 1, 2, 3, 0, 1]


def test_workers_alone_scale_the_chunk_to_the_budget() -> None:
    s = from_env({"LOADERPLUG_READERS": "32"})
    assert chunk_for_source(s) == 16 * MiB
    assert default_sizing(s).workers == 32


def test_derived_chunk_is_capped_at_64_mib() -> None:
    assert chunk_for_source(from_env({"LOADERPLUG_BYTES_IN_FLIGHT": "4GiB"})) == 64 * MiB


def test_explicit_chunk_is_never_rescaled_and_the_budget_limits_workers() -> None:
    s = from_env({"LOADERPLUG_SPAN_BYTES": "256M"})
    assert chunk_for_source(s) == 256 * MiB
    assert default_sizing(s).workers == 2  # 512 MiB in flight / 256 MiB


def test_auto_workers_split_the_budget_for_the_most_readers_auto_may_run() -> None:
    s = from_env({"LOADERPLUG_READERS": " Auto "})
    assert is_adaptive(s) and s.readers == "auto"
    assert (chunk_for_source(s), default_sizing(s).workers) == (16 * MiB, 32)
    # Small jobs are fitted for the sixteen workers auto starts with, as for sixteen
    # fixed workers.
    fixed = from_env({"LOADERPLUG_READERS": "16"})
    assert chunk_for_job(s, 1024 * MiB) == chunk_for_job(fixed, 1024 * MiB) == 8 * MiB
    assert chunk_for_job(s, 4096 * MiB) == 16 * MiB
    # From a local disk auto reads long ranges, at most 8 at once, whatever the job.
    assert chunk_for_job(s, 1024 * MiB, network=False) == 64 * MiB
    assert workers_for_chunk(s, 64 * MiB) == 8
    assert chunk_for_job(fixed, 1024 * MiB, network=False) == 8 * MiB
    # An explicit chunk leaves room for fewer readers within the same budget.
    explicit = from_env({"LOADERPLUG_READERS": "auto", "LOADERPLUG_SPAN_BYTES": "64M"})
    assert default_sizing(explicit).workers == 8
