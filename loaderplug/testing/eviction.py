"""Memory pressure on demand: the kernel's dentry and inode caches dropped on a period.

A host loading a large model keeps its page cache full, and the kernel then forgets
inodes and dentries it no longer holds open; on a FUSE mount whose filesystem has no
inode numbers of its own, a forgotten file comes back with a new one. `evicting` makes
that happen every `period_s`, as root can (``/proc/sys/vm/drop_caches``).
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["DROP_CACHES", "evicting", "eviction_unavailable_reason"]

DROP_CACHES = "/proc/sys/vm/drop_caches"
# 2: reclaimable slab objects (dentries and inodes); 3 adds the page cache.
DENTRIES_AND_INODES = "2"


@functools.cache
def eviction_unavailable_reason() -> str | None:
    """Why the caches cannot be dropped here, or None if they can."""
    if not os.path.exists(DROP_CACHES):
        return f"{DROP_CACHES} does not exist"
    if not os.access(DROP_CACHES, os.W_OK):
        return f"{DROP_CACHES} is not writable (dropping the kernel's caches needs root)"
    try:
        _drop(DENTRIES_AND_INODES)
    except OSError as e:
        return f"cannot write {DROP_CACHES}: {e}"
    return None


def _drop(what: str) -> None:
    with open(DROP_CACHES, "w") as f:
        f.write(what + "\n")


class Eviction:
    """The running eviction (yielded by `evicting`): how many drops so far."""

    def __init__(self) -> None:
        self.drops = 0


@contextmanager
def evicting(period_s: float = 0.1, what: str = DENTRIES_AND_INODES) -> Iterator[Eviction]:
    """Drop the kernel's caches every ``period_s`` for the ``with`` body."""
    reason = eviction_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"cannot evict the kernel's caches: {reason}")
    stop = threading.Event()
    eviction = Eviction()

    def run() -> None:
        while True:
            _drop(what)
            eviction.drops += 1
            if stop.wait(period_s):
                return

    thread = threading.Thread(target=run, name="evicting", daemon=True)
    thread.start()
    try:
        yield eviction
    finally:
        stop.set()
        thread.join()
