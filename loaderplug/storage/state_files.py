"""The files loaderplug keeps for itself (locks, journals, sync marks, manifests, partial
and temp files), made so that nobody else's file can stand in for one.

Where these files live (a shared mirror, a destination another process can write) anyone
may have put something at their names first: a symbolic link to a file of the user's, a
FIFO that blocks whoever opens it, a device that never ends. So:

* A state file is **created new** (:func:`create_new`): ``O_CREAT | O_EXCL | O_NOFOLLOW``,
  after removing whatever a killed run left at its name (removing a link removes the
  link, never its target). Nothing is ever written through a name that was there before.
* It is written, synced and timed through the descriptor it was created with, and
  renamed into place only once its name is seen to still give that file (``fstat``
  against ``lstat``: :func:`replace_checked`).
* A state file is **read** (:func:`read_capped`) without following a link and without
  blocking (``O_NOFOLLOW | O_NONBLOCK``), only when ``fstat`` says it is a regular file,
  and only up to a size cap each kind documents where it is read: a reader's memory is
  bounded by the cap, not by what was planted.

What is not a regular file where one belongs raises :class:`UnsafeFile` at once, an
``OSError`` that never counts as transient: a retry cannot cure it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat

__all__ = [
    "UnsafeFile",
    "create_new",
    "open_or_create",
    "open_regular",
    "read_capped",
    "replace_checked",
]

StrPath = str | os.PathLike[str]


class UnsafeFile(OSError):
    """Where loaderplug expects a regular file of its own there is something it must not
    use: a symbolic link, a FIFO, a socket, a device, a folder, a file over its size cap,
    or another file than the one it created."""


def _what(mode: int) -> tuple[int, str]:
    """The errno and the words for a file of ``mode`` that is not a regular file."""
    if stat.S_ISLNK(mode):
        return errno.ELOOP, "a symbolic link"
    if stat.S_ISDIR(mode):
        return errno.EISDIR, "a folder"
    if stat.S_ISFIFO(mode):
        return errno.ESPIPE, "a FIFO"
    if stat.S_ISSOCK(mode):
        return errno.ESPIPE, "a socket"
    return errno.ENODEV, "a device"


def not_regular(path: StrPath, mode: int) -> UnsafeFile:
    code, what = _what(mode)
    return UnsafeFile(code, f"{what}, not a regular file; it is not followed or read", str(path))


def open_regular(path: StrPath, flags: int = os.O_RDONLY, *, follow: bool = False) -> int:
    """``path`` opened with ``flags`` once it is seen to be a regular file: without
    following a last link (unless ``follow``: a source on a mirror may be one) and without
    blocking, so a FIFO or a device fails here instead of hanging the caller. The
    descriptor is returned blocking again (as reads of a regular file expect)."""
    # Looked at before the open, so that a device is refused without being opened (an
    # open alone may act on one); checked again through the descriptor after it, so a
    # swap between the two is caught as well.
    st = os.stat(path) if follow else os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise not_regular(path, st.st_mode)
    nofollow = 0 if follow else os.O_NOFOLLOW
    try:
        fd = os.open(path, flags | nofollow | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:  # became a link since the look
            raise not_regular(path, stat.S_IFLNK) from exc
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(path, mode)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_capped(path: StrPath, cap: int, what: str) -> tuple[bytes, os.stat_result]:
    """The bytes of the regular file ``path`` (see :func:`open_regular`; never through a
    link) and its ``fstat``; raises :class:`UnsafeFile` where it holds more than ``cap``
    bytes (``what`` names it in the message: "a sync mark"), even if it grows while read."""
    fd = open_regular(path)
    try:
        st = os.fstat(fd)
        if st.st_size > cap:
            raise _too_large(path, f"{st.st_size} bytes", cap, what)
        chunks = []
        got = 0
        while got <= cap:
            chunk = os.read(fd, cap + 1 - got)
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
        if got > cap:
            raise _too_large(path, f"grown past {cap} bytes while read", cap, what)
        return b"".join(chunks), st
    finally:
        os.close(fd)


def _too_large(path: StrPath, size: str, cap: int, what: str) -> UnsafeFile:
    return UnsafeFile(
        errno.EFBIG,
        f"{size}, larger than {what} can be ({cap} bytes at most); it is not read",
        str(path),
    )


def create_new(path: StrPath, flags: int = os.O_WRONLY, mode: int = 0o644) -> int:
    """A new, empty file at ``path``, opened with ``flags``: whatever was at the name (a
    leftover of a killed run, or something planted there) is removed first, and the file
    is created ``O_EXCL | O_NOFOLLOW``, so the descriptor is of a file this call made."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)  # a link is removed itself; a folder raises (never ours to remove)
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)


def open_or_create(path: StrPath, flags: int = os.O_RDWR, mode: int = 0o644) -> int:
    """The regular file at ``path`` opened with ``flags`` (see :func:`open_regular`), or
    a new one made there where there is none: a lock file, which many processes open and
    none may replace. A link planted at its name fails as a link, its target untouched."""
    try:
        return open_regular(path, flags)
    except FileNotFoundError:
        pass
    try:
        return os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except FileExistsError:
        return open_regular(path, flags)  # another process made it meanwhile, or a link
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return open_regular(path, flags)  # says what is there
        raise


def same_file(fd: int, path: StrPath) -> bool:
    """Whether ``path`` (its last link not followed) names the file open as ``fd``: the
    same device and inode or, as some FUSE servers give a name a new inode number at
    each look, a regular file of the same device, size and mtime (what a swap would
    have to forge, and could only write at a name its author may write anyway)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_dev != mine.st_dev:
        return False
    return st.st_ino == mine.st_ino or (st.st_size, st.st_mtime_ns) == (
        mine.st_size,
        mine.st_mtime_ns,
    )


def _replaced(path: StrPath) -> UnsafeFile:
    return UnsafeFile(
        errno.EBUSY,
        "replaced by another file while loaderplug wrote it; it is not used",
        str(path),
    )


def replace_checked(fd: int, temp: StrPath, dst: StrPath) -> None:
    """Rename ``temp`` over ``dst`` once ``temp`` is seen to still be the file open as
    ``fd`` (the one written), not another put at its name meanwhile."""
    if not same_file(fd, temp):
        raise _replaced(temp)
    os.replace(temp, dst)
