"""Each tensor's pages go back to the kernel when its storage dies; a page two tensors
share goes back once neither needs it."""

from __future__ import annotations

import gc
import mmap

import pytest

from loaderplug.tensors.format.header import Header, TensorInfo
from loaderplug.tensors.memory.page_release import PAGE, PageReleaser

torch = pytest.importorskip("torch")


def header_of(spans: list[tuple[int, int]], size: int) -> Header:
    tensors = tuple(TensorInfo(f"t{i}", "U8", (e - b,), b, e) for i, (b, e) in enumerate(spans))
    return Header("test", size, spans[0][0], tensors, {})


def resident(mapping: mmap.mmap, page: int) -> bool:
    """Whether the page still holds what was written (an anonymous page given back with
    MADV_DONTNEED reads as zeros)."""
    return mapping[page * PAGE] != 0


@pytest.mark.slow("a process that maps a model and watches its memory")
def test_a_dead_tensor_gives_back_its_pages_and_keeps_its_neighbours_shared_ones() -> None:
    # Three tensors: t0 ends and t1 starts inside page 2; t1 ends and t2 starts in page 5.
    spans = [(100, 2 * PAGE + 10), (2 * PAGE + 10, 5 * PAGE + 20), (5 * PAGE + 20, 8 * PAGE)]
    size = 8 * PAGE
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping[:] = b"\x01" * size
    releaser = PageReleaser(mapping, header_of(spans, size), size)
    t0, t1, t2 = (
        torch.frombuffer(releaser.tensor(t), dtype=torch.uint8)
        for t in header_of(spans, size).tensors
    )
    view = t1[3 * PAGE : 3 * PAGE + 8]  # a view keeps t1's storage alive
    del t1
    gc.collect()
    assert all(resident(mapping, p) for p in range(8))
    del view
    gc.collect()
    # t1's own pages are back; its first and last pages are shared with t0 and t2.
    assert [resident(mapping, p) for p in range(8)] == [
        True,
        True,
        True,
        False,
        False,
        True,
        True,
        True,
    ]
    assert bool((t0 == 1).all()) and bool((t2 == 1).all())
    del t0
    gc.collect()
    # Page 0 holds the header as well (the file's own bytes) until the file is done.
    assert [resident(mapping, p) for p in range(3)] == [True, False, False]
    releaser.release_rest()
    assert not resident(mapping, 0)
    del t2
    gc.collect()
    assert not any(resident(mapping, p) for p in range(8))


def test_a_tensor_within_one_page_shares_it_with_both_neighbours() -> None:
    spans = [(0, 10), (10, 20), (20, PAGE + 5)]
    size = 2 * PAGE
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping[:] = b"\x02" * size
    header = header_of(spans, size)
    releaser = PageReleaser(mapping, header, size)
    tensors = [torch.frombuffer(releaser.tensor(t), dtype=torch.uint8) for t in header.tensors]
    del tensors[1]
    gc.collect()
    assert resident(mapping, 0) and bool((tensors[0] == 2).all())
    tensors.clear()
    releaser.release_rest()
    gc.collect()
    assert not resident(mapping, 0) and not resident(mapping, 1)
