"""Safetensors header parsing and validation. No IO: callers pass the bytes.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON, then the
data region. The JSON maps tensor names to ``{"dtype", "shape", "data_offsets": [begin,
end]}`` (offsets relative to the data region) plus an optional ``__metadata__`` object of
str → str. Every rule below is checked, and each violation raises a :class:`FormatError`
that names the file, the tensor and the rule, so a corrupt or hostile file never crashes,
hangs or makes the reader allocate more than the file holds.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from loaderplug.dtypes import DTYPES
from loaderplug.errors import FormatError

# Above this a header is refused outright: real headers are kilobytes to a few MB.
MAX_HEADER_BYTES = 100_000_000
LENGTH_BYTES = 8


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: where its bytes are in the *file* (absolute offsets) and what they are."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    path: str
    size: int  # the file's size in bytes
    data_start: int  # absolute offset of the data region
    tensors: tuple[TensorInfo, ...]  # sorted by begin
    metadata: Mapping[str, str]


def header_length(path: str, first8: bytes, file_size: int) -> int:
    """The JSON header's length from the file's first 8 bytes, checked against the file."""
    if len(first8) < LENGTH_BYTES:
        raise FormatError(f"{path}: file is {file_size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", first8[:LENGTH_BYTES])
    if n > MAX_HEADER_BYTES:
        raise FormatError(
            f"{path}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit; "
            f"not a safetensors file, or a corrupt one"
        )
    if LENGTH_BYTES + n > file_size:
        raise FormatError(
            f"{path}: header length {n} runs past the end of the {file_size}-byte file"
        )
    return int(n)


def parse_header(path: str, raw: bytes, file_size: int) -> Header:
    """Validate the JSON header ``raw`` (without its 8-byte length) of a ``file_size`` file."""
    data_start = LENGTH_BYTES + len(raw)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FormatError(f"{path}: header is not valid UTF-8 JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise FormatError(f"{path}: header is {type(doc).__name__}, expected a JSON object")
    metadata = _metadata(path, doc.pop("__metadata__", None))
    data_size = file_size - data_start
    tensors = sorted(
        (_tensor(path, name, entry, data_start, data_size) for name, entry in doc.items()),
        key=lambda t: (t.begin, t.end),
    )
    previous: TensorInfo | None = None
    for tensor in tensors:
        if tensor.nbytes == 0:
            continue
        if previous is not None and tensor.begin < previous.end:
            raise FormatError(
                f"{path}: tensor {tensor.name!r} overlaps {previous.name!r} "
                f"(bytes {tensor.begin - data_start} < {previous.end - data_start}); "
                f"tensors may not share bytes"
            )
        previous = tensor
    return Header(path, file_size, data_start, tuple(tensors), metadata)


def _metadata(path: str, value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise FormatError(f"{path}: __metadata__ must map strings to strings")
    return dict(value)


def _tensor(path: str, name: str, entry: object, data_start: int, data_size: int) -> TensorInfo:
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict):
        raise FormatError(f"{where}: entry is {type(entry).__name__}, expected an object")
    dtype = entry.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise FormatError(f"{where}: unknown dtype {dtype!r}; known: {', '.join(DTYPES)}")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise FormatError(f"{where}: shape {shape!r} must be a list of non-negative integers")
    offsets = entry.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
    ):
        raise FormatError(f"{where}: data_offsets {offsets!r} must be two integers [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
        raise FormatError(
            f"{where}: data_offsets [{begin}, {end}] fall outside the data region "
            f"of {data_size} bytes"
        )
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != expected:
        raise FormatError(
            f"{where}: holds {end - begin} bytes but shape {shape} of {dtype} needs {expected}"
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)
