"""A header's tensors held compact: a parse keeps a few dozen bytes a tensor in arrays,
never Python objects, so a header of millions of tensors costs about its own size; a
:class:`TensorInfo` is made each time one is asked for (``header.tensors[i]``, or
iterating them), and is the consumer's to keep or drop.

The table also applies the rule for a tensor named twice (the last entry counts, at the
place of the first, as a dict keeps it) without a set of every name: a table of slot
numbers and hash bits finds a name given before. And it gives the tensors in the order
of their offsets, without sorting what safetensors already writes in that order.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import overload

from loaderplug.tensors.format.dtypes import DTYPES

_DTYPE_NAMES = tuple(DTYPES)
_DTYPE_INDEX = {name: i for i, name in enumerate(_DTYPE_NAMES)}


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
        :func:`loaderplug.tensors.format.torch_dtypes.torch_dtypes` reports before any read."""
        return DTYPES[self.dtype].torch_shape(self.shape)


def _put_varints(values: Iterable[int], out: bytearray) -> None:
    # Seven bits a byte: a dimension costs no more than its digits and comma in the JSON.
    for value in values:
        while value >= 0x80:
            out.append((value & 0x7F) | 0x80)
            value >>= 7
        out.append(value)


def _varints(data: bytearray, begin: int, end: int) -> Iterator[int]:
    value = shift = 0
    for byte in data[begin:end]:
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            yield value
            value = shift = 0


def _shape(data: bytearray, begin: int, end: int) -> tuple[int, ...]:
    """The varints of ``data[begin:end]`` as a tuple: :func:`_varints` in one call, for
    the shapes every tensor made is given."""
    if end - begin == 1:  # one dimension under 128
        return (data[begin],)
    dims = []
    value = shift = 0
    for at in range(begin, end):
        byte = data[at]
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            dims.append(value)
            value = shift = 0
    return tuple(dims)


class _FirstSlots:
    """Each distinct name's slot: an open-addressing table of slot numbers beside the
    low 32 bits of each name's hash, eight bytes an entry, never a Python object a name.
    The names themselves are compared only where those bits agree."""

    def __init__(self) -> None:
        self._slots = array("i", [-1]) * 1024
        self._tags = array("I", [0]) * 1024
        self._used = 0

    def find(self, table: TensorTable, name: bytes | memoryview, new_slot: int) -> int:
        """The slot of the entry named ``name`` before, else ``new_slot``, recorded."""
        tag = hash(name) & 0xFFFFFFFF
        mask = len(self._slots) - 1
        i = tag & mask
        while (slot := self._slots[i]) >= 0:
            if self._tags[i] == tag and table.name(slot) == name:
                return slot
            i = (i + 1) & mask
        self._slots[i], self._tags[i] = new_slot, tag
        self._used += 1
        if 3 * self._used > 2 * len(self._slots):
            self._grow()
        return new_slot

    def _grow(self) -> None:
        slots, tags = self._slots, self._tags
        self._slots = array("i", [-1]) * (2 * len(slots))
        self._tags = array("I", [0]) * (2 * len(slots))
        mask = len(self._slots) - 1
        for slot, tag in zip(slots, tags, strict=True):
            if slot >= 0:
                i = tag & mask
                while self._slots[i] >= 0:
                    i = (i + 1) & mask
                self._slots[i], self._tags[i] = slot, tag


# A shape of at most this many bytes of varints is decoded whole.
SHORT_SHAPE = 64

# Slots sorted at a time where a header's tensors are not in the order of their offsets:
# the sort's Python integers stay a few megabytes; the runs are then merged.
SORT_RUN = 1 << 14


