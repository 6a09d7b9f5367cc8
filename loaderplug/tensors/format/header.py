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

Parsing takes memory in proportion to the header, never to what it claims: what it keeps
is a few dozen bytes a tensor (:mod:`loaderplug.tensors.format.table`), each entry is
decoded on its own and dropped, and whatever is large or nested (an unknown field of a
million numbers, a shape of a million dimensions, a huge metadata) is checked over the
bytes without being built (:mod:`loaderplug.tensors.format.parse`). A header as
safetensors writes it (its tensors in the order of their offsets) is parsed within
:data:`MEMORY_FACTOR` times its size; any other, within :data:`MOST_MEMORY_FACTOR`
times (its tensors must then be sorted).

What torch cannot hold (a dtype it lacks, such as ``F6_E2M3``; ``F4`` with an odd last
dimension; a dimension past 2**63 - 1) is refused as ``safetensors.torch`` refuses it,
when tensors are made (:func:`loaderplug.tensors.format.torch_dtypes.torch_dtypes`),
not here: such a file is a valid safetensors file, and a hydrate copies it.
"""

from __future__ import annotations

import codecs
import itertools
import json
import operator
import re
import reprlib
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeGuard

from loaderplug.errors import FormatError
from loaderplug.tensors.format.dtypes import DTYPES
from loaderplug.tensors.format.parse import MAX_DEPTH, RUN, Scanner
from loaderplug.tensors.format.table import PackedMetadata, Tensors, TensorTable
from loaderplug.tensors.format.table import TensorInfo as TensorInfo

# Above this a header is refused outright, as safetensors does: real headers are
# kilobytes to a few MB.
MAX_HEADER_BYTES = 100_000_000
LENGTH_BYTES = 8
# The memory a parse takes, as a multiple of the header's size: a header as safetensors
# writes it, and any header (tests/test_header_memory.py measures both).
MEMORY_FACTOR = 2
MOST_MEMORY_FACTOR = 4
# An entry this long is decoded with Python's json at once (its objects are then a few
# hundred kilobytes at the most); a longer one is walked over its bytes. A typical entry
# (no nested container) is first matched whole within FAST_BYTES.
FAST_BYTES = 4096
SMALL_BYTES = 64 * 1024
# No dtype's name, every letter escaped, is longer.
DTYPE_TOKEN_BYTES = 256
# UTF-8 is checked this many bytes at a time (a piece decoded may take four times that).
UTF8_CHUNK = 1 << 16
# Shapes and offsets are Rust ``usize`` values, and their products are checked in it.
USIZE_MAX = 2**64 - 1
_FIELDS = ("dtype", "shape", "data_offsets")
# A lone surrogate can only come from a ``\uD800``-``\uDFFF`` escape.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Header:
    path: str
    size: int  # the file's size in bytes
    data_start: int  # absolute offset of the data area
    tensors: Sequence[TensorInfo]  # sorted by begin (made as they are asked for)
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
    _check_utf8(path, raw)
    at_once = _at_once(path, raw)
    if at_once is not None:
        entries, metadata = at_once
        tensors = _tiled(entries, data_start, file_size - data_start)
        if tensors is not None:
            return Header(path, file_size, data_start, tensors, metadata)
        table = TensorTable()  # the checks below say what is wrong, and where
        for name, dtype, shape, begin, end in entries:
            table.append(name.encode(), dtype, shape, begin, end)
    else:
        table = TensorTable()
        metadata = _walk(Scanner(path, raw), table)
    order = table.order()
    _layout(path, table, order, file_size - data_start)
    table.done()
    return Header(path, file_size, data_start, Tensors(table, order, data_start), metadata)


# A tensor's entry as decoded at once: name, dtype, shape, begin, end (in the data area).
_Decoded = tuple[str, str, list[int], int, int]


def _at_once(path: str, raw: bytes) -> tuple[list[_Decoded], Mapping[str, str]] | None:
    """A small header as safetensors writes it, decoded with one call of Python's json
    and its entries checked one by one as :func:`_walk` checks them (the same errors, in
    the same order); None for anything else (a larger header, one with an escape, a
    ``-0``, a repeated key, a value nested or shaped otherwise), which :func:`_walk`
    then reads: its messages say where the header strays. Its objects take a few
    hundred kilobytes at the most."""
    if len(raw) > SMALL_BYTES:
        return None
    text = raw.decode()
    if "\\" in text or _NEGATIVE_ZERO.search(text):
        return None
    try:
        value = _PLAIN_DECODER.decode(text)
    except (ValueError, _Refused, RecursionError):
        return None
    # A dict keeps a repeated key's last value, where serde reads each: every key of the
    # text must be one of the dicts'.
    if type(value) is not dict or _keys(value) != len(_KEY_END.findall(text)):
        return None
    entries: list[_Decoded] = []
    metadata: Mapping[str, str] = {}
    for key, entry in value.items():
        if key == "__metadata__":
            if entry is not None and not _flat_metadata(entry):
                return None
            metadata = entry or {}
            continue
        if type(entry) is not dict or len(entry) != len(_FIELDS):
            return None
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if type(dtype) is not str or not (_ints(shape) and _ints(offsets)):
            return None
        if not (dtype in DTYPES and len(offsets) == 2 and _in_usize(shape + offsets)):
            _checked(path, key if len(key) <= 50 else _name(key.encode()), dtype, shape, offsets)
        entries.append((key, dtype, shape, offsets[0], offsets[1]))
    return entries, metadata


def _tiled(
    entries: list[_Decoded], data_start: int, data_size: int
) -> tuple[TensorInfo, ...] | None:
    """The tensors in order of offsets, where they tile the data area and each holds
    exactly the bytes its shape needs (what :func:`_layout` checks); None where they do
    not, for :func:`_layout` to say how."""
    covered = 0
    tensors = []
    # Stable: tensors of the same offsets keep the header's order, as in TensorTable.
    for name, dtype, shape, begin, end in sorted(entries, key=_OFFSETS):
        if begin != covered or end < begin:
            return None
        covered = end
        count = 1
        for d in shape:
            count *= d
            if count > USIZE_MAX:
                return None
        bits = count * DTYPES[dtype].bits
        if bits > USIZE_MAX or bits % 8 or end - begin != bits // 8:
            return None
        tensors.append(TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end))
    return tuple(tensors) if covered == data_size else None


_OFFSETS = operator.itemgetter(3, 4)


def _in_usize(values: list[int]) -> bool:
    return not values or (min(values) >= 0 and max(values) <= USIZE_MAX)


def _keys(value: dict[str, object]) -> int:
    """The keys of a header decoded whole, with its entries' and metadata's."""
    inner = (len(v) for v in value.values() if type(v) is dict)
    return len(value) + sum(inner)


def _ints(value: object) -> TypeGuard[list[int]]:
    # No bool, no float: the types themselves, gathered in one call.
    return type(value) is list and (not value or set(map(type, value)) == _INT)


_INT = {int}


def _flat_metadata(value: object) -> bool:
    return type(value) is dict and all(type(v) is str for v in value.values())


def _check_utf8(path: str, raw: bytes) -> None:
    """The whole header is UTF-8 (as serde reads it first), checked a chunk at a time so
    no string of the whole header is ever made."""
    if raw.isascii():
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    view = memoryview(raw)
    for at in range(0, len(raw), UTF8_CHUNK):
        try:
            decoder.decode(view[at : at + UTF8_CHUNK], final=at + UTF8_CHUNK >= len(raw))
        except UnicodeDecodeError as exc:
            raise FormatError(
                f"{path}: header is not valid UTF-8 (byte {at + exc.start}: {exc.reason})"
            ) from None


def _walk(scan: Scanner, table: TensorTable) -> Mapping[str, str]:
    """Every member of the header's object: tensors into ``table``; the metadata."""
    pos = scan.ws(0)
    if scan.byte(pos) != ord("{"):
        raise _not_an_object(scan, pos)
    metadata: Mapping[str, str] | None = None
    pos = scan.ws(pos + 1)
    while scan.byte(pos) != ord("}"):  # a member; after a comma one must follow
        if scan.byte(pos) != ord('"'):
            raise scan.error(f"expected a key at byte {pos}")
        key_end = scan.string(pos)
        begin = scan.ws(scan.expect(key_end, b":"))
        name = scan.text_view(pos, key_end)
        if name != b"__metadata__":
            end = _tensor(scan, table, name, begin)
        elif metadata is not None:
            raise FormatError(f"{scan.path}: __metadata__ appears twice")
        else:
            metadata, end = _metadata_at(scan, begin)
        pos = scan.ws(end)
        if scan.byte(pos) == ord("}"):
            break
        pos = scan.ws(scan.expect(pos, b","))
        if scan.byte(pos) != ord('"'):
            raise scan.error(f"expected a key at byte {pos}")
    if scan.ws(pos + 1) != len(scan.raw):
        raise scan.error(f"unexpected data at byte {scan.ws(pos + 1)}, after the header's object")
    return {} if metadata is None else metadata


