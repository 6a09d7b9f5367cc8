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

What torch cannot hold (a dtype it lacks, such as ``F6_E2M3``; ``F4`` with an odd last
dimension; a dimension past 2**63 - 1) is refused as ``safetensors.torch`` refuses it,
when tensors are made (:func:`loaderplug.tensors.sinks.torch_dtypes`), not here: such a
file is a valid safetensors file, and a hydrate copies it.
"""

from __future__ import annotations

import json
import re
import reprlib
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from loaderplug.errors import FormatError
from loaderplug.tensors.dtypes import DTYPES

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
        :func:`loaderplug.tensors.sinks.torch_dtypes` reports before any read."""
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
    if not isinstance(doc, (dict, _Pairs)):
        raise FormatError(f"{path}: header is {type(doc).__name__}, expected a JSON object")
    metadata: dict[str, str] = {}
    seen_metadata = False
    entries: dict[str, _Entry] = {}
    for key, value in _items(doc):
        if key != "__metadata__":
            entries[key] = _entry(path, key, value)  # each is checked; the last one counts
        elif seen_metadata:
            raise FormatError(f"{path}: __metadata__ appears twice")
        else:
            seen_metadata = True
            metadata = _metadata(path, value)
    tensors = _layout(path, entries, data_start, file_size - data_start)
    return Header(path, file_size, data_start, tensors, metadata)


# -- JSON, as strict as serde_json -------------------------------------------------------
#
# An object decodes to a dict, or where a key repeats to its pairs in order (serde reads
# each one, where Python's json keeps the last); an array to a list.

_Entry = tuple[str, tuple[int, ...], int, int]  # dtype, shape, begin, end (in the data area)


class _Pairs(tuple[tuple[str, object], ...]):
    """A JSON object with a repeated key: its ``(key, value)`` pairs, in order."""

    __slots__ = ()


def _object(pairs: list[tuple[str, object]]) -> dict[str, object] | _Pairs:
    obj = dict(pairs)
    return obj if len(obj) == len(pairs) else _Pairs(pairs)


def _items(obj: dict[str, object] | _Pairs) -> Iterable[tuple[str, object]]:
    return obj.items() if isinstance(obj, dict) else obj


class _Refused(Exception):
    """JSON that Python reads and serde_json does not."""


def _float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _Refused(f"number {reprlib.repr(text)} is out of range of a 64-bit float")
    return value


def _int(text: str) -> int | float:
    # serde_json reads -0, and an integer beyond i64/u64, as a float; Python's int() would
    # refuse a long one (its digit limit), so it is never asked.
    if len(text) > 20 or text == "-0":
        return _float(text)
    value = int(text)
    return value if -(2**63) <= value <= USIZE_MAX else float(value)


def _constant(text: str) -> object:
    raise _Refused(f"{text} is not JSON")


# Python reads -0 as the integer 0, serde_json as a float: where the text may hold one,
# the integers are read as serde reads them. Elsewhere plain int() does: an integer past
# u64 is refused as a shape or offset all the same, and one past a float's range (serde:
# "number out of range") is refused where it is not read (see _check_nested) or, past
# Python's digit limit, by int() itself.
_NEGATIVE_ZERO = re.compile(r"-0(?![.eE0-9])")
_DECODER = json.JSONDecoder(object_pairs_hook=_object, parse_float=_float, parse_constant=_constant)
_SERDE_INT_DECODER = json.JSONDecoder(
    object_pairs_hook=_object, parse_int=_int, parse_float=_float, parse_constant=_constant
)
# An integer this long may be past a float's range; float() tells.
_LONG_INT_BITS = 1000


