"""A file held open while a load uses it, known by the identity it had when opened.

A load reads a file's header when it plans and its tensors later, when the consumer
comes to them. A file reopened by its name then may be another one: a download, ``git``
or ``rsync`` lands a new version by renaming it over the old, and the old header's
offsets cut the new file's bytes into tensors neither version holds. So a file whose
tensors are mapped is opened once, its identity (device, inode, size, mtime, ctime)
compared with the one its header was read under, and every later use goes through that
descriptor: a rename over the name leaves the load the version whose header it read, as
safetensors has from the descriptor it parsed. A change to the open file itself (a
truncation, a rewrite in place) is told by :meth:`HeldFile.check`.
"""

from __future__ import annotations

import os

from loaderplug.errors import FileError
from loaderplug.types import Identity


class HeldFile:
    """``path`` open read-only as ``fd``, with the identity it had when opened."""

    def __init__(self, path: str, fd: int, identity: Identity, *, stable_inodes: bool) -> None:
        self.path = path
        self.fd = fd
        self.identity = identity
        self._stable_inodes = stable_inodes
        # The identity's fields as fstat gives them: a check of a file that did not
        # change compares them, and makes no Identity.
        self._stat = (
            identity.size,
            identity.mtime_ns,
            identity.inode,
            identity.device,
            identity.ctime_ns,
        )

    @staticmethod
    def open(
        path: str, expected: Identity | None = None, *, stable_inodes: bool = True
    ) -> HeldFile:
        """Open ``path``; with ``expected`` (the identity its header was read under),
        a file that is no longer that one fails here, naming what changed."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise FileError(
                f"{path}: cannot open it: {exc.strerror or exc}", path=path, errno=exc.errno
            ) from exc
        held = HeldFile(path, fd, Identity.of(os.fstat(fd)), stable_inodes=stable_inodes)
        if expected is not None and not held.identity.matches(expected, inode=stable_inodes):
            held.close()
            raise FileError(
                f"{path}: replaced since its header was read (was {expected.describe()}, "
                f"now {held.identity.describe()}); load it again once it holds still",
                path=path,
            )
        return held

    def check(self, when: str) -> None:
        """Fail if the open file changed since it was opened (``when``: in which part of
        the load, for the message): truncated, grown or rewritten in place."""
        st = os.fstat(self.fd)
        if (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev, st.st_ctime_ns) == self._stat:
            return  # every field the same: whatever matches compares, it matches
        now = Identity.of(st)
        if not now.matches(self.identity, inode=self._stable_inodes):
            raise FileError(
                f"{self.path}: changed {when} (was {self.identity.describe()}, now "
                f"{now.describe()}); load it again once it holds still",
                path=self.path,
            )

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        self.close()