def _not_an_object(scan: Scanner, pos: int) -> FormatError:
    if pos >= len(scan.raw):
        return scan.error("the header is empty")
    end = scan.skip_value(pos, 1)
    if scan.ws(end) != len(scan.raw):
        return scan.error(f"unexpected data at byte {scan.ws(end)}")
    if end - pos <= SMALL_BYTES:
        kind = type(_decoded(scan, pos, end, 1)).__name__
    else:
        kind = {ord("["): "list", ord('"'): "str"}.get(scan.byte(pos), "int")
    return FormatError(f"{scan.path}: header is {kind}, expected a JSON object")


# A tensor's entry as safetensors writes it: an object (or an array) holding no object,
# and arrays holding no container; Python's json decodes it at once.
_STR = rb'"(?:[^"\\]|\\.)*"'
_ARRAY = rb"\[(?:[^\"\[\]{}]|" + _STR + rb")*\]"
_ITEMS = rb"(?:[^\"\[\]{}]|" + _STR + rb"|" + _ARRAY + rb")*"
_FLAT = re.compile(rb"\{" + _ITEMS + rb"\}|\[" + _ITEMS + rb"\]")


def _tensor(scan: Scanner, table: TensorTable, name: bytes | memoryview, begin: int) -> int:
    """Check the entry of the tensor ``name`` at ``begin`` and add it to ``table``;
    returns where the entry ends."""
    shown = _name(name)
    flat = _FLAT.match(scan.raw, begin, begin + FAST_BYTES)
    end = flat.end() if flat is not None else scan.skip_value(begin, 2)
    if end - begin > SMALL_BYTES:
        table.add(name, *_large_entry(scan, shown, begin, end))
        return end
    value = _decoded(scan, begin, end, 2)
    dtype, shape, offsets = _fields(scan.path, shown, value)
    table.add(name, *_checked(scan.path, shown, dtype, shape, offsets))
    return end


