"""Safetensors header parsing and validation. No IO: callers pass the bytes.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON, then the
data area. The JSON maps tensor names to ``{"dtype", "shape", "data_offsets": [begin,
end]}`` (offsets relative to the data area) plus an optional ``__metadata__`` object of
str → str. A file is accepted exactly when the ``safetensors`` library accepts it, and
every violation raises a :class:`FormatError` that names the file, the tensor and the
rule, so a corrupt or hostile file never crashes, hangs or makes the reader allocate
more than the file holds. The rules, as ``safetensors`` (its Rust core, serde_json)
enforces them:

* The header length is at most :data:`MAX_HEADER_BYTES` and ends inside the file; the
  header is UTF-8 JSON (leading and trailing JSON whitespace allowed, nothing else;
  no ``NaN``/``Infinity``, no lone surrogate escapes, no number out of a 64-bit float's
  range, nothing nested deeper than :data:`MAX_DEPTH`) whose top level is an object.
* ``__metadata__`` appears at most once: null, or an object of string values.
* Every other key is a tensor: an object with the fields ``dtype``, ``shape`` and
  ``data_offsets`` each exactly once (other fields are ignored), or an array of those
  three. ``dtype`` is a known name (or ``{"NAME": null}``, serde's other spelling of
  it); ``shape`` and ``data_offsets`` are arrays of integers in ``[0, 2**64)``, the
  offsets two of them. A tensor named twice is checked each time; the last one counts.
* In order of offsets, the tensors cover the data area contiguously from byte 0 to its
  very end: no gaps, no overlaps, no bytes left over. Each holds exactly the bytes its
  shape needs: the element count (a running product of the dimensions) and its size in
  bits stay below 2**64, and the bits make whole bytes.
"""

from __future__ import annotations

import json
import re
import reprlib
import struct
from collections.abc import Mapping
from dataclasses import dataclass

from loaderplug.dtypes import DTYPES
from loaderplug.errors import FormatError

# Above this a header is refused outright, as safetensors does: real headers are
# kilobytes to a few MB.
MAX_HEADER_BYTES = 100_000_000
LENGTH_BYTES = 8
# serde_json's recursion limit: arrays and objects nested deeper than this are refused.
MAX_DEPTH = 127
# Shapes and offsets are Rust ``usize`` values, and their products are checked in it.
USIZE_MAX = 2**64 - 1
_FIELDS = ("dtype", "shape", "data_offsets")
# A lone surrogate can only come from a ``\uD800``-``\uDFFF`` escape.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: where its bytes are in the *file* (absolute offsets) and what they are."""

    name: str
    dtype: str
    shape: tuple[int, ...]  # as the header gives it
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        """The tensor's bytes in the file."""
        return self.end - self.begin

    @property
    def torch_shape(self) -> tuple[int, ...]:
        """The shape torch gives it, as ``safetensors.torch`` does (a packed sub-byte dtype
        divides the last dimension); ValueError where torch has none, which
        :func:`loaderplug.tensor_sinks.torch_dtypes` reports before any read."""
        return DTYPES[self.dtype].torch_shape(self.shape)


@dataclass(frozen=True)
class Header:
    path: str
    size: int  # the file's size in bytes
    data_start: int  # absolute offset of the data area
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
    doc = _json(path, raw)
    if not isinstance(doc, _Object):
        raise FormatError(f"{path}: header is {_kind(doc)}, expected a JSON object")
    metadata: dict[str, str] | None = None
    entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    for key, value in doc.pairs:
        if key != "__metadata__":
            entries[key] = _entry(f"{path}: tensor {key!r}", value)  # the last one counts
        elif metadata is None:
            metadata = _metadata(path, value)
        else:
            raise FormatError(f"{path}: __metadata__ appears twice")
    tensors = _layout(path, entries, data_start, file_size - data_start)
    return Header(path, file_size, data_start, tensors, metadata or {})


# -- JSON, as strict as serde_json -------------------------------------------------------


class _Object:
    """A JSON object as its pairs, in order, repeated keys kept: serde reads each."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: list[tuple[str, object]]) -> None:
        self.pairs = pairs


class _Refused(Exception):
    """JSON that Python reads and serde_json does not."""


def _float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _Refused(f"number {reprlib.repr(text)} is out of range of a 64-bit float")
    return value


def _int(text: str) -> int | float:
    # serde_json reads an integer beyond i64/u64 (and -0) as a float; Python's int() would
    # refuse a long one (its digit limit), so it is never asked.
    if len(text) > 20 or text == "-0":
        return _float(text)
    value = int(text)
    return value if -(2**63) <= value <= USIZE_MAX else float(value)


def _constant(text: str) -> object:
    raise _Refused(f"{text} is not JSON")


_DECODER = json.JSONDecoder(
    object_pairs_hook=_Object, parse_int=_int, parse_float=_float, parse_constant=_constant
)


def _json(path: str, raw: bytes) -> object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"{path}: header is not valid UTF-8 ({exc})") from exc
    try:
        doc = _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise FormatError(f"{path}: header is not valid JSON ({exc})") from exc
    except _Refused as exc:
        raise FormatError(f"{path}: header is not valid JSON ({exc})") from exc
    except RecursionError as exc:
        raise FormatError(
            f"{path}: header JSON nests deeper than the {MAX_DEPTH} levels safetensors reads"
        ) from exc
    _check_values(path, doc, surrogates=_SURROGATE_ESCAPE.search(text) is not None)
    return doc


def _check_values(path: str, doc: object, *, surrogates: bool) -> None:
    """Depth and lone surrogates, everywhere (serde reads ignored fields too)."""
    stack: list[tuple[object, int]] = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                raise FormatError(
                    f"{path}: header JSON has a lone surrogate escape in {reprlib.repr(value)}"
                )
            continue
        if isinstance(value, _Object):
            children: list[object] = [v for pair in value.pairs for v in pair]
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > MAX_DEPTH:
            raise FormatError(
                f"{path}: header JSON nests deeper than the {MAX_DEPTH} levels safetensors reads"
            )
        stack.extend(
            (v, depth + 1)
            for v in children
            if isinstance(v, (_Object, list)) or (surrogates and isinstance(v, str))
        )


def _kind(value: object) -> str:
    if isinstance(value, _Object):
        return "an object"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "null"


class _Show(reprlib.Repr):
    """Short reprs of header values for messages: a hostile one may be huge."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlist = self.maxdict = 8
        self.maxlong = self.maxstring = self.maxother = 40

    def repr__Object(self, obj: _Object, level: int) -> str:
        if level <= 0:
            return "{...}"
        shown = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}" for k, v in obj.pairs]
        more = ", ..." if len(shown) > self.maxdict else ""
        return "{" + ", ".join(shown[: self.maxdict]) + more + "}"


