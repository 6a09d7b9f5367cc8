"""Headers exactly as strict as safetensors: a differential property test.

Valid files written by safetensors itself are mutated (bytes, lengths, the JSON's
structure and text), and random bytes are made up; each is given to
``safetensors.torch.load_file`` and to loaderplug, mapped and streamed. Where safetensors
accepts a file, loaderplug returns the same tensors (dtype, shape, bytes); where it
refuses one, loaderplug raises :class:`FormatError`, and nothing else. Parsing a header
never allocates more than a bounded multiple of the header, and the tensors never hold
more than the file.

``HEADER_FUZZ_EXAMPLES`` sets the number of examples per test (CI: a few hundred,
derandomized, so every run tries the same files).
"""

from __future__ import annotations

import json
import math
import os
import struct
import tempfile
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

hypothesis = pytest.importorskip("hypothesis")
torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from hypothesis import event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from loaderplug.errors import FormatError  # noqa: E402
from loaderplug.tensors.format.dtypes import DTYPES  # noqa: E402
from loaderplug.tensors.format.header import LENGTH_BYTES, header_length, parse_header  # noqa: E402
from loaderplug.tensors.reader import iter_tensors, load_file  # noqa: E402
from tests.helpers.tensors import STREAMED  # noqa: E402

EXAMPLES = int(os.environ.get("HEADER_FUZZ_EXAMPLES", "150"))
FUZZ = settings(
    max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True
)
# Python objects for a JSON header: a bound generous for any header, far below what
# trusting a shape or an offset would allocate.
HEADER_MEMORY_FACTOR = 64
HEADER_MEMORY_SLACK = 256 * 1024

# The torch dtypes safetensors reads and writes (its own list, not loaderplug's table).
SAFETENSORS_TORCH_DTYPES = [
    *("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"),
    *("float16", "float32", "float64", "bfloat16", "complex64", "float4_e2m1fn_x2"),
    *("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"),
]
TORCH_DTYPES = [getattr(torch, n) for n in SAFETENSORS_TORCH_DTYPES if hasattr(torch, n)]
INTERESTING_INTS = [0, 1, 2, 3, 4, 7, 8, 2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64]
# JSON text: each one something serde_json and Python's json read differently, or a
# value a header must refuse.
TOKENS = [
    " ",
    "\t",
    "\n",
    "\r",
    "\x0c",
    "\x00",
    "\x7f",
    "é",
    ",",
    ":",
    '"',
    "\\",
    "[",
    "]",
    "{",
    "}",
    "0",
    "-0",
    "-1",
    "1.0",
    "1e2",
    "1e400",
    "-1e400",
    "1" * 25,
    "9" * 400,
    "1" * 5000,  # past Python's int digit limit
    "NaN",
    "Infinity",
    "-Infinity",
    "null",
    "true",
    '"\\ud800"',
    '"\\ud83d\\ude00"',
    '"\\udc00x"',
    '"\\u0000"',
    "[" * 130 + "]" * 130,
    "[" * 125 + "]" * 125,
    '"__metadata__":{}',
    '"__metadata__":null',
]


# -- files ---------------------------------------------------------------------------


class Obj(list):  # type: ignore[type-arg]
    """A JSON object as its (key, value) pairs: repeats allowed."""


def loads(text: str) -> Any:
    return json.loads(text, object_pairs_hook=Obj)


def dumps(value: Any, space: str) -> str:
    if isinstance(value, Obj):
        inner = f",{space}".join(f"{json.dumps(k)}:{space}{dumps(v, space)}" for k, v in value)
        return "{" + space + inner + space + "}"
    if isinstance(value, list):
        return "[" + f",{space}".join(dumps(v, space) for v in value) + "]"
    return json.dumps(value)


def pack(text: str | bytes, data: bytes, pad: int = 0) -> bytes:
    body = (text.encode() if isinstance(text, str) else text) + b" " * pad
    return struct.pack("<Q", len(body)) + body + data


def split(blob: bytes) -> tuple[int, bytes, bytes] | None:
    """``(length, header, data)`` of a file whose length field fits it, else None."""
    if len(blob) < LENGTH_BYTES:
        return None
    (n,) = struct.unpack("<Q", blob[:LENGTH_BYTES])
    if n > len(blob) - LENGTH_BYTES:
        return None
    return n, blob[LENGTH_BYTES : LENGTH_BYTES + n], blob[LENGTH_BYTES + n :]


