"""A cross-process lock on a destination folder.

Tensor-parallel ranks on one host all try to hydrate the same model at once. The first to
take the lock copies; the others wait, then find every file present and skip it. flock
is released by the kernel when a holder dies, so a killed hydrate never wedges the next.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from loaderplug.errors import LockError
from loaderplug.tree import LOCK_NAME

POLL_S = 0.05


@contextmanager
def locked(folder: Path, timeout_s: float) -> Iterator[float]:
    """Hold an exclusive lock on ``folder``; yields the seconds spent waiting for it."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    started = time.monotonic()
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                # Polling, not a blocking flock, so Ctrl-C stays responsive.
                if time.monotonic() - started >= timeout_s:
                    holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                    raise LockError(
                        f"{path} is still held by process {holder} after {timeout_s:g} s; "
                        f"wait for it, or raise LOADERPLUG_LOCK_TIMEOUT_S"
                    ) from None
                time.sleep(POLL_S)
        waited = time.monotonic() - started
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield waited
    finally:
        os.close(fd)  # closing releases the flock