_show = _Show().repr


def _usize(value: object) -> bool:
    return type(value) is int and 0 <= value <= USIZE_MAX


# -- the tensors -------------------------------------------------------------------------


def _metadata(path: str, value: object) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, _Object):
        raise FormatError(f"{path}: __metadata__ is {_kind(value)}, expected an object")
    for key, v in value.pairs:
        if not isinstance(v, str):
            raise FormatError(f"{path}: __metadata__[{key!r}] is {_kind(v)}, expected a string")
    return dict(value.pairs)  # type: ignore[arg-type]


def _entry(where: str, value: object) -> tuple[str, tuple[int, ...], int, int]:
    """A tensor's ``(dtype, shape, begin, end)``, its offsets relative to the data area."""
    if isinstance(value, _Object):
        fields: dict[str, object] = {}
        for field, v in value.pairs:
            if field in _FIELDS:  # any other field is ignored, as safetensors does
                if field in fields:
                    raise FormatError(f"{where}: field {field!r} appears twice")
                fields[field] = v
        for field in _FIELDS:
            if field not in fields:
                raise FormatError(f"{where}: missing field {field!r}")
        dtype, shape, offsets = (fields[f] for f in _FIELDS)
    elif isinstance(value, list):
        if len(value) != len(_FIELDS):
            raise FormatError(
                f"{where}: entry is an array of {len(value)}, expected an object "
                f"(or an array of dtype, shape and data_offsets)"
            )
        dtype, shape, offsets = value
    else:
        raise FormatError(f"{where}: entry is {_kind(value)}, expected an object")
    if isinstance(dtype, _Object) and len(dtype.pairs) == 1 and dtype.pairs[0][1] is None:
        dtype = dtype.pairs[0][0]  # {"F32": null}: serde's externally tagged enum
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise FormatError(f"{where}: unknown dtype {_show(dtype)}; known: {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(_usize(d) for d in shape):
        raise FormatError(f"{where}: shape {_show(shape)} must be a list of integers in [0, 2**64)")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_usize, offsets)):
        raise FormatError(
            f"{where}: data_offsets {_show(offsets)} must be two integers [begin, end] "
            f"in [0, 2**64)"
        )
    return dtype, tuple(shape), offsets[0], offsets[1]


def _layout(
    path: str,
    entries: Mapping[str, tuple[str, tuple[int, ...], int, int]],
    data_start: int,
    data_size: int,
) -> tuple[TensorInfo, ...]:
    """The tensors in order of offsets, once they are seen to tile the data area."""
    tensors = []
    covered = 0
    for name, (dtype, shape, begin, end) in sorted(entries.items(), key=lambda e: e[1][2:]):
        where = f"{path}: tensor {name!r}"
        if begin != covered or end < begin:
            problem = (
                "ends before it begins"
                if end < begin
                else f"overlaps the tensor before it, which ends at {covered}"
                if begin < covered
                else f"leaves bytes [{covered}, {begin}) of the data area unused"
            )
            raise FormatError(
                f"{where}: data_offsets [{begin}, {end}] {problem}; the tensors must cover "
                f"the data area contiguously from byte 0"
            )
        covered = end
        count = 1
        for d in shape:
            count *= d
            if count > USIZE_MAX:
                break
        bits = count * DTYPES[dtype].bits
        if bits > USIZE_MAX:
            raise FormatError(f"{where}: shape {_show(list(shape))} of {dtype} overflows 2**64")
        if bits % 8:
            raise FormatError(
                f"{where}: shape {_show(list(shape))} of {dtype} is {bits} bits, "
                f"not a whole number of bytes"
            )
        if end - begin != bits // 8:
            raise FormatError(
                f"{where}: holds {end - begin} bytes but shape {_show(list(shape))} "
                f"of {dtype} needs {bits // 8}"
            )
        tensors.append(TensorInfo(name, dtype, shape, data_start + begin, data_start + end))
    if covered != data_size:
        raise FormatError(
            f"{path}: the tensors cover {covered} bytes of a {data_size}-byte data area"
            + (
                f"; {data_size - covered} bytes after the last tensor belong to none"
                if covered < data_size
                else "; they run past the end of the file"
            )
        )
    return tuple(tensors)