@st.composite
def saved(draw: st.DrawFn) -> bytes:
    """A file safetensors writes: random small tensors of random dtypes, F4 included."""
    tensors = {}
    for _ in range(draw(st.integers(0, 4))):
        name = draw(st.text("abw.é0", max_size=3))
        dtype = draw(st.sampled_from(TORCH_DTYPES))
        shape = draw(st.lists(st.integers(0, 3), min_size=1, max_size=3))
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        data = bytearray(draw(st.binary(min_size=nbytes, max_size=nbytes)))
        raw = (
            torch.frombuffer(data, dtype=torch.uint8)
            if nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
        tensors[name] = raw.view(dtype).reshape(shape)
    # Not {}: safetensors 0.8 writes `{},"__metadata__":{}}` for it with no tensors.
    metadata = draw(
        st.none()
        | st.dictionaries(st.text("ab", max_size=2), st.text("xy", max_size=2), min_size=1)
    )
    blob: bytes = safetensors_torch.save(tensors, metadata=metadata)
    return blob


def interesting_json(draw: st.DrawFn) -> Any:
    """A JSON value a header's field might be given."""
    choice = draw(st.integers(0, 9))
    if choice == 0:
        return draw(st.sampled_from([*DTYPES, "f32", "F17", "", "BOOL "]))
    if choice == 1:
        return Obj([(draw(st.sampled_from([*DTYPES, "X"])), draw(st.sampled_from([None, 1, []])))])
    if choice == 2:
        return draw(st.lists(st.sampled_from(INTERESTING_INTS), max_size=4))
    if choice == 3:
        return draw(st.sampled_from([None, True, 1.5, -1, "x", 2**64, -(2**63) - 1]))
    if choice == 4:
        return Obj()
    if choice == 5:
        depth = draw(st.sampled_from([1, 100, 124, 125, 126, 127, 200]))
        value: Any = []
        for _ in range(depth - 1):
            value = [value]
        return value
    return draw(st.sampled_from(INTERESTING_INTS))


def mutate_json(draw: st.DrawFn, doc: Obj) -> Obj:
    """One structural edit of a header's JSON (objects as pairs, so keys may repeat)."""
    tensors = [i for i, (k, v) in enumerate(doc) if k != "__metadata__" and isinstance(v, Obj)]
    kind = draw(st.integers(0, 11))
    if tensors and kind <= 6:
        i = draw(st.sampled_from(tensors))
        name, entry = doc[i]
        fields = Obj(entry)
        if kind == 0 and fields:  # a field gets another value
            j = draw(st.integers(0, len(fields) - 1))
            fields[j] = (fields[j][0], interesting_json(draw))
        elif kind == 1:  # a dimension or an offset
            for j, (key, value) in enumerate(fields):
                if key in ("shape", "data_offsets") and isinstance(value, list) and value:
                    if not draw(st.booleans()):
                        continue
                    k = draw(st.integers(0, len(value) - 1))
                    near = [value[k] + 1, value[k] - 1] if type(value[k]) is int else []
                    value = list(value)
                    value[k] = draw(st.sampled_from([*near, *INTERESTING_INTS]))
                    fields[j] = (key, value)
        elif kind == 2 and fields:  # a field dropped
            del fields[draw(st.integers(0, len(fields) - 1))]
        elif kind == 3:  # a field repeated, or an unknown one
            key = draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))
            fields.append((key, interesting_json(draw)))
        elif kind == 4:  # serde's other spellings: an array entry, an enum-map dtype
            values = dict(fields)
            if draw(st.booleans()):
                doc[i] = (name, [values.get(f) for f in ("dtype", "shape", "data_offsets")])
                return doc
            if "dtype" in values:
                fields = Obj((k, Obj([(v, None)]) if k == "dtype" else v) for k, v in fields)
        elif kind == 5:  # the tensor named twice
            doc.insert(draw(st.integers(0, len(doc))), (name, interesting_entry(draw, fields)))
        elif kind == 6 and len(tensors) > 1:  # two tensors swap offsets
            j = draw(st.sampled_from([t for t in tensors if t != i]))
            other = Obj(doc[j][1])
            mine, theirs = dict(fields).get("data_offsets"), dict(other).get("data_offsets")
            doc[j] = (doc[j][0], with_field(other, "data_offsets", mine))
            fields = with_field(fields, "data_offsets", theirs)
        doc[i] = (name, fields)
        return doc
    if kind == 7:  # metadata
        doc.append(("__metadata__", draw(st.sampled_from([None, [], "x", Obj([("a", 1)])]))))
    elif kind == 8:
        doc.append((draw(st.sampled_from(["z", ""])), interesting_json(draw)))
    elif kind == 9 and doc:
        del doc[draw(st.integers(0, len(doc) - 1))]
    elif kind == 10:
        return [doc]  # type: ignore[return-value]
    else:
        doc.append(("w", Obj([("dtype", "U8"), ("shape", [1]), ("data_offsets", [0, 1])])))
    return doc


def with_field(entry: Obj, key: str, value: Any) -> Obj:
    return Obj([*((k, v) for k, v in entry if k != key), (key, value)])


