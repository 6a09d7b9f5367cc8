"""Hashing a copy as it lands, ranges in any order, within a bounded reorder window."""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Iterator

import pytest

from loaderplug.errors import FileError
from loaderplug.jobs.digest import DigestSink, Expected, ReorderWindow

DATA = os.urandom(1 << 20)
PIECES = [(o, DATA[o : o + 65536]) for o in range(0, len(DATA), 65536)]


def sink(expected: Expected, window: ReorderWindow, rereads: list[int]) -> DigestSink:
    def reread() -> Iterator[bytes]:
        rereads.append(1)
        yield DATA

    return DigestSink("blob", len(DATA), expected, window, reread)


@pytest.mark.parametrize("seed", range(5))
def test_ranges_in_any_order_hash_as_the_whole_file_without_a_second_read(seed: int) -> None:
    pieces = PIECES[:]
    random.Random(seed).shuffle(pieces)
    window = ReorderWindow(len(DATA))
    rereads: list[int] = []
    digest = sink(Expected("sha256", hashlib.sha256(DATA).hexdigest()), window, rereads)
    for offset, piece in pieces:
        digest.write(memoryview(piece), offset)
    digest.commit()
    assert rereads == [] and window.held == 0


def test_a_window_too_small_falls_back_to_reading_the_file_again() -> None:
    window = ReorderWindow(65536)  # room for one early range only
    rereads: list[int] = []
    digest = sink(Expected("sha256", hashlib.sha256(DATA).hexdigest()), window, rereads)
    for offset, piece in reversed(PIECES):
        digest.write(memoryview(piece), offset)
    digest.commit()
    assert rereads == [1] and window.held == 0


def test_a_copy_that_does_not_match_its_name_is_refused() -> None:
    expected = Expected("sha1", hashlib.sha1(b"blob 5\0hello").hexdigest(), b"blob 5\0")
    rereads: list[int] = []
    digest = DigestSink("blob", 5, expected, ReorderWindow(10), lambda: iter([b"hellO"]))
    digest.write(memoryview(b"hellO"), 0)
    with pytest.raises(FileError, match="does not match its name"):
        digest.commit()
    good = DigestSink("blob", 5, expected, ReorderWindow(10), lambda: iter(()))
    good.write(memoryview(b"hello"), 0)
    good.commit()
    assert rereads == []
