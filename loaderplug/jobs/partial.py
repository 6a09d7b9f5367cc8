"""Copies that survive a kill: a partial file, and a journal of the ranges in it that are
durable, so the next run reads only the rest.

A copy is assembled in ``.NAME.loaderplug-partial`` beside its destination. Beside it,
``.NAME.loaderplug-landed`` starts with the identity of the source the copy is from
(size, mtime, inode) and gains a line ``begin end`` for each range once that range's
bytes are durable in the partial file (written, and with fsync on, ``fdatasync``'d
before the line is). A run killed mid-copy (SIGKILL, a lost worker) leaves both; the
next run that copies the same file, under the same lock, finds the journal, checks that
the source is still the same file, and resumes: the engine skips the ranges the journal
lists. A changed source, a partial of the wrong size or an unreadable journal starts
over. A copy that fails, or is stopped (Ctrl-C), removes both, as before.

Both names are fixed, in a folder others may write (a sync's is on the mirror), so
neither is ever reached through a link: a fresh journal is created new
(:func:`~loaderplug.storage.state_files.create_new`: whatever was at its name is
removed, never written through), a journal or partial copy is resumed only when it is
a regular file with one name, and a journal is read only up to a size its file's spans
could fill (:func:`journal_cap`); anything else is not resumed, and the copy starts over.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from loaderplug.engine.spans import Landed
from loaderplug.storage.state_files import UnsafeFile, create_new, open_regular, read_capped
from loaderplug.types import Identity
from loaderplug.units import KiB

PARTIAL_SUFFIX = ".loaderplug-partial"
JOURNAL_SUFFIX = ".loaderplug-landed"
# The journal's size cap: a line per span, two 20-digit numbers at most; spans are at
# least the smallest LOADERPLUG_SPAN_BYTES; a million lines (a 4 TiB file in 4 MiB
# spans) at most: a journal past that is not resumed, the copy starts over.
JOURNAL_LINE_BYTES = 42
SMALLEST_SPAN = 4 * KiB
MOST_JOURNAL_LINES = 1 << 20
# Whole lines only: the last one may be torn (killed mid-write).
_LINE = re.compile(rb"^([0-9]{1,20}) ([0-9]{1,20})\n", re.MULTILINE)
# Ranges parsed between two merges: bounds the memory a long journal takes to read.
_MERGE_EVERY = 1 << 16

T = TypeVar("T")


def partial_for(dst: Path) -> Path:
    return dst.with_name(f".{dst.name}{PARTIAL_SUFFIX}")


def open_copy(dst: Path, opener: Callable[[Path], T]) -> T:
    """``opener`` on where the bytes of the copy ``dst`` are while a job writes it: the
    partial copy or, once published (renamed into place), ``dst`` itself, the same pages
    either way. Raises ``dst``'s FileNotFoundError when neither is there, and any other
    error of the first as it is."""
    try:
        return opener(partial_for(dst))
    except FileNotFoundError:
        return opener(dst)


def journal_for(dst: Path) -> Path:
    return dst.with_name(f".{dst.name}{JOURNAL_SUFFIX}")


def is_partial_name(name: str) -> bool:
    return name.startswith(".") and name.endswith((PARTIAL_SUFFIX, JOURNAL_SUFFIX))


def _header(identity: Identity) -> str:
    fields: dict[str, object] = {
        "size": identity.size,
        "mtime_ns": identity.mtime_ns,
        "inode": identity.inode,
    }
    if identity.etag:  # an object's version
        fields["etag"] = identity.etag
    return json.dumps(fields) + "\n"


def journal_cap(size: int) -> int:
    """The most bytes the journal of a copy of a ``size``-byte file holds."""
    lines = min(size // SMALLEST_SPAN + 64, MOST_JOURNAL_LINES)
    return 4 * KiB + JOURNAL_LINE_BYTES * lines


def read_landed(dst: Path, identity: Identity) -> Landed | None:
    """What a killed copy of the file ``identity`` describes left at ``dst``, or None
    when there is nothing to resume (no journal, another source, a partial of the wrong
    size, either of them not a regular file of one name, a journal too long)."""
    try:
        raw, st = read_capped(journal_for(dst), journal_cap(identity.size), "a journal")
        partial = os.lstat(partial_for(dst))
    except OSError:  # UnsafeFile included: not resumed, and the copy starts over
        return None
    if not _one_regular_file(st) or not _one_regular_file(partial):
        return None
    first, newline, _ = raw.partition(b"\n")
    if first + newline != _header(identity).encode() or partial.st_size != identity.size:
        return None
    pairs: list[tuple[int, int]] = []
    for match in _LINE.finditer(raw, len(first) + 1):
        begin, end = int(match[1]), int(match[2])
        if end <= identity.size:
            pairs.append((begin, end))
        if len(pairs) >= _MERGE_EVERY:
            pairs = list(Landed.of(pairs).ranges)
    return Landed.of(pairs)


def _one_regular_file(st: os.stat_result) -> bool:
    # A second name would be a hard link someone made to a file of theirs (or of ours).
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1


class Journal:
    """The journal of one partial copy: started fresh, or continued on resume."""

    def __init__(self, dst: Path, identity: Identity, *, fsync: bool) -> None:
        self.path = journal_for(dst)
        self.identity = identity
        self.fsync = fsync
        self._lock = threading.Lock()
        self._fd = -1

    def start(self, *, fresh: bool) -> None:
        """Start a new journal (``fresh``: whatever was at its name is removed first), or
        continue the one :func:`read_landed` found, which must still be a regular file
        of one name (raises :class:`UnsafeFile` where it is not)."""
        flags = os.O_WRONLY | os.O_APPEND
        if not fresh:
            fd = open_regular(self.path, flags)
            if not _one_regular_file(os.fstat(fd)):
                os.close(fd)
                what = "a file with more than one name; it is not written"
                raise UnsafeFile(errno.EMLINK, what, str(self.path))
            self._fd = fd
            return
        self._fd = create_new(self.path, flags)
        os.write(self._fd, _header(self.identity).encode())
        if self.fsync:
            os.fdatasync(self._fd)

    def record(self, begin: int, end: int) -> None:
        """``[begin, end)`` is durable in the partial file (the caller made sure)."""
        with self._lock:
            if self._fd < 0:
                return
            os.write(self._fd, f"{begin} {end}\n".encode())
            if self.fsync:
                os.fdatasync(self._fd)

    def close(self) -> None:
        """Stop journalling, keeping the journal for the next run to resume from."""
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def remove(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            os.unlink(self.path)
