"""The copy a job publishes: assembled in a temp file beside its destination and
published with one ``rename``, so a reader sees either the old file or the complete new
one, never a mix. The copy is stamped with the source's mtime, which the current-copy
rule (:mod:`loaderplug.jobs.current_copy`) compares.

A destination may hold links someone else planted (a sync's is a shared mirror): every
open, rename and removal here reaches its folder without following a link below the
job's root (:mod:`loaderplug.storage.safe_paths`), opens the temp file with
``O_NOFOLLOW``, checks it is still the file this sink made, and checks its name again
just before the rename.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import mmap
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

from loaderplug.engine.spans import Landed
from loaderplug.errors import FileError
from loaderplug.jobs.current_copy import tag_version
from loaderplug.jobs.partial import Journal, is_partial_name, journal_for, partial_for
from loaderplug.storage.mounts import is_network_type
from loaderplug.storage.safe_paths import (
    LinkOnPath,
    guard_root,
    lstat_below,
    open_below,
    parent_below,
    sync_folder,
    unlink_below,
)
from loaderplug.types import Identity, IOPolicy

TEMP_SUFFIX = ".loaderplug-tmp"
log = logging.getLogger(__name__)


def temp_name_for(dst: Path) -> Path:
    # Hidden, unique per attempt, and recognisable, so a later run can sweep leftovers of
    # a killed one and tree walks can skip them.
    return dst.with_name(f".{dst.name}.{secrets.token_hex(6)}{TEMP_SUFFIX}")


def is_temp_name(name: str) -> bool:
    """A temp file, a partial copy or its journal: never part of a model."""
    return (name.startswith(".") and name.endswith(TEMP_SUFFIX)) or is_partial_name(name)


def temps_of(dst: Path) -> list[Path]:
    """What a killed run left for ``dst``: temp files, and its partial copy and journal
    (see :mod:`loaderplug.jobs.partial`), which the next run may resume."""
    temps = list(dst.parent.glob(f".{glob.escape(dst.name)}.*{TEMP_SUFFIX}"))
    return temps + [p for p in (partial_for(dst), journal_for(dst)) if p.exists()]


def file_sink(
    dst: Path,
    identity: Identity,
    target: IOPolicy,
    *,
    fsync: bool,
    mode: int = 0o644,
    resume: Landed | None = None,
    root: Path | None = None,
) -> FileSink:
    """The sink that publishes ``dst``, writing the way its filesystem (``target``)
    wants, journalling its durable spans (and with ``resume`` continuing a killed run's
    partial copy); below ``root`` (the job's destination) no link is followed."""
    return FileSink(
        dst,
        identity.size,
        identity.mtime_ns,
        fsync=fsync,
        mode=mode,
        identity=identity,
        resume=resume,
        # Direct writes in whole pages only: a buffered tail must never share a page
        # with another range's direct write.
        direct_alignment=max(target.alignment, mmap.PAGESIZE) if target.direct else 0,
        # On a network filesystem glibc would emulate fallocate with a write per block.
        preallocate=not is_network_type(target.fs_type),
        root=root,
        stable_inodes=target.stable_inodes,
    )


class FileSink:
    """Assembles ``dst`` in a preallocated temp file and renames it into place."""

    def __init__(
        self,
        dst: Path,
        size: int,
        mtime_ns: int,
        *,
        fsync: bool,
        mode: int = 0o644,
        direct_alignment: int = 0,
        preallocate: bool = True,
        identity: Identity | None = None,
        resume: Landed | None = None,
        root: Path | None = None,
        stable_inodes: bool = True,
    ) -> None:
        """``direct_alignment`` > 0 writes aligned ranges with O_DIRECT (local block
        filesystems): no page-cache copy, no dirty pages for the final fsync to flush.
        ``preallocate`` reserves the file's blocks before the first write. With the
        source's ``identity`` the copy keeps a journal of its durable spans, and with
        ``resume`` continues the partial copy a killed run left (see
        :mod:`loaderplug.jobs.partial`). Below ``root`` (by default ``dst``'s folder) no
        link is followed. Where the filesystem keeps inode numbers (``stable_inodes``)
        each reopen of the temp file must find the very inode this sink made."""
        self.dst = dst
        self.size = size
        self.mtime_ns = mtime_ns
        self.fsync = fsync
        self.mode = mode  # permission bits; the process's umask applies
        self.direct_alignment = direct_alignment
        self.preallocate = preallocate
        self.resume = resume
        # One writer per destination at a time (the job's lock): the name can be fixed,
        # so the next run finds what a killed one left.
        self.temp = partial_for(dst)
        self.root = guard_root(root, dst)
        # The temp file's (device, inode) once made or adopted: every later open must
        # find that very file under its name.
        self._made: tuple[int, int] | None = None
        self.stable_inodes = stable_inodes
        self.journal = Journal(dst, identity, fsync=fsync) if identity is not None else None
        self.etag = identity.etag if identity is not None else ""

    def prepare(self) -> None:
        if self.resume is not None:
            self._adopt()
            if self.journal is not None:
                self.journal.start(fresh=False)
            return
        try:
            with parent_below(self.root, self.temp, create=True) as (folder, name):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=folder)  # a partial nobody can resume
                if self.journal is not None:
                    # A fresh journal replaces any leftover: removed first, it is made
                    # anew, never opened through whatever stood under its name.
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.journal.path.name, dir_fd=folder)
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(name, flags, self.mode, dir_fd=folder)
        except (OSError, ValueError) as exc:
            raise self._error(f"cannot create {self.temp}", exc) from exc
        try:
            st = os.fstat(fd)
            self._made = (st.st_dev, st.st_ino)
            self._preallocate(fd)
            if self.journal is not None:
                self.journal.start(fresh=True)
        except OSError as exc:
            self.abort()
            what = f"cannot reserve {self.size} bytes in {self.dst.parent}"
            raise self._error(what, exc, "; free some space there or hydrate elsewhere") from exc
        finally:
            os.close(fd)

    def _adopt(self) -> None:
        """Take over a killed run's partial copy: a regular file, reached without a link."""
        try:
            fd = open_below(self.root, self.temp, os.O_RDONLY)
            assert fd is not None
            try:
                st = os.fstat(fd)
            finally:
                os.close(fd)
            # The journal is appended to: it must be a file of its own, not a link.
            kept = self.journal is None or stat.S_ISREG(
                lstat_below(self.root, self.journal.path).st_mode
            )
        except (OSError, ValueError) as exc:
            raise self._error(f"cannot reopen {self.temp}", exc) from exc
        if not stat.S_ISREG(st.st_mode) or not kept:
            raise FileError(
                f"{self.temp} or its journal is not a regular file; remove both to copy "
                f"{self.dst.name} afresh",
                path=str(self.dst),
            )
        self._made = (st.st_dev, st.st_ino)

    def _open(self, flags: int, *, direct: bool = False) -> int | None:
        """The temp file, opened with ``flags`` without following a link, and checked to
        be the one this sink made; None where direct IO is refused (``direct``)."""
        fd = open_below(self.root, self.temp, flags, direct=direct)
        if fd is not None:
            try:
                self._check_made(os.fstat(fd))
            except BaseException:
                os.close(fd)
                raise
        return fd

    def _check_made(self, st: os.stat_result) -> None:
        if self._made is None:
            pass
        elif self.stable_inodes:
            if (st.st_dev, st.st_ino) == self._made:
                return
        # A FUSE node id changes once the kernel forgets the inode: there the temp file
        # can only be told by being a file of its size on the same device.
        elif stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_size) == (self._made[0], self.size):
            return
        # Not a transient error: retrying a write would only find the same stranger.
        raise OSError(
            errno.EBUSY,
            f"{self.temp} is no longer the file this copy made (replaced while it was "
            f"written); nothing of it is published",
            str(self.temp),
        )

    def span_landed(self, offset: int, length: int) -> None:
        """Every byte of ``[offset, offset + length)`` is written: make it durable, then
        journal it."""
        if self.journal is None:
            return
        if self.fsync:
            fd = self._open(os.O_RDONLY)
            assert fd is not None
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        self.journal.record(offset, offset + length)

    def _error(self, what: str, exc: OSError | ValueError, advice: str = "") -> FileError:
        why = getattr(exc, "strerror", None) or exc
        return FileError(f"{what}: {why}{advice}", path=str(self.dst), errno=_errno(exc))

    def _preallocate(self, fd: int) -> None:
        # Reserving every block up front turns a full disk into one clear error before any
        # byte is read, instead of a failure halfway through a multi-GiB file.
        if self.size == 0:
            return
        if not self.preallocate:
            os.ftruncate(fd, self.size)
            return
        try:
            os.posix_fallocate(fd, 0, self.size)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            os.ftruncate(fd, self.size)

    def write(self, data: memoryview, offset: int) -> None:
        align = self.direct_alignment
        direct_part = len(data) // align * align if align and offset % align == 0 else 0
        if direct_part and not self._pwrite(data[:direct_part], offset, direct=True):
            # The kernel refused direct IO here (or the buffer is unaligned): write this
            # file through the page cache from now on.
            self.direct_alignment = direct_part = 0
        if direct_part < len(data):
            self._pwrite(data[direct_part:], offset + direct_part, direct=False)

    def _pwrite(self, data: memoryview, offset: int, *, direct: bool) -> bool:
        """Write ``data`` at ``offset``; False if direct IO was refused (nothing written)."""
        # Each write opens its own descriptor: no descriptor is shared between workers,
        # and no O_CREAT, so a write racing an abort cannot resurrect the temp file.
        fd = self._open(os.O_WRONLY, direct=direct)
        if fd is None:
            return False
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], offset + done)
            if self.fsync and not direct:
                # Start writeback of this range now, so the fsync before publishing
                # finds little left to flush instead of the whole file at once.
                os.posix_fadvise(fd, offset, len(data), os.POSIX_FADV_DONTNEED)
        except OSError as exc:
            if not (direct and exc.errno == errno.EINVAL):
                raise
            return False
        finally:
            os.close(fd)
        return True

    def blocks(self, size: int = 8 * 1024 * 1024) -> Iterator[bytes]:
        """The temp file's bytes, for a check that must read them again."""
        fd = self._open(os.O_RDONLY)
        assert fd is not None
        with open(fd, "rb", buffering=0) as f:
            while block := f.read(size):
                yield block

    def commit(self) -> None:
        with parent_below(self.root, self.dst) as (folder, name):
            temp = self.temp.name
            fd = os.open(temp, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder)
            try:
                self._check_made(os.fstat(fd))
                os.utime(fd, ns=(self.mtime_ns, self.mtime_ns))
                if self.etag:
                    tag_version(fd, self.etag)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            # The name may have been swapped since: it must still hold what was written.
            self._check_made(os.stat(temp, dir_fd=folder, follow_symlinks=False))
            os.replace(temp, name, src_dir_fd=folder, dst_dir_fd=folder)
            if self.journal is not None:
                self.journal.remove()
            if self.fsync:
                try:
                    sync_folder(folder)
                except OSError as exc:  # published already: say so, but not a failure
                    log.warning(
                        "%s is in place but its folder could not be fsync'd: %s", self.dst, exc
                    )

    def leave(self) -> None:
        """Stop writing, keeping the partial copy and its journal for a rerun to resume."""
        if self.journal is not None:
            self.journal.close()

    def abort(self) -> None:
        # Under a link there is nothing of this copy's: it was never created there.
        with contextlib.suppress(FileNotFoundError, NotADirectoryError, LinkOnPath, ValueError):
            unlink_below(self.root, self.temp)
        if self.journal is not None:
            self.journal.remove()


def _errno(exc: OSError | ValueError) -> int | None:
    return exc.errno if isinstance(exc, OSError) else None
