"""Cross-process locks on what a job publishes: a destination folder, or single files.

Tensor-parallel ranks on one host all try to hydrate the same model at once. The first to
take the lock copies; the others wait, then find every file present and skip it. Ranks
that split a load between them lock the files they each publish instead, so they copy
side by side. flock is released by the kernel when a holder dies, so a killed job never
wedges the next.

A lock file lives where others may write (a shared mirror, a destination folder), so it
is opened without following a link and without blocking, and must be a regular file:
a link, a FIFO or a device at its name is an error at once, and the file it points to
is never opened. The holder's PID is written into it only where it is this user's own
small file with one name (a lock file as loaderplug writes it): a file that is someone
else's, or larger than any PID (:data:`PID_BYTES`), is locked as it is, never truncated.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from loaderplug.errors import LockError
from loaderplug.jobs.model_folder import LOCK_NAME, lock_name_for
from loaderplug.storage.state_files import UnsafeFile, open_or_create, open_regular

POLL_S = 0.05
# The most a lock file holds: the holder's PID. Anything larger was not written as one.
PID_BYTES = 64


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
        fd = open_lock_file(path)
        started = time.monotonic()
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() - started >= self.timeout_s:
                        holder = _holder(fd)
                        raise LockError(
                            f"{path} is still held by process {holder} after "
                            f"{self.timeout_s:g} s; wait for it, or raise LOADERPLUG_LOCK_TIMEOUT_S"
                        ) from None
                    time.sleep(POLL_S)
            if _ours_to_write(fd):
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


def open_lock_file(path: Path) -> int:
    """The lock file at ``path``, created if missing: a regular file, never reached
    through a link; a lock file this user may only read is locked read-only (flock needs
    no more). Anything else at its name is a :class:`LockError` naming it."""
    try:
        try:
            return open_or_create(path, os.O_RDWR)
        except PermissionError:
            return open_regular(path, os.O_RDONLY)
    except UnsafeFile as exc:
        raise LockError(
            f"{path}: {exc.strerror}; loaderplug's lock is a regular file of its own: "
            f"remove what is there and run the job again"
        ) from exc


def _ours_to_write(fd: int) -> bool:
    """Whether the PID may be written into the open lock file: this user's, one name,
    no larger than a PID, opened for writing."""
    st = os.fstat(fd)
    writable = fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
    return writable and st.st_uid == os.geteuid() and st.st_nlink == 1 and st.st_size <= PID_BYTES


def _holder(fd: int) -> str:
    """Who holds the lock, as its file says (a PID), for the message."""
    text = os.pread(fd, PID_BYTES, 0).decode(errors="replace").strip()
    return text if text.isdigit() else "?"
