"""Small files and links replaced whole: a reader sees the old one or the new one, never
half of either.

Each is made aside under a hidden name the caller chooses (a loaderplug temp name where
a later run may sweep it, another where a copy running under the folder's lock must
not), made durable where asked, and renamed over its destination; with ``fsync`` the
folder is synced after the rename, so the rename itself survives a crash. The files a
job copies go through :class:`loaderplug.engine.sinks.FileSink`, which does the same with
preallocation and ranges.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

__all__ = ["fsync_dir", "replace_with_link", "write_atomically"]


def write_atomically(path: Path, data: str | bytes, *, temp: Path, fsync: bool) -> None:
    """Write ``data`` to ``path`` through ``temp`` (text as UTF-8)."""
    raw = data.encode() if isinstance(data, str) else data
    try:
        with open(temp, "wb") as f:
            f.write(raw)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def replace_with_link(path: Path, target: str, *, temp: Path) -> None:
    """Make ``path`` a symlink to ``target`` through ``temp`` (whatever was there goes)."""
    os.symlink(target, temp)
    try:
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise


def fsync_dir(path: Path) -> None:
    """Make the entries of folder ``path`` (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:  # some FUSE servers do not implement fsyncdir
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)
