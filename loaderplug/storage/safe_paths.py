"""Writing below a root without ever going through a symlink there.

A job writes only below its destination (a local copy, or a mirror's model folder for a
sync), and that tree may hold links a mirror handed it or someone planted. Every write
here descends from the root one folder at a time, each opened with ``O_NOFOLLOW`` (an
``openat`` walk, so a folder swapped for a link between a check and a write is still
caught): a folder on the way that is a symlink is refused with :class:`LinkOnPath`, the
final name is opened with ``O_NOFOLLOW`` too, and creating, renaming and removing happen
relative to the folder's descriptor. The root itself is the caller's path and is
followed like any path a user gives (``/models`` may well be a link to a local disk).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "LinkOnPath",
    "folder_below",
    "guard_root",
    "is_link_at",
    "lstat_below",
    "make_folders",
    "open_below",
    "parent_below",
    "sync_folder",
    "unlink_below",
]

# O_PATH: a folder is walked through, never read, so it needs no read permission.
_WALK = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC


class LinkOnPath(OSError):
    """A symlink below a root where loaderplug would write through it."""

    def __init__(self, root: Path, rel: str) -> None:
        super().__init__(
            errno.ELOOP,
            f"{rel} is a symlink inside {root}; loaderplug never writes through a link "
            f"there: remove it",
            str(root / rel),
        )


def guard_root(root: Path | None, path: Path) -> Path:
    """The folder below which ``path`` is written without following links: ``root``
    when ``path`` is below it, else ``path``'s own folder (only its name is guarded)."""
    if root is not None and root != path and path.is_relative_to(root):
        return root
    return path.parent


def _names(root: Path, path: Path) -> list[str]:
    names = list(path.relative_to(root).parts)
    if any(name in ("", ".", "..") for name in names):
        raise ValueError(f"{path} is not a plain path below {root}")
    return names


def is_link_at(fd: int, name: str) -> bool:
    """Whether ``name`` in the folder ``fd`` is a symlink (False where it is missing)."""
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _step(root: Path, fd: int, names: list[str], i: int, create: bool) -> int:
    """The descriptor of folder ``names[i]`` in ``fd``, made first with ``create``."""
    name = names[i]
    try:
        return os.open(name, _WALK | os.O_NOFOLLOW, dir_fd=fd)
    except FileNotFoundError:
        if not create:
            raise
    except OSError as exc:
        # O_NOFOLLOW with O_DIRECTORY answers ELOOP or ENOTDIR for a link.
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and is_link_at(fd, name):
            raise LinkOnPath(root, "/".join(names[: i + 1])) from exc
        raise
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o777, dir_fd=fd)
    return _step(root, fd, names, i, create=False)  # a link raced in is refused here


@contextlib.contextmanager
def folder_below(root: Path, path: Path, *, create: bool = False) -> Iterator[int]:
    """A descriptor of the folder ``path`` below ``root``, reached without following a
    link below ``root``; with ``create`` the missing folders are made on the way."""
    names = _names(root, path)
    if create:
        root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root, _WALK)
    try:
        for i in range(len(names)):
            nxt = _step(root, fd, names, i, create)
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def parent_below(root: Path, path: Path, *, create: bool = False) -> Iterator[tuple[int, str]]:
    """The descriptor of ``path``'s folder (as :func:`folder_below`) and its name there."""
    if path == root or not path.name:
        raise ValueError(f"{path} names no entry below {root}")
    with folder_below(root, path.parent, create=create) as fd:
        yield fd, path.name


def open_below(
    root: Path, path: Path, flags: int, mode: int = 0o644, *, direct: bool = False
) -> int | None:
    """``path`` opened with ``flags`` and ``O_NOFOLLOW``, reached as
    :func:`folder_below` reaches a folder. With ``direct`` also ``O_DIRECT``, and None
    where the kernel refuses direct IO for it (EINVAL: tmpfs, some FUSE servers)."""
    if direct and not hasattr(os, "O_DIRECT"):
        return None
    extra = os.O_DIRECT if direct else 0
    with parent_below(root, path) as (fd, name):
        try:
            return os.open(name, flags | extra | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP and is_link_at(fd, name):
                raise LinkOnPath(root, path.relative_to(root).as_posix()) from exc
            if direct and exc.errno == errno.EINVAL:
                return None
            raise


def make_folders(root: Path, path: Path) -> None:
    """Make the folder ``path`` and those on the way to it below ``root``."""
    with folder_below(root, path, create=True):
        pass


def unlink_below(root: Path, path: Path) -> None:
    """Remove the entry ``path`` (a link itself, never what it points at)."""
    with parent_below(root, path) as (fd, name):
        os.unlink(name, dir_fd=fd)


def lstat_below(root: Path, path: Path) -> os.stat_result:
    """``path``'s own status (a link's, not its target's), reached as :func:`folder_below`."""
    with parent_below(root, path) as (fd, name):
        return os.stat(name, dir_fd=fd, follow_symlinks=False)


def sync_folder(fd: int) -> None:
    """Make the entries of the folder ``fd`` (a walk's descriptor) durable."""
    folder = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
    try:
        os.fsync(folder)
    except OSError as exc:  # some FUSE servers do not implement fsyncdir
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
            raise
    finally:
        os.close(folder)