def _name(name: bytes | memoryview) -> str:
    """A tensor's name for messages (a hostile one may be huge)."""
    return bytes(name[:200]).decode(errors="replace") + ("..." if len(name) > 200 else "")


def _decoded(scan: Scanner, begin: int, end: int, depth: int) -> object:
    """The value ``[begin, end)`` (one, at ``depth``), decoded as strictly as serde."""
    text = scan.raw[begin:end].decode()
    decoder = _SERDE_INT_DECODER if _NEGATIVE_ZERO.search(text) else _DECODER
    try:
        value, stop = decoder.raw_decode(text)
    except (json.JSONDecodeError, _Refused) as exc:
        raise FormatError(f"{scan.path}: header is not valid JSON ({exc})") from exc
    except ValueError as exc:  # int()'s digit limit: far past a float's range
        raise scan.error("a number out of range") from exc
    except RecursionError as exc:
        raise scan.too_deep() from exc
    if stop != len(text):
        raise scan.error(f"unexpected data at byte {begin + stop}")
    if _SURROGATE_ESCAPE.search(text):
        _check_nested(scan.path, value, depth, strings=True)
    return value


def _metadata_at(scan: Scanner, begin: int) -> tuple[Mapping[str, str], int]:
    """The ``__metadata__`` at ``begin``, and where it ends."""
    end = scan.skip_value(begin, 2)
    if end - begin <= SMALL_BYTES:
        return _metadata(scan.path, _decoded(scan, begin, end, 2)), end
    if scan.byte(begin) != ord("{"):
        kind = "an array" if scan.byte(begin) == ord("[") else "a string"
        raise FormatError(f"{scan.path}: __metadata__ is {kind}, expected an object")
    packed = PackedMetadata()
    for key_begin, key_end, value_begin, value_end in scan.members(begin, 2):
        key = scan.text(key_begin, key_end)
        if scan.byte(value_begin) != ord('"'):
            raise FormatError(
                f"{scan.path}: __metadata__[{_name(key)!r}] is not a string, expected one"
            )
        packed.add(key, scan.text_view(value_begin, value_end))
    return packed, end


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
# A header with no escape, decoded whole: a key ends in a quote and a colon, which no
# string of such a text holds (see _at_once).
_PLAIN_DECODER = json.JSONDecoder(parse_float=_float, parse_constant=_constant)
_KEY_END = re.compile(r'"[ \t\n\r]*:')
_SERDE_INT_DECODER = json.JSONDecoder(
    object_pairs_hook=_object, parse_int=_int, parse_float=_float, parse_constant=_constant
)
# An integer this long may be past a float's range; float() tells.
_LONG_INT_BITS = 1000


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


