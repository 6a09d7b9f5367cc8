"""The file idioms, each written once: small files and links replaced whole, files and
folders made durable, and opens with O_DIRECT that fall back when the kernel refuses.

A small file or link is made aside under a hidden name the caller chooses (a loaderplug
temp name where a later run may sweep it, another where a copy running under the
folder's lock must not), made durable where asked, and renamed over its destination;
with ``fsync`` the folder is synced after the rename, so the rename itself survives a
crash: a reader sees the old one or the new one, never half of either. The file aside
is created new and written, synced and renamed through the descriptor it was created
with (:mod:`loaderplug.storage.state_files`): a link or a FIFO planted at its name is
removed, never written through. The files a job copies go through
:class:`loaderplug.jobs.file_sink.FileSink`, which does the same with preallocation and
ranges.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from loaderplug.storage.state_files import create_new, open_regular, replace_checked

__all__ = ["fsync_dir", "open_direct", "replace_with_link", "sync_file", "write_atomically"]


def write_atomically(path: Path, data: str | bytes, *, temp: Path, fsync: bool) -> None:
    """Write ``data`` to ``path`` through ``temp`` (text as UTF-8)."""
    raw = memoryview(data.encode() if isinstance(data, str) else data)
    fd = create_new(temp, mode=0o666)  # as open() makes a file: the umask decides
    try:
        done = 0
        while done < len(raw):
            done += os.write(fd, raw[done:])
        if fsync:
            os.fsync(fd)
        replace_checked(fd, temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
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


def sync_file(path: Path, *, data_only: bool = False) -> None:
    """Make ``path``'s bytes durable (with ``data_only``, ``fdatasync``: its size and
    bytes, not its other metadata). Never through a link, never a FIFO."""
    fd = open_regular(path)
    try:
        (os.fdatasync if data_only else os.fsync)(fd)
    finally:
        os.close(fd)


def open_direct(path: str | Path, flags: int) -> int | None:
    """``path`` opened with ``flags`` and O_DIRECT; None where the kernel refuses direct
    IO for it (EINVAL: tmpfs, some FUSE servers), for the caller to open it buffered."""
    if not hasattr(os, "O_DIRECT"):
        return None
    try:
        return os.open(path, flags | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return None
