"""The spans the hosts' exchange brings, handed to this host's load as its source.

A load split across hosts runs as any load does on each host's leading rank (the
engine, its tensor sinks and, in a one pass, the local copy's sinks), but the engine's
reads of the mirror's files are answered by the exchange: a :class:`SpanFeed` keeps
each span this host read or received until the engine has read it, and an
:class:`ExchangeSource` per file answers the engine's ``pread_into`` from it, waiting
for a span still on its way. So a tensor is handed over as soon as its bytes are in
memory, from this host's mount or from another host, and the local copy is written
from the same bytes. Each file's header comes from what the exchange's owner read
before the rounds (this host's, or another host's where this mount failed there).

The feed holds at most its budget of bytes, and a span a read waits for besides: the
exchange waits for room while the load catches up, and lets in over the budget only the
span a read waits for. Where the two orders differ (a span read by another host after
a failure, a rerun resuming, the load waiting for a span that comes later), a span that
finds no room while a read waits for another is dropped, and the load reads it from the
mirror itself when it comes to it: memory stays bounded, and neither side waits on the
other forever. Spans the exchange will not bring (those the hosts stopped exchanging, a
file this host reads from its own copy, a span read once already) are read from the
mirror too, and counted (:attr:`SpanFeed.read_alone`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from loaderplug.errors import FileError, LoaderplugError
from loaderplug.types import Identity, IOPolicy, Source

# How often a wait for a span looks whether the load was cancelled or failed.
WAKE_S = 0.1


class FeedClosed(LoaderplugError):
    """The load ended (or the exchange failed) while a read waited for a span: what
    landed is good, and a partial copy is kept for the next run."""

    resumable = True


@dataclass
class _Span:
    data: memoryview
    left: int  # bytes not read by the engine yet


@dataclass
class SpanFeed:
    """Spans by (file index, offset) until the engine has read them.

    ``expected`` holds the spans the exchange is to bring this host, ``(file, offset) ->
    length``; a span the feed holds is removed once every byte of it past the header
    was read (the header is read from :attr:`headers`)."""

    budget: int
    expected: dict[tuple[int, int], int] = field(default_factory=dict)
    # Each file's bytes up to the end of its header, as a host read them: the load's
    # planning reads its headers from here, not from the mirror again.
    headers: dict[int, bytes] = field(default_factory=dict)
    # Each file's size and modification time as the hosts agreed on them: a file found
    # otherwise when the load opens it changed since, and fails.
    agreed: dict[int, tuple[int, int]] = field(default_factory=dict)
    # Called at the first read past a header: the load's planning is over, and the
    # exchange's reads no longer hold it up (set by the exchange's owner).
    on_first_read: Callable[[], None] | None = None
    held_bytes: int = 0
    peak_bytes: int = 0
    dropped: int = 0  # spans that found no room while a read waited for another
    error: BaseException | None = None
    read_alone: int = 0  # bytes the load read from the mirror itself
    closed: bool = False
    _spans: dict[tuple[int, int], _Span] = field(default_factory=dict)
    _wanted: dict[tuple[int, int], int] = field(default_factory=dict)  # reads waiting
    _mutex: threading.Lock = field(default_factory=threading.Lock)
    _arrived: threading.Condition = field(init=False)  # the reads wait on it
    _room: threading.Condition = field(init=False)  # the exchange waits on it

    def __post_init__(self) -> None:
        self._arrived = threading.Condition(self._mutex)
        self._room = threading.Condition(self._mutex)

    def _wake_all(self) -> None:
        self._arrived.notify_all()
        self._room.notify_all()

    # -- the exchange's side ------------------------------------------------------------

    def wants(self, file: int, offset: int) -> bool:
        return (file, offset) in self.expected

    def put(self, file: int, offset: int, data: memoryview) -> None:
        """Keep a span this host read or received (see above for when it waits, and
        when it drops the span)."""
        key = (file, offset)
        with self._mutex:
            if key not in self.expected or self.closed:
                return  # not this host's to load (or the load is over)
            left = len(data) - self._in_header(file, offset, len(data))
            while left > 0 and self.held_bytes and self.held_bytes + left > self.budget:
                if self.closed or key in self._wanted:
                    break
                if self._wanted:  # a read waits for another span: let the load read this
                    self.expected.pop(key)
                    self.dropped += 1
                    self._arrived.notify_all()
                    return
                self._room.wait(WAKE_S)
            self.expected.pop(key, None)
            if self.closed or left <= 0:
                return
            self._spans[key] = _Span(data, left)
            self.held_bytes += len(data)
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
            self._arrived.notify_all()

    def _in_header(self, file: int, offset: int, length: int) -> int:
        """How many of a span's bytes lie in its file's header (read from there)."""
        head = len(self.headers.get(file, b""))
        return max(0, min(head, offset + length) - offset)

    def stop(self) -> None:
        """The hosts stop exchanging: spans not brought by now are read from the mirror."""
        with self._mutex:
            self.expected.clear()
            self._wake_all()

    def fail(self, exc: BaseException) -> None:
        with self._mutex:
            if self.error is None:
                self.error = exc
            self._wake_all()

    def close(self) -> None:
        """The load is over: nothing more is kept, and every waiting read stops."""
        with self._mutex:
            self.closed = True
            self._spans.clear()
            self.held_bytes = 0
            self._wake_all()

    # -- the engine's side --------------------------------------------------------------

    def read_into(self, file: int, buf: memoryview, offset: int) -> int | None:
        """Copy what the feed holds of ``buf``'s range (waiting for a span on its way):
        the bytes copied, or None where the exchange will not bring them."""
        with self._mutex:
            while True:
                found = self._holding(file, offset)
                if found is not None:
                    return self._copy(found, buf, offset)
                if self.error is not None:
                    raise FeedClosed(f"the hosts' exchange failed: {self.error}") from self.error
                if self.closed:
                    raise FeedClosed("the load ended while a read waited for the hosts' exchange")
                coming = self._coming(file, offset)
                if coming is None:
                    return None
                self._wait_for(coming)

    def _wait_for(self, key: tuple[int, int]) -> None:
        """Wait a moment for span ``key``, the exchange told a read waits for it."""
        self._wanted[key] = self._wanted.get(key, 0) + 1
        self._room.notify_all()  # an exchange waiting for room lets it in
        try:
            self._arrived.wait(WAKE_S)
        finally:
            self._wanted[key] -= 1
            if not self._wanted[key]:
                del self._wanted[key]

    def reading(self) -> None:
        """A read past a header: the rounds begin, if they have not."""
        with self._mutex:
            first, self.on_first_read = self.on_first_read, None
        if first is not None:
            first()

    def count_alone(self, n: int) -> None:
        with self._mutex:
            self.read_alone += n

    def _holding(self, file: int, offset: int) -> tuple[int, int] | None:
        if (file, offset) in self._spans:  # a read at a span's start: most of them
            return (file, offset)
        for key, span in self._spans.items():
            if key[0] == file and key[1] <= offset < key[1] + len(span.data):
                return key
        return None

    def _coming(self, file: int, offset: int) -> tuple[int, int] | None:
        """The span on its way that holds byte ``offset`` of ``file``, if any."""
        if (file, offset) in self.expected:
            return (file, offset)
        for key, length in self.expected.items():
            if key[0] == file and key[1] <= offset < key[1] + length:
                return key
        return None

    def _copy(self, key: tuple[int, int], buf: memoryview, offset: int) -> int:
        span = self._spans[key]
        start = offset - key[1]
        n = min(len(buf), len(span.data) - start)
        buf[:n] = span.data[start : start + n]
        span.left -= n - self._in_header(key[0], offset, n)
        if span.left <= 0:  # read whole (a range read again is read from the mirror)
            del self._spans[key]
            self.held_bytes -= len(span.data)
            self._room.notify_all()
        return n


class ExchangeSource:
    """A mirror file as the engine of a split load reads it: from the feed, or from the
    mirror (through ``real``, the source loaderplug would open) where the exchange will
    not bring the bytes. Its identity is the mirror file's."""

    def __init__(self, feed: SpanFeed, file: int, real: Source) -> None:
        self.feed, self.file, self.real = feed, file, real
        self.size = real.identity().size

    def identity(self) -> Identity:
        return self.real.identity()

    def pread_into(self, buf: memoryview, offset: int) -> int:
        head = self.feed.headers.get(self.file, b"")
        done = min(len(buf), max(0, len(head) - offset))
        if done:  # the header, as the exchange's owner read it (or another host did)
            buf[:done] = head[offset : offset + done]
        if done < len(buf) and offset + done < self.size:
            self.feed.reading()
        while done < len(buf) and offset + done < self.size:
            got = self.feed.read_into(self.file, buf[done:], offset + done)
            if got is None:  # not on its way: this host reads it itself
                got = self.real.pread_into(buf[done:], offset + done)
                self.feed.count_alone(got)
                if got == 0:
                    break
            done += got
        return done

    def close(self) -> None:
        self.real.close()


class ExchangeOpener:
    """The opener a split load's engine reads through: a file of the exchange (by its
    path) is an :class:`ExchangeSource`; any other (a current local copy) as usual."""

    def __init__(
        self,
        feed: SpanFeed,
        files: dict[str, int],
        opener: Callable[[str, IOPolicy], Any],
    ) -> None:
        self.feed, self.files, self.opener = feed, files, opener

    def __call__(self, path: str, policy: IOPolicy) -> Source:
        real = self.opener(path, policy)
        index = self.files.get(path)
        if index is None:
            return real  # type: ignore[no-any-return]
        now = real.identity()
        if index in self.feed.agreed and (now.size, now.mtime_ns) != self.feed.agreed[index]:
            real.close()
            raise FileError(
                f"{path} changed since the hosts agreed on it (now {now.describe()}); "
                f"nothing of it was published: run again once the mirror is settled",
                path=path,
            )
        return ExchangeSource(self.feed, index, real)

    def cancel(self) -> None:
        """The engine was cancelled: its reads waiting for a span stop."""
        self.feed.close()