class TensorTable:
    """A header's tensors as they are parsed, one slot a name, in the header's order."""

    def __init__(self) -> None:
        self.names = bytearray()  # the names' UTF-8, one after the other
        self.name_ends = array("I")
        self.dtypes = bytearray()
        self.shapes = bytearray()  # each shape's dimensions as varints
        self.shape_spans = array("I")  # begin, end in ``shapes``, per slot
        self.begins = array("Q")  # offsets in the data area, as the header gives them
        self.ends = array("Q")
        self._first: _FirstSlots | None = _FirstSlots()

    def __len__(self) -> int:
        return len(self.dtypes)

    def add(
        self, name: bytes | memoryview, dtype: str, shape: Iterable[int], begin: int, end: int
    ) -> None:
        """One more entry (its values checked); a name given before keeps its place and
        takes this entry's tensor: the last entry of a name counts."""
        assert self._first is not None, "the table is done"
        slot = self._first.find(self, name, len(self))
        if slot == len(self):
            self.names += name
            self.name_ends.append(len(self.names))
            self.dtypes.append(0)
            self.shape_spans.extend((0, 0))
            self.begins.append(0)
            self.ends.append(0)
        self.dtypes[slot] = _DTYPE_INDEX[dtype]
        self.shape_spans[2 * slot] = len(self.shapes)
        _put_varints(shape, self.shapes)
        self.shape_spans[2 * slot + 1] = len(self.shapes)
        self.begins[slot], self.ends[slot] = begin, end

    def append(self, name: bytes, dtype: str, shape: Iterable[int], begin: int, end: int) -> None:
        """One more entry, of a name known to be new (a header decoded whole, whose keys
        were counted): :meth:`add` without the look for an earlier one."""
        self.names += name
        self.name_ends.append(len(self.names))
        self.dtypes.append(_DTYPE_INDEX[dtype])
        self.shape_spans.append(len(self.shapes))
        _put_varints(shape, self.shapes)
        self.shape_spans.append(len(self.shapes))
        self.begins.append(begin)
        self.ends.append(end)

    def name(self, slot: int) -> bytes:
        return bytes(self.names[self.name_ends[slot - 1] if slot else 0 : self.name_ends[slot]])

    def shape(self, slot: int) -> Iterator[int]:
        return _varints(self.shapes, self.shape_spans[2 * slot], self.shape_spans[2 * slot + 1])

    def dims(self, slot: int) -> Iterable[int]:
        """:meth:`shape`, as a tuple where it is short (a hostile one of a million
        dimensions stays a generator)."""
        begin, end = self.shape_spans[2 * slot], self.shape_spans[2 * slot + 1]
        return _shape(self.shapes, begin, end) if end - begin <= SHORT_SHAPE else self.shape(slot)

    def dtype(self, slot: int) -> str:
        return _DTYPE_NAMES[self.dtypes[slot]]

    def order(self) -> array[int] | None:
        """The slots by offsets (then by place, as a stable sort leaves ties); None
        where that is the slots as they stand (as safetensors writes them)."""
        previous = (-1, -1)
        for slot in range(len(self)):
            here = (self.begins[slot], self.ends[slot])
            if here < previous:
                break
            previous = here
        else:
            return None
        runs = [self._sorted(first) for first in range(0, len(self), SORT_RUN)]
        merged = heapq.merge(*runs, key=lambda s: (self.begins[s], self.ends[s], s))
        return array("I", merged)

    def _sorted(self, first: int) -> array[int]:
        # One integer a slot, sorted in place: offsets first, the slot last.
        slots = range(first, min(first + SORT_RUN, len(self)))
        keys = [(self.begins[s] << 96) | (self.ends[s] << 32) | s for s in slots]
        keys.sort()
        return array("I", (key & 0xFFFFFFFF for key in keys))

    def info(self, slot: int, data_start: int) -> TensorInfo:
        ends = self.name_ends
        name = self.names[ends[slot - 1] if slot else 0 : ends[slot]].decode()
        spans = self.shape_spans
        shape = _shape(self.shapes, spans[2 * slot], spans[2 * slot + 1])
        begin, end = data_start + self.begins[slot], data_start + self.ends[slot]
        return TensorInfo(name, _DTYPE_NAMES[self.dtypes[slot]], shape, begin, end)

    def done(self) -> None:
        """Parsing is over: what only it needed goes."""
        self._first = None


class Tensors(Sequence[TensorInfo]):
    """A header's tensors in the order of their offsets, each made when asked for."""

    def __init__(self, table: TensorTable, order: array[int] | None, data_start: int) -> None:
        self._table = table
        self._order = order
        self._data_start = data_start

    def __len__(self) -> int:
        return len(self._table) if self._order is None else len(self._order)

    @overload
    def __getitem__(self, index: int) -> TensorInfo: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[TensorInfo, ...]: ...

    def __getitem__(self, index: int | slice) -> TensorInfo | tuple[TensorInfo, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"tensor {index} of {len(self)}")
        slot = index if self._order is None else self._order[index]
        return self._table.info(slot, self._data_start)

    def __iter__(self) -> Iterator[TensorInfo]:
        info, start = self._table.info, self._data_start
        for slot in range(len(self._table)) if self._order is None else self._order:
            yield info(slot, start)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Tensors({len(self)} tensors)"


class PackedMetadata(Mapping[str, str]):
    """A ``__metadata__`` too large to hold as Python strings while parsing: its pairs
    packed as UTF-8, made a dict (the last value of a key counting) on first use."""

    def __init__(self) -> None:
        self._packed = bytearray()
        self._ends = array("I")  # each key's end, then each value's
        self._dict: dict[str, str] | None = None

    def add(self, key: bytes, value: bytes | memoryview) -> None:
        self._packed += key
        self._ends.append(len(self._packed))
        self._packed += value
        self._ends.append(len(self._packed))

    def _items(self) -> dict[str, str]:
        if self._dict is None:
            texts = []
            begin = 0
            for end in self._ends:
                texts.append(self._packed[begin:end].decode())
                begin = end
            self._dict = dict(zip(texts[::2], texts[1::2], strict=True))
        return self._dict

    def __getitem__(self, key: str) -> str:
        return self._items()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._items())