def _fields(path: str, name: str, value: object) -> tuple[object, object, object]:
    """A tensor's decoded entry's ``dtype``, ``shape`` and ``data_offsets`` values."""
    if isinstance(value, (dict, _Pairs)):
        if isinstance(value, _Pairs) or len(value) != len(_FIELDS):
            _check_fields(path, name, value)  # a field repeated, or an unknown one
        fields = value if isinstance(value, dict) else dict(value)
        try:
            return fields["dtype"], fields["shape"], fields["data_offsets"]
        except KeyError as exc:
            raise FormatError(f"{path}: tensor {name!r}: missing field {exc}") from None
    if isinstance(value, list):
        if len(value) != len(_FIELDS):
            raise _array_of(path, name, len(value))
        return value[0], value[1], value[2]
    raise FormatError(f"{path}: tensor {name!r}: entry is {_kind(value)}, expected an object")


def _array_of(path: str, name: str, count: int) -> FormatError:
    return FormatError(
        f"{path}: tensor {name!r}: entry is an array of {count}, expected an "
        f"object (or an array of dtype, shape and data_offsets)"
    )


def _checked(path: str, name: str, dtype: object, shape: object, offsets: object) -> _Entry:
    """A tensor's ``(dtype, shape, begin, end)``, its offsets relative to the data area."""
    dtype = _dtype(path, name, dtype)
    if type(shape) is not list or not _usizes(shape):
        raise _not_usizes(path, name, "shape", _show(shape))
    if type(offsets) is not list or len(offsets) != 2 or not _usizes(offsets):
        raise _not_usizes(path, name, "data_offsets", _show(offsets))
    return dtype, tuple(shape), offsets[0], offsets[1]


def _dtype(path: str, name: str, dtype: object) -> str:
    if isinstance(dtype, dict) and len(dtype) == 1 and None in dtype.values():
        (dtype,) = dtype  # {"F32": null}: serde's spelling of an enum's variant
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _unknown_dtype(path, name, _show(dtype))
    return dtype


def _unknown_dtype(path: str, name: str, shown: str) -> FormatError:
    return FormatError(
        f"{path}: tensor {name!r}: unknown dtype {shown}; known: {', '.join(DTYPES)}"
    )


def _not_usizes(path: str, name: str, field: str, shown: str) -> FormatError:
    if field == "shape":
        return FormatError(
            f"{path}: tensor {name!r}: shape {shown} must be a list of integers in [0, 2**64)"
        )
    return FormatError(
        f"{path}: tensor {name!r}: data_offsets {shown} must be two integers "
        f"[begin, end] in [0, 2**64)"
    )


# -- entries too large to decode: walked over the bytes -----------------------------------

_WS = rb"[ \t\n\r]*"
_USIZE = rb"(?:0|[1-9][0-9]{0,19})"
# Up to RUN integers and their commas at a time: the engine's state stays bounded.
_USIZES_RUN = re.compile(rb"(?:" + _WS + _USIZE + _WS + rb",){0,%d}" % RUN)
_USIZES_END = re.compile(_WS + rb"(?:" + _USIZE + _WS + rb")?\]")
_DIGITS = re.compile(rb"[0-9]+")


def _large_entry(
    scan: Scanner, name: str, begin: int, end: int
) -> tuple[str, Iterator[int], int, int]:
    """The checked entry ``[begin, end)`` too large to decode: its dtype, its shape's
    dimensions (as they are read) and its offsets."""
    char = scan.byte(begin)
    spans: list[tuple[int, int]] = []
    if char == ord("{"):
        found: dict[bytes, tuple[int, int]] = {}
        for key_begin, key_end, value_begin, value_end in scan.members(begin, 2):
            # A longer key, escaped or not, is none of the fields: it is not even read.
            key = scan.text(key_begin, key_end) if key_end - key_begin <= 128 else b""
            if key.decode() in _FIELDS:
                if key in found:
                    raise FormatError(
                        f"{scan.path}: tensor {name!r}: field {key.decode()!r} appears twice"
                    )
                found[key] = (value_begin, value_end)
        for field in _FIELDS:
            if field.encode() not in found:
                raise FormatError(f"{scan.path}: tensor {name!r}: missing field {field!r}")
            spans.append(found[field.encode()])
    elif char == ord("["):
        count = 0
        for span in scan.elements(begin, 2):
            count += 1
            spans += [span] if count <= len(_FIELDS) else []
        if count != len(_FIELDS):
            raise _array_of(scan.path, name, count)
    else:
        kind = "a string" if char == ord('"') else "a number"
        raise FormatError(f"{scan.path}: tensor {name!r}: entry is {kind}, expected an object")
    dtype = _large_dtype(scan, name, *spans[0])
    shape = _large_usizes(scan, name, "shape", *spans[1])
    offsets = list(_large_usizes(scan, name, "data_offsets", *spans[2]))
    if len(offsets) != 2:
        raise _not_usizes(scan.path, name, "data_offsets", scan.show(*spans[2]))
    return dtype, shape, offsets[0], offsets[1]