def interesting_entry(draw: st.DrawFn, fields: Obj) -> Any:
    return draw(st.sampled_from([fields, Obj(), [], None])) if draw(st.booleans()) else fields


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A file safetensors wrote, then mutated one to three times."""
    blob = bytearray(draw(saved()))
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.integers(0, 9))
        parts = split(bytes(blob))
        if kind <= 2 and parts is not None:  # the JSON, edited and written back
            n, header, data = parts
            try:
                doc = loads(header.decode())
            except ValueError:
                continue
            if isinstance(doc, Obj):
                doc = mutate_json(draw, doc)
            text = dumps(doc, draw(st.sampled_from(["", " ", "\n"])))
            blob = bytearray(pack(text, data, pad=draw(st.integers(0, 8))))
        elif kind == 3 and parts is not None:  # a token in the JSON's text
            n, header, data = parts
            at = draw(st.integers(0, len(header)))
            token = draw(st.sampled_from(TOKENS)).encode()
            if draw(st.booleans()):  # replace bytes instead of inserting
                header = header[:at] + token + header[at + len(token) :]
            else:
                header = header[:at] + token + header[at:]
            blob = bytearray(pack(header, data))
        elif kind == 4:  # the length field, a little or a lot off
            (n,) = struct.unpack("<Q", bytes(blob[:8]).ljust(8, b"\0"))
            delta = draw(st.integers(-9, 9))
            near = min(max(n + delta, 0), 2**64 - 1)
            value = draw(st.sampled_from([near, 2**64 - 1, 100_000_000, 2**63]))
            blob[:8] = struct.pack("<Q", value)
        elif kind == 5 and blob:  # a byte changed
            at = draw(st.integers(0, len(blob) - 1))
            blob[at] = draw(st.integers(0, 255))
        elif kind == 6:  # bytes inserted
            at = draw(st.integers(0, len(blob)))
            blob[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif kind == 7 and blob:  # bytes deleted
            at = draw(st.integers(0, len(blob) - 1))
            del blob[at : at + draw(st.integers(1, 8))]
        elif kind == 8:  # bytes appended
            blob += draw(st.binary(min_size=1, max_size=8))
        else:  # cut short
            del blob[draw(st.integers(0, len(blob))) :]
    return bytes(blob)


@st.composite
def random_files(draw: st.DrawFn) -> bytes:
    """Random bytes, or a random JSON-ish header with a length that fits it."""
    if draw(st.booleans()):
        return bytes(draw(st.binary(max_size=96)))
    text = "".join(
        draw(st.lists(st.sampled_from([*TOKENS, '"w"', '"dtype"', '"F32"']), max_size=12))
    )
    data = draw(st.just(b"") | st.binary(max_size=16))
    return pack(text, data)


# -- the check -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="header-fuzz-") as name:
        yield Path(name)


def as_bytes(tensor: Any) -> bytes:
    return bytes(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else b""


def assert_same(got: dict[str, Any], expected: dict[str, Any], how: str) -> None:
    assert sorted(got) == sorted(expected), how
    for name, tensor in expected.items():
        mine = got[name]
        assert (mine.dtype, mine.shape) == (tensor.dtype, tensor.shape), (how, name)
        assert as_bytes(mine) == as_bytes(tensor), (how, name)


def check_header_memory(blob: bytes) -> None:
    """Parsing allocates in proportion to the header, never to what it claims; an
    accepted header's tensors lie inside the file and hold no more than it."""
    parts = split(blob)
    if parts is None:
        return
    n, raw, _ = parts
    tracemalloc.start()
    try:
        header_length("f", blob[:LENGTH_BYTES], len(blob))
        header = parse_header("f", raw, len(blob))
    except FormatError:
        return
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak <= HEADER_MEMORY_FACTOR * n + HEADER_MEMORY_SLACK, (peak, n)
    assert sum(t.nbytes for t in header.tensors) == len(blob) - header.data_start
    assert all(header.data_start <= t.begin <= t.end <= len(blob) for t in header.tensors)


def differential(blob: bytes, path: Path) -> str:
    """Loads ``blob`` with safetensors and loaderplug (mapped, then streamed); their
    outcome, once they are seen to agree."""
    path.write_bytes(blob)
    try:
        expected = safetensors_torch.load_file(str(path))
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException:  # a Rust panic is a BaseException
        expected = None
    check_header_memory(blob)
    loaders: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        ("mapped", lambda: load_file(path)),
        ("streamed", lambda: dict(iter_tensors([path], **STREAMED))),
    ]
    for how, load in loaders:
        if expected is None:
            with pytest.raises(FormatError):
                load()
        else:
            got = load()
            assert_same(got, expected, how)
            held = sum(t.untyped_storage().nbytes() for t in got.values())
            assert held <= len(blob), how
    outcome = "both rejected" if expected is None else "accepted, equal"
    event(outcome)
    return outcome


@pytest.mark.slow("loads thousands of mutated files")
@FUZZ
@given(blob=mutated())
def test_mutated_files_load_exactly_when_safetensors_loads_them(folder: Path, blob: bytes) -> None:
    differential(blob, folder / "m.safetensors")


@FUZZ
@given(blob=random_files())
def test_random_bytes_load_exactly_when_safetensors_loads_them(folder: Path, blob: bytes) -> None:
    differential(blob, folder / "r.safetensors")


@FUZZ
@given(blob=saved())
def test_files_safetensors_writes_load_equal(folder: Path, blob: bytes) -> None:
    assert differential(blob, folder / "s.safetensors") == "accepted, equal"
