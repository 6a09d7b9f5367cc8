"""Checking a copy's content hash in the same pass as the copy.

A Hub blob is named by the hash of its content; a copy that does not match its name is
corrupt and must never be published. Re-reading each finished file to hash it would
read every byte twice. :class:`DigestSink` hashes the bytes as they land instead: ranges
arrive in any order, so the sink hashes what continues the bytes hashed so far and keeps
the ranges that arrive early, copied, in a reorder window bounded for the whole job
(:class:`ReorderWindow`). A file whose early ranges do not fit (a range far behind the
others) is hashed once more from its temp file at the end, as before: slower, never
wrong. The check runs before the file is published; a mismatch fails the file.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from loaderplug.errors import FileError


@dataclass(frozen=True)
class Expected:
    """What a file must hash to: ``algorithm`` over ``prefix`` then the content."""

    algorithm: str  # a hashlib name: sha256, sha1
    hexdigest: str
    prefix: bytes = b""


class ReorderWindow:
    """The bytes every digest sink of a job may keep aside, taken without waiting."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self.held + nbytes > self.limit:
                return False
            self.held += nbytes
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes


class DigestSink:
    """Hashes one file's bytes in order as they land; :meth:`commit` compares."""

    def __init__(
        self,
        rel: str,
        size: int,
        expected: Expected,
        window: ReorderWindow,
        reread: Callable[[], Iterator[bytes]],
    ) -> None:
        self.rel = rel
        self.size = size
        self.expected = expected
        self.window = window
        self.reread = reread  # the file's bytes again, from its temp file
        self._lock = threading.Lock()
        self._hash = hashlib.new(expected.algorithm, expected.prefix)
        self._next = 0  # bytes hashed so far
        self._early: dict[int, bytes] = {}  # offset -> a range that arrived early
        self._kept = 0
        self._behind = False  # the window overflowed: hash from the temp file at commit

    def prepare(self) -> None:
        pass

    def write(self, data: memoryview, offset: int) -> None:
        with self._lock:
            if self._behind or offset + len(data) <= self._next:
                return
            if offset > self._next:
                if self.window.take(len(data)):
                    self._early[offset] = bytes(data)
                    self._kept += len(data)
                else:
                    self._fall_behind()
                return
            self._hash.update(data[self._next - offset :])
            self._next = offset + len(data)
            while self._next in self._early:
                piece = self._early.pop(self._next)
                self._hash.update(piece)
                self._next += len(piece)
                self._drop(len(piece))

    def _fall_behind(self) -> None:
        self._behind = True
        self._early.clear()
        self._drop(self._kept)

    def _drop(self, nbytes: int) -> None:
        self._kept -= nbytes
        self.window.give(nbytes)

    def commit(self) -> None:
        with self._lock:
            whole = not self._behind and self._next == self.size
            digest = self._hash.hexdigest() if whole else None
            self._fall_behind()
        if digest is None:
            again = hashlib.new(self.expected.algorithm, self.expected.prefix)
            for block in self.reread():
                again.update(block)
            digest = again.hexdigest()
        if digest != self.expected.hexdigest:
            raise FileError(
                f"{self.rel}: the mirror's copy does not match its name (content hash "
                f"{digest}); it is corrupt and is not used",
                path=self.rel,
            )

    def abort(self) -> None:
        with self._lock:
            self._fall_behind()