def _json(path: str, raw: bytes) -> object:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"{path}: header is not valid UTF-8 ({exc})") from exc
    decoder = _SERDE_INT_DECODER if _NEGATIVE_ZERO.search(text) else _DECODER
    try:
        doc = decoder.decode(text)
    except (json.JSONDecodeError, _Refused) as exc:
        raise FormatError(f"{path}: header is not valid JSON ({exc})") from exc
    except ValueError as exc:  # int()'s digit limit: far past a float's range
        raise FormatError(f"{path}: header is not valid JSON (a number out of range)") from exc
    except RecursionError as exc:
        raise _too_deep(path) from exc
    if _SURROGATE_ESCAPE.search(text):
        _check_nested(path, doc, 1, strings=True)
    return doc


def _too_deep(path: str) -> FormatError:
    return FormatError(
        f"{path}: header JSON nests deeper than the {MAX_DEPTH} levels safetensors reads"
    )


def _check_nested(path: str, value: object, depth: int, *, strings: bool = False) -> None:
    """What serde refuses in a value it reads but does not use: containers nested deeper
    than it reads (``value`` being at ``depth``), integers past a float's range and, with
    ``strings``, lone surrogates. Level by level, without recursion."""
    level = [value]
    while level:
        below: list[object] = []
        for item in level:
            if isinstance(item, (dict, _Pairs, list)):
                if depth > MAX_DEPTH:
                    raise _too_deep(path)
                if isinstance(item, list):
                    below.extend(item)
                    continue
                for k, v in _items(item):
                    if strings:
                        _check_string(path, k)
                    below.append(v)
            elif isinstance(item, int) and item.bit_length() > _LONG_INT_BITS:
                try:
                    float(item)
                except OverflowError:
                    raise FormatError(
                        f"{path}: header is not valid JSON (number {_show(item)} is out of "
                        f"range of a 64-bit float)"
                    ) from None
            elif strings and isinstance(item, str):
                _check_string(path, item)
        level = below
        depth += 1


def _check_string(path: str, value: str) -> None:
    if _SURROGATE.search(value):
        raise FormatError(
            f"{path}: header JSON has a lone surrogate escape in {reprlib.repr(value)}"
        )


