"""A streamed one pass's copy leaves the page cache two steps after each tensor's
offer (when every consumer is done with it), adjacent tensors in one call, from the
partial copy or the published one."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from loaderplug.jobs.partial import partial_for
from loaderplug.tensors.format.header import Header, TensorInfo
from loaderplug.tensors.memory.copy_pages import ConsumedPages


def _header(path: Path, sizes: list[int]) -> Header:
    tensors, begin = [], 64
    for n, size in enumerate(sizes):
        tensors.append(TensorInfo(f"t{n}", "U8", (size,), begin, begin + size))
        begin += size
    return Header(str(path), begin, 64, tuple(tensors), {})


@pytest.fixture
def advised(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Every DONTNEED asked for: (the file's name, offset, length)."""
    calls: list[tuple[str, int, int]] = []

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        assert advice == os.POSIX_FADV_DONTNEED
        calls.append((Path(os.readlink(f"/proc/self/fd/{fd}")).name, offset, length))

    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    return calls


def test_a_tensor_goes_two_handing_steps_after_its_offer(
    tmp_path: Path, advised: list[Any]
) -> None:
    final = tmp_path / "a.safetensors"
    partial_for(final).write_bytes(b"\0" * 1000)
    header = _header(final, [100, 100, 100, 100])
    pages = ConsumedPages([final])
    pages.offered(0, header, "t0")  # step 1
    pages.offered(0, header, "t1")
    pages.step_entered(handed=True)
    pages.offered(0, header, "t3")  # step 2
    pages.step_entered(handed=True)
    pages.step_entered(handed=False)  # ranks waiting: proves nothing
    assert advised == []
    pages.step_entered(handed=True)  # step 3: t0 and t1, adjacent, in one call
    assert advised == [(partial_for(final).name, 64, 200)]
    partial_for(final).rename(final)  # published: the same file, by its new name
    pages.step_entered(handed=True)
    assert advised[1:] == [(final.name, 364, 100)]
    pages.close()  # the rest of the file: from 0 to its end
    assert advised[2:] == [(final.name, 0, 0)]


def test_nothing_is_asked_of_a_copy_that_is_gone(tmp_path: Path, advised: list[Any]) -> None:
    final = tmp_path / "a.safetensors"
    header = _header(final, [100])
    pages = ConsumedPages([final])
    pages.offered(0, header, "t0")
    for _ in range(3):
        pages.step_entered(handed=True)
    pages.close()
    assert advised == []


def test_an_empty_tensor_drops_nothing(tmp_path: Path, advised: list[Any]) -> None:
    """A length of 0 means "to the end of the file" to the kernel: an empty tensor must
    not drop the pages of the tensors after it."""
    final = tmp_path / "a.safetensors"
    final.write_bytes(b"\0" * 1000)
    header = _header(final, [100, 0, 100, 100])
    pages = ConsumedPages([final])
    pages.offered(0, header, "t1")  # the empty one, alone
    pages.offered(0, header, "t3")
    for _ in range(3):  # the second step after the offer's
        pages.step_entered(handed=True)
    assert advised == [(final.name, 264, 100)]
