"""The spans a split load's engine reads from the hosts' exchange: each read answered as
soon as its span arrives, the feed's memory bounded, never a wait on each other."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from loaderplug.storage.source import PosixSource
from loaderplug.tensors.hosts.feed import ExchangeOpener, ExchangeSource, FeedClosed, SpanFeed
from loaderplug.types import IOPolicy

SPAN = 1024


@pytest.fixture
def mirror(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    path.write_bytes(bytes(range(256)) * (4 * SPAN // 256))
    return path


def source_of(feed: SpanFeed, path: Path) -> ExchangeSource:
    return ExchangeSource(feed, 0, PosixSource(str(path), IOPolicy.buffered("ext4", "test")))


def span(path: Path, index: int) -> memoryview:
    return memoryview(path.read_bytes()[index * SPAN : (index + 1) * SPAN])


def expecting(count: int, budget: int = 64 * SPAN) -> SpanFeed:
    feed = SpanFeed(budget=budget)
    feed.expected = {(0, i * SPAN): SPAN for i in range(count)}
    return feed


def test_a_read_waits_for_its_span_and_returns_the_moment_it_arrives(mirror: Path) -> None:
    feed = expecting(4)
    source = source_of(feed, mirror)
    got = bytearray(SPAN)
    done = threading.Event()

    def read() -> None:
        source.pread_into(memoryview(got), 2 * SPAN)
        done.set()

    reader = threading.Thread(target=read)
    reader.start()
    feed.put(0, 0, span(mirror, 0))  # another span: the read goes on waiting
    assert not done.wait(0.3)
    feed.put(0, 2 * SPAN, span(mirror, 2))
    assert done.wait(5)
    reader.join()
    assert bytes(got) == bytes(span(mirror, 2))
    assert feed.read_alone == 0  # nothing read from the mirror


def test_a_span_read_whole_leaves_the_feed(mirror: Path) -> None:
    feed = expecting(2)
    feed.put(0, 0, span(mirror, 0))
    assert feed.held_bytes == SPAN
    source = source_of(feed, mirror)
    half = bytearray(SPAN // 2)
    source.pread_into(memoryview(half), 0)
    assert feed.held_bytes == SPAN  # half of it is still to be read
    source.pread_into(memoryview(half), SPAN // 2)
    assert feed.held_bytes == 0 and bytes(half) == bytes(span(mirror, 0)[SPAN // 2 :])


def test_the_feed_holds_its_budget_and_the_span_a_read_waits_for_no_more(
    mirror: Path,
) -> None:
    """The exchange waits for room; a span that finds none while a read waits for
    another (the orders differ) is dropped and read from the mirror when the load comes
    to it; the span the read waits for is let in over the budget: never a deadlock."""
    feed = expecting(4, budget=2 * SPAN)
    feed.put(0, 0, span(mirror, 0))
    feed.put(0, SPAN, span(mirror, 1))
    third = threading.Thread(target=feed.put, args=(0, 2 * SPAN, span(mirror, 2)))
    third.start()
    third.join(0.3)
    assert third.is_alive() and feed.held_bytes == 2 * SPAN  # waits for room
    got = bytearray(SPAN)
    reader = threading.Thread(
        target=source_of(feed, mirror).pread_into, args=(memoryview(got), 3 * SPAN)
    )
    reader.start()  # waits for span 3, which the exchange brings after span 2
    third.join(5)
    assert not third.is_alive() and feed.dropped == 1 and feed.held_bytes == 2 * SPAN
    feed.put(0, 3 * SPAN, span(mirror, 3))  # the span the read waits for: let in
    reader.join(5)
    assert bytes(got) == bytes(span(mirror, 3)) and feed.peak_bytes == 3 * SPAN
    source_of(feed, mirror).pread_into(memoryview(got), 2 * SPAN)  # the dropped one
    assert bytes(got) == bytes(span(mirror, 2)) and feed.read_alone == SPAN


def test_a_span_read_past_its_header_leaves_the_feed(mirror: Path) -> None:
    """The header is read from what the exchange was told, not from the span: the
    span leaves the feed once the rest of it was read."""
    feed = expecting(2)
    feed.headers[0] = span(mirror, 0)[:100].tobytes()
    feed.put(0, 0, span(mirror, 0))
    got = bytearray(SPAN)
    source_of(feed, mirror).pread_into(memoryview(got), 0)
    assert bytes(got) == bytes(span(mirror, 0)) and feed.held_bytes == 0


def test_a_file_changed_since_the_hosts_agreed_on_it_is_refused(mirror: Path) -> None:
    from loaderplug.errors import FileError

    feed = expecting(4)
    feed.agreed[0] = (mirror.stat().st_size, mirror.stat().st_mtime_ns - 1)
    opener = ExchangeOpener(feed, {str(mirror): 0}, lambda p, policy: PosixSource(p, policy))
    with pytest.raises(FileError, match="changed since the hosts agreed on it"):
        opener(str(mirror), IOPolicy.buffered("ext4", "test"))


def test_what_the_exchange_will_not_bring_is_read_from_the_mirror(mirror: Path) -> None:
    feed = expecting(4)
    feed.expected.pop((0, SPAN))  # this host had it already, say
    got = bytearray(SPAN)
    source_of(feed, mirror).pread_into(memoryview(got), SPAN)
    assert bytes(got) == bytes(span(mirror, 1)) and feed.read_alone == SPAN
    feed.stop()  # the hosts stopped exchanging: the rest too
    source_of(feed, mirror).pread_into(memoryview(got), 3 * SPAN)
    assert bytes(got) == bytes(span(mirror, 3)) and feed.read_alone == 2 * SPAN


def test_a_header_is_read_from_what_the_exchange_was_told_and_starts_no_round(
    mirror: Path,
) -> None:
    feed = expecting(4)
    started = []
    feed.on_first_read = lambda: started.append(True)
    feed.headers[0] = b"\x01" * 100  # as another host read it: this mount may fail there
    got = bytearray(100)
    source_of(feed, mirror).pread_into(memoryview(got), 0)
    assert bytes(got) == b"\x01" * 100 and not started and feed.read_alone == 0
    feed.put(0, 0, span(mirror, 0))
    more = bytearray(200)
    source_of(feed, mirror).pread_into(memoryview(more), 0)
    assert started == [True]
    assert bytes(more) == b"\x01" * 100 + bytes(span(mirror, 0)[100:200])


@pytest.mark.parametrize("how", ["failed", "closed", "cancelled"])
def test_a_waiting_read_stops_when_the_exchange_fails_or_the_load_ends(
    mirror: Path, how: str
) -> None:
    feed = expecting(4)
    opener = ExchangeOpener(feed, {str(mirror): 0}, lambda p, policy: PosixSource(p, policy))
    source = opener(str(mirror), IOPolicy.buffered("ext4", "test"))
    raised: list[BaseException] = []

    def read() -> None:
        try:
            source.pread_into(memoryview(bytearray(SPAN)), 0)
        except FeedClosed as exc:
            raised.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    reader.join(0.2)
    assert reader.is_alive()
    if how == "failed":
        feed.fail(RuntimeError("host node-b stopped answering"))
    elif how == "closed":
        feed.close()
    else:
        opener.cancel()
    reader.join(5)
    assert not reader.is_alive() and len(raised) == 1
    assert getattr(raised[0], "resumable", False)  # what landed is kept for a rerun
    if how == "failed":
        assert "node-b" in str(raised[0])
