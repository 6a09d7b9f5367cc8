"""Reading a safetensors header: its length, then the header itself, two small reads.

Every header loaderplug reads comes through here, from an open source (a load's file,
under its IO policy) or from a plain file (one another rank has just read); parsing and
validation are :mod:`loaderplug.tensors.format.header`'s.
"""

from __future__ import annotations

import os
from pathlib import Path

from loaderplug.errors import FormatError
from loaderplug.tensors.format.header import LENGTH_BYTES, Header, header_length, parse_header
from loaderplug.types import Source


def read_header(source: Source, path: str) -> Header:
    """Read and validate the header of an open source."""
    size = source.size
    first = bytearray(min(size, LENGTH_BYTES))
    got = source.pread_into(memoryview(first), 0)
    n = header_length(path, bytes(first[:got]), size)
    raw = bytearray(n)
    if source.pread_into(memoryview(raw), LENGTH_BYTES) < n:
        raise FormatError(f"{path}: file ended inside its header")
    return parse_header(path, bytes(raw), size)


def read_header_of(path: Path, fd: int | None = None) -> Header:
    """Read and validate the header of the file at ``path`` (buffered: it is expected in
    the page cache), or with ``fd`` of that file open there (by its descriptor, so the
    header is the file's that is then mapped)."""
    if fd is not None:
        return _header_of_fd(str(path), fd)
    with open(path, "rb", buffering=0) as f:
        return _header_of_fd(str(path), f.fileno())


def _header_of_fd(path: str, fd: int) -> Header:
    return header_of_fd(path, fd, os.fstat(fd).st_size)


# Read with the header's length: the whole header of most files, in one read.
FIRST_READ = 16 * 1024


def header_of_fd(path: str, fd: int, size: int) -> Header:
    """Read and validate the header of the file open as ``fd``, ``size`` bytes long:
    one read where the header is shorter than :data:`FIRST_READ`."""
    first = pread_fully(fd, min(size, FIRST_READ), 0)
    n = header_length(path, first[:LENGTH_BYTES], size)
    if LENGTH_BYTES + n <= len(first):
        return parse_header(path, first[LENGTH_BYTES : LENGTH_BYTES + n], size)
    raw = pread_fully(fd, n, LENGTH_BYTES)
    if len(raw) < n:
        raise FormatError(f"{path}: file ended inside its header")
    return parse_header(path, raw, size)


def pread_fully(fd: int, length: int, offset: int) -> bytes:
    """``length`` bytes at ``offset``, fewer only at the end of the file: a network or
    FUSE filesystem may return a read short of what is there."""
    first = os.pread(fd, length, offset)
    if len(first) == length or not first:
        return first
    parts = [first]
    got = len(first)
    while got < length:
        more = os.pread(fd, length - got, offset + got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)
