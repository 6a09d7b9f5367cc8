"""The copy a job publishes: assembled in a temp file beside its destination and
published with one ``rename``, so a reader sees either the old file or the complete new
one, never a mix. The copy is stamped with the source's mtime, which the current-copy
rule (:mod:`loaderplug.jobs.current_copy`) compares.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import logging
import mmap
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from loaderplug.engine.spans import Landed
from loaderplug.errors import FileError
from loaderplug.jobs.partial import Journal, is_partial_name, journal_for, partial_for
from loaderplug.storage.files import fsync_dir, open_direct, sync_file
from loaderplug.storage.mounts import is_network_type
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
) -> FileSink:
    """The sink that publishes ``dst``, writing the way its filesystem (``target``)
    wants, journalling its durable spans (and with ``resume`` continuing a killed run's
    partial copy)."""
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
    ) -> None:
        """``direct_alignment`` > 0 writes aligned ranges with O_DIRECT (local block
        filesystems): no page-cache copy, no dirty pages for the final fsync to flush.
        ``preallocate`` reserves the file's blocks before the first write. With the
        source's ``identity`` the copy keeps a journal of its durable spans, and with
        ``resume`` continues the partial copy a killed run left (see
        :mod:`loaderplug.jobs.partial`)."""
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
        self.journal = Journal(dst, identity, fsync=fsync) if identity is not None else None

    def prepare(self) -> None:
        if self.resume is not None:
            if self.journal is not None:
                self.journal.start(fresh=False)
            return
        try:
            self.dst.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.temp)  # a partial nobody can resume
            fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self.mode)
        except OSError as exc:
            raise self._error(f"cannot create {self.temp}", exc) from exc
        try:
            self._preallocate(fd)
            if self.journal is not None:
                self.journal.start(fresh=True)
        except OSError as exc:
            self.abort()
            what = f"cannot reserve {self.size} bytes in {self.dst.parent}"
            raise self._error(what, exc, "; free some space there or hydrate elsewhere") from exc
        finally:
            os.close(fd)

    def span_landed(self, offset: int, length: int) -> None:
        """Every byte of ``[offset, offset + length)`` is written: make it durable, then
        journal it."""
        if self.journal is None:
            return
        if self.fsync:
            sync_file(self.temp, data_only=True)
        self.journal.record(offset, offset + length)

    def _error(self, what: str, exc: OSError, advice: str = "") -> FileError:
        return FileError(
            f"{what}: {exc.strerror or exc}{advice}", path=str(self.dst), errno=exc.errno
        )

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
        flags = os.O_WRONLY | os.O_CLOEXEC
        fd = open_direct(self.temp, flags) if direct else os.open(self.temp, flags)
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
        with open(self.temp, "rb", buffering=0) as f:
            while block := f.read(size):
                yield block

    def commit(self) -> None:
        os.utime(self.temp, ns=(self.mtime_ns, self.mtime_ns))
        if self.fsync:
            sync_file(self.temp)
        os.replace(self.temp, self.dst)
        if self.journal is not None:
            self.journal.remove()
        if self.fsync:
            try:
                fsync_dir(self.dst.parent)
            except OSError as exc:  # published already: say so, but it is not a failure
                log.warning("%s is in place but its folder could not be fsync'd: %s", self.dst, exc)

    def leave(self) -> None:
        """Stop writing, keeping the partial copy and its journal for a rerun to resume."""
        if self.journal is not None:
            self.journal.close()

    def abort(self) -> None:
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            os.unlink(self.temp)
        if self.journal is not None:
            self.journal.remove()
