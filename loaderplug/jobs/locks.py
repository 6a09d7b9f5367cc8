"""Cross-process locks on what a job publishes: a destination folder, or single files.

Tensor-parallel ranks on one host all try to hydrate the same model at once. The first to
take the lock copies; the others wait, then find every file present and skip it. Ranks
that split a load between them lock the files they each publish instead, so they copy
side by side. flock is released by the kernel when a holder dies, so a killed job never
wedges the next.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from loaderplug.errors import LockError
from loaderplug.jobs.model_folder import LOCK_NAME, lock_name_for

POLL_S = 0.05


def folder_lock(folder: Path) -> Path:
    """The lock file of a whole folder."""
    return folder / LOCK_NAME


def file_lock(path: Path) -> Path:
    """The lock file of one file (beside it)."""
    return path.with_name(lock_name_for(path.name))


class Lock:
    """An exclusive lock held on the lock file ``path``."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._fd = -1

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def acquire(self) -> float:
        """Take the lock, polling so Ctrl-C stays responsive; returns the seconds waited."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        path = self.path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        started = time.monotonic()
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() - started >= self.timeout_s:
                        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                        raise LockError(
                            f"{path} is still held by process {holder} after "
                            f"{self.timeout_s:g} s; wait for it, or raise LOADERPLUG_LOCK_TIMEOUT_S"
                        ) from None
                    time.sleep(POLL_S)
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(os.getpid()).encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return time.monotonic() - started

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # closing releases the flock
            self._fd = -1