def _large_dtype(scan: Scanner, name: str, begin: int, end: int) -> str:
    if end - begin <= SMALL_BYTES:
        return _dtype(scan.path, name, _decoded(scan, begin, end, 3))
    # A string, or {"NAME": null} (serde's spelling of an enum's variant), spaced out:
    # either way a name short enough to be one.
    token = (begin, end) if scan.byte(begin) == ord('"') else None
    if scan.byte(begin) == ord("{"):
        members = list(itertools.islice(scan.members(begin, 3), 2))
        if len(members) == 1 and scan.raw.startswith(b"null", members[0][2]):
            token = members[0][:2]
    if token is not None and token[1] - token[0] <= DTYPE_TOKEN_BYTES:
        return _dtype(scan.path, name, scan.text(*token).decode())
    raise _unknown_dtype(scan.path, name, scan.show(begin, end))


def _large_usizes(scan: Scanner, name: str, field: str, begin: int, end: int) -> Iterator[int]:
    """The integers of the array ``[begin, end)``, as they are read; FormatError where it
    is not an array of usizes."""
    pos = begin + 1
    while (run := _USIZES_RUN.match(scan.raw, pos, end)) is not None and run.end() > pos:
        pos = run.end()
    if _USIZES_END.fullmatch(scan.raw, pos, end) is None:
        raise _not_usizes(scan.path, name, field, scan.show(begin, end))

    def values() -> Iterator[int]:
        for digits in _DIGITS.finditer(scan.raw, begin, end):
            value = int(digits.group())
            if value > USIZE_MAX:
                raise _not_usizes(scan.path, name, field, scan.show(begin, end))
            yield value

    return values()


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


def _layout(path: str, table: TensorTable, order: Sequence[int] | None, data_size: int) -> None:
    """Check that the tensors, in order of offsets, tile the data area."""
    covered = 0
    for slot in range(len(table)) if order is None else order:
        begin, end = table.begins[slot], table.ends[slot]
        if begin != covered or end < begin:
            problem = (
                "ends before it begins"
                if end < begin
                else f"overlaps the tensor before it, which ends at {covered}"
                if begin < covered
                else f"leaves bytes [{covered}, {begin}) of the data area unused"
            )
            raise FormatError(
                f"{path}: tensor {_name(table.name(slot))!r}: data_offsets [{begin}, {end}] "
                f"{problem}; the tensors must cover the data area contiguously from byte 0"
            )
        covered = end
        _check_size(path, table, slot)
    if covered != data_size:
        raise FormatError(
            f"{path}: the tensors cover {covered} bytes of a {data_size}-byte data area"
            + (
                f"; {data_size - covered} bytes after the last tensor belong to none"
                if covered < data_size
                else "; they run past the end of the file"
            )
        )


def _check_size(path: str, table: TensorTable, slot: int) -> None:
    """The tensor at ``slot`` holds exactly the bytes its shape needs."""
    dtype = table.dtype(slot)
    count = 1
    for d in table.dims(slot):  # in order, as safetensors does: no product past 2**64
        count *= d
        if count > USIZE_MAX:
            break
    bits = count * DTYPES[dtype].bits
    nbytes = table.ends[slot] - table.begins[slot]
    if bits <= USIZE_MAX and bits % 8 == 0 and nbytes == bits // 8:
        return
    name = _name(table.name(slot))
    shape = _show(list(itertools.islice(table.shape(slot), 9)))
    if bits > USIZE_MAX:
        problem = "overflows 2**64 elements or bits"
    elif bits % 8:
        problem = f"is {bits} bits, not a whole number of bytes"
    else:
        raise FormatError(
            f"{path}: tensor {name!r}: holds {nbytes} bytes but shape {shape} of {dtype} "
            f"needs {bits // 8}"
        )
    raise FormatError(f"{path}: tensor {name!r}: shape {shape} of {dtype} {problem}")
