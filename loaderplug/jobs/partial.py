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
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from loaderplug.engine.spans import Landed
from loaderplug.types import Identity

PARTIAL_SUFFIX = ".loaderplug-partial"
JOURNAL_SUFFIX = ".loaderplug-landed"

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
    fields = {"size": identity.size, "mtime_ns": identity.mtime_ns, "inode": identity.inode}
    return json.dumps(fields) + "\n"


def read_landed(dst: Path, identity: Identity) -> Landed | None:
    """What a killed copy of the file ``identity`` describes left at ``dst``, or None
    when there is nothing to resume (no journal, another source, a partial of the wrong
    size)."""
    try:
        text = journal_for(dst).read_text(encoding="utf-8")
        size = os.stat(partial_for(dst)).st_size
    except (OSError, UnicodeDecodeError):
        return None
    first, _, rest = text.partition("\n")
    if first + "\n" != _header(identity) or size != identity.size:
        return None
    pairs = []
    for line in rest.split("\n"):
        parts = line.split()
        # The last line may be torn (killed mid-write): only whole lines count.
        if len(parts) == 2 and line.endswith(parts[1]) and all(p.isdigit() for p in parts):
            pairs.append((int(parts[0]), int(parts[1])))
    return Landed.of([(b, e) for b, e in pairs if e <= identity.size])


class Journal:
    """The journal of one partial copy: started fresh, or continued on resume."""

    def __init__(self, dst: Path, identity: Identity, *, fsync: bool) -> None:
        self.path = journal_for(dst)
        self.identity = identity
        self.fsync = fsync
        self._lock = threading.Lock()
        self._fd = -1

    def start(self, *, fresh: bool) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC
        self._fd = os.open(self.path, flags | (os.O_TRUNC if fresh else 0), 0o644)
        if fresh:
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