def _kind(value: object) -> str:
    if isinstance(value, (dict, _Pairs)):
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
    """Short reprs of header values for messages, as JSON: a hostile one may be huge."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlist = self.maxdict = 8
        self.maxlong = self.maxstring = self.maxother = 40

    def repr_dict(self, obj: dict[str, object], level: int) -> str:
        return self._object(list(obj.items()), level)

    def repr__Pairs(self, obj: _Pairs, level: int) -> str:
        return self._object(list(obj), level)

    def _object(self, pairs: list[tuple[str, object]], level: int) -> str:
        if level <= 0:
            return "{...}"
        shown = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}" for k, v in pairs]
        more = ", ..." if len(shown) > self.maxdict else ""
        return "{" + ", ".join(shown[: self.maxdict]) + more + "}"

    def repr_str(self, obj: str, level: int) -> str:
        return json.dumps(obj) if len(obj) <= self.maxstring else super().repr_str(obj, level)

    def repr_bool(self, obj: bool, level: int) -> str:
        return "true" if obj else "false"

    def repr_NoneType(self, obj: None, level: int) -> str:
        return "null"


_show = _Show().repr


def _usizes(values: list[object]) -> bool:
    """All integers in ``[0, 2**64)`` (Rust's usize), no booleans."""
    return all(type(v) is int and 0 <= v <= USIZE_MAX for v in values)


# -- the tensors -------------------------------------------------------------------------


def _metadata(path: str, value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, (dict, _Pairs)):
        raise FormatError(f"{path}: __metadata__ is {_kind(value)}, expected an object")
    metadata = {}
    for key, v in _items(value):  # a key repeated: the last one counts
        if not isinstance(v, str):
            raise FormatError(f"{path}: __metadata__[{key!r}] is {_kind(v)}, expected a string")
        metadata[key] = v
    return metadata


def _entry(path: str, name: str, value: object) -> _Entry:
    """A tensor's ``(dtype, shape, begin, end)``, its offsets relative to the data area."""
    if isinstance(value, (dict, _Pairs)):
        if isinstance(value, _Pairs) or len(value) != len(_FIELDS):
            _check_fields(path, name, value)  # a field repeated, or an unknown one
        fields = value if isinstance(value, dict) else dict(value)
        try:
            dtype, shape, offsets = fields["dtype"], fields["shape"], fields["data_offsets"]
        except KeyError as exc:
            raise FormatError(f"{path}: tensor {name!r}: missing field {exc}") from None
    elif isinstance(value, list):
        if len(value) != len(_FIELDS):
            raise FormatError(
                f"{path}: tensor {name!r}: entry is an array of {len(value)}, expected an "
                f"object (or an array of dtype, shape and data_offsets)"
            )
        dtype, shape, offsets = value
    else:
        raise FormatError(f"{path}: tensor {name!r}: entry is {_kind(value)}, expected an object")
    if isinstance(dtype, dict) and len(dtype) == 1 and None in dtype.values():
        (dtype,) = dtype  # {"F32": null}: serde's spelling of an enum's variant
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise FormatError(
            f"{path}: tensor {name!r}: unknown dtype {_show(dtype)}; known: {', '.join(DTYPES)}"
        )
    if type(shape) is not list or not _usizes(shape):
        raise FormatError(
            f"{path}: tensor {name!r}: shape {_show(shape)} must be a list of integers "
            f"in [0, 2**64)"
        )
    if type(offsets) is not list or len(offsets) != 2 or not _usizes(offsets):
        raise FormatError(
            f"{path}: tensor {name!r}: data_offsets {_show(offsets)} must be two integers "
            f"[begin, end] in [0, 2**64)"
        )
    return dtype, tuple(shape), offsets[0], offsets[1]


def _check_fields(path: str, name: str, fields: dict[str, object] | _Pairs) -> None:
    """No field of a tensor twice; the values of others (ignored) nested no deeper than
    serde reads (the only place a valid header nests at all deep)."""
    seen = set()
    for field, value in _items(fields):
        if field in _FIELDS:
            if field in seen:
                raise FormatError(f"{path}: tensor {name!r}: field {field!r} appears twice")
            seen.add(field)
        else:
            _check_nested(path, value, 3)  # the header, the entry, then this value


def _layout(
    path: str, entries: Mapping[str, _Entry], data_start: int, data_size: int
) -> tuple[TensorInfo, ...]:
    """The tensors in order of offsets, once they are seen to tile the data area."""
    tensors = []
    covered = 0
    for name, (dtype, shape, begin, end) in sorted(entries.items(), key=lambda e: e[1][2:]):
        if begin != covered or end < begin:
            problem = (
                "ends before it begins"
                if end < begin
                else f"overlaps the tensor before it, which ends at {covered}"
                if begin < covered
                else f"leaves bytes [{covered}, {begin}) of the data area unused"
            )
            raise FormatError(
                f"{path}: tensor {name!r}: data_offsets [{begin}, {end}] {problem}; the "
                f"tensors must cover the data area contiguously from byte 0"
            )
        covered = end
        count = 1
        for d in shape:  # in order, as safetensors does: it refuses any product past 2**64
            count *= d
            if count > USIZE_MAX:
                break
        bits = count * DTYPES[dtype].bits
        if bits > USIZE_MAX:
            raise FormatError(
                f"{path}: tensor {name!r}: shape {_show(list(shape))} of {dtype} overflows "
                f"2**64 elements or bits"
            )
        if bits % 8:
            raise FormatError(
                f"{path}: tensor {name!r}: shape {_show(list(shape))} of {dtype} is {bits} "
                f"bits, not a whole number of bytes"
            )
        if end - begin != bits // 8:
            raise FormatError(
                f"{path}: tensor {name!r}: holds {end - begin} bytes but shape "
                f"{_show(list(shape))} of {dtype} needs {bits // 8}"
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
