"""Safetensors header validation: every rule, with the message a user sees, and each rule
checked against the installed safetensors (it must refuse, or accept, the same file)."""

from __future__ import annotations

import json
import re
import struct
import types
from pathlib import Path
from typing import Any

import pytest

from loaderplug.errors import FormatError
from loaderplug.tensors.format.dtypes import DTYPES
from loaderplug.tensors.format.header import (
    MAX_DEPTH,
    MAX_HEADER_BYTES,
    Header,
    TensorInfo,
    header_length,
    parse_header,
)


def encode(header: object, data: bytes = b"", *, raw: bytes | None = None) -> bytes:
    body = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data


def parse(blob: bytes) -> Header:
    n = header_length("m.safetensors", blob[:8], len(blob))
    return parse_header("m.safetensors", blob[8 : 8 + n], len(blob))


def t(dtype: str = "F32", shape: list[Any] | None = None, offsets: list[Any] | None = None) -> dict:
    return {
        "dtype": dtype,
        "shape": [2] if shape is None else shape,
        "data_offsets": offsets or [0, 8],
    }


W = b'"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]'


def with_field(value: bytes) -> bytes:
    """A valid one-tensor file whose tensor has an extra (ignored) field of raw JSON."""
    return encode(None, bytes(8), raw=b"{" + W + b',"extra":' + value + b"}}")


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def safetensors_loads(blob: bytes, tmp_path: Path) -> bool:
    """Whether ``safetensors.torch.load_file`` accepts ``blob``."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path / "probe.safetensors"
    path.write_bytes(blob)
    try:
        safetensors_torch.load_file(str(path))
    except Exception:
        return False
    return True


def test_a_valid_header_gives_absolute_offsets_sorted_by_position() -> None:
    blob = encode(
        {
            "b": t(offsets=[8, 16]),
            "a": t(),
            "empty": t(shape=[0], offsets=[16, 16]),
            "__metadata__": {"format": "pt"},
        },
        bytes(16),
    )
    header = parse(blob)
    assert [x.name for x in header.tensors] == ["a", "b", "empty"]
    first = header.tensors[0]
    assert (first.begin, first.end) == (header.data_start, header.data_start + 8)
    assert header.metadata == {"format": "pt"}


MALFORMED = [
    ("too short", b"\x01\x02", "too short for a safetensors header"),
    (
        "huge length",
        struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}",
        "exceeds the 100000000-byte limit",
    ),
    ("length past end", struct.pack("<Q", 500) + b"{}", "header length 500 runs past the end"),
    ("empty header", encode(None, raw=b""), "not valid JSON"),
    ("not utf-8", encode(None, raw=b"\xff\xfe{}"), "not valid UTF-8"),
    ("not json", encode(None, raw=b"{nope"), "not valid JSON"),
    ("trailing NUL", encode(None, raw=b"{}\x00"), "not valid JSON"),
    ("trailing form feed", encode(None, raw=b"{} \x0c"), "not valid JSON"),
    ("byte order mark", encode(None, raw=b"\xef\xbb\xbf{}"), "not valid JSON"),
    ("control character", encode(None, raw=b'{"a\x01b": 1}'), "not valid JSON"),
    ("NaN", with_field(b"NaN"), "NaN is not JSON"),
    ("Infinity", with_field(b"-Infinity"), "-Infinity is not JSON"),
    ("float out of range", with_field(b"1e400"), "out of range of a 64-bit float"),
    ("integer out of range", with_field(b"9" * 400), "out of range of a 64-bit float"),
    ("5000-digit integer", with_field(b"1" * 5000), "out of range"),
    ("5000 digits, with -0", with_field(b"[-0, " + b"1" * 5000 + b"]"), "out of range"),
    ("lone surrogate", with_field(b'"\\ud800"'), "lone surrogate escape"),
    ("lone surrogate key", encode(None, raw=b'{"\\udc00": 1}'), "lone surrogate escape"),
    ("nested too deep", with_field(nested(MAX_DEPTH - 1)), "nests deeper than the 127 levels"),
    ("nested far too deep", encode(None, raw=nested(100_000)), "nests deeper than the 127"),
    ("not an object", encode([1, 2]), "header is list, expected a JSON object"),
    ("entry not object", encode({"w": 3}), "tensor 'w': entry is a number, expected an object"),
    ("entry too short", encode({"w": ["F32", [2]]}, bytes(8)), "entry is an array of 2"),
    ("unknown dtype", encode({"w": t(dtype="F17")}, bytes(8)), 'unknown dtype "F17"'),
    ("lowercase dtype", encode({"w": t(dtype="f32")}, bytes(8)), 'unknown dtype "f32"'),
    ("dtype map of 1", encode({"w": t(dtype={"F32": 1})}, bytes(8)), "unknown dtype"),  # type: ignore[arg-type]
    ("dtype map of 2", encode({"w": t(dtype={"F32": None, "U8": None})}, bytes(8)), "unknown"),  # type: ignore[arg-type]
    (
        "missing dtype",
        encode({"w": {"shape": [1], "data_offsets": [0, 4]}}, bytes(4)),
        "tensor 'w': missing field 'dtype'",
    ),
    (
        "field twice",
        encode(
            None,
            bytes(4),
            raw=b'{"w":{"dtype":"F32","shape":[1],"shape":[1],"data_offsets":[0,4]}}',
        ),
        "tensor 'w': field 'shape' appears twice",
    ),
    ("negative dim", encode({"w": t(shape=[-2])}, bytes(8)), "must be a list of integers"),
    ("float dim", encode({"w": t(shape=[2.0])}, bytes(8)), "shape [2.0] must be a list"),
    ("bool dim", encode({"w": t(shape=[True])}, bytes(8)), "shape [true] must be a list"),
    (
        "-0 dim",
        encode(None, raw=b'{"w":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}'),
        "shape [-0.0] must be a list",
    ),
    ("dim 2**64", encode({"w": t(shape=[2**64, 0], offsets=[0, 0])}), "must be a list of integers"),
    (
        "shape not list",
        encode({"w": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}}, bytes(8)),
        "must be a list",
    ),
    ("three offsets", encode({"w": t(offsets=[0, 4, 8])}, bytes(8)), "must be two integers"),
    ("offsets not ints", encode({"w": t(offsets=["0", "8"])}, bytes(8)), "must be two integers"),
    ("negative begin", encode({"w": t(offsets=[-8, 0])}, bytes(8)), "must be two integers"),
    ("end before begin", encode({"w": t(offsets=[8, 0])}, bytes(8)), "ends before it begins"),
    (
        "gap at the start",
        encode({"w": t(offsets=[4, 12])}, bytes(12)),
        "tensor 'w': data_offsets [4, 12] leaves bytes [0, 4) of the data area unused",
    ),
    (
        "gap between",
        encode({"a": t(), "b": t(offsets=[12, 20])}, bytes(20)),
        "tensor 'b': data_offsets [12, 20] leaves bytes [8, 12)",
    ),
    (
        "overlap",
        encode({"a": t(offsets=[0, 8]), "b": t(offsets=[4, 12])}, bytes(12)),
        "tensor 'b': data_offsets [4, 12] overlaps the tensor before it",
    ),
    (
        "same bytes twice",
        encode({"a": t(), "b": t()}, bytes(8)),
        "overlaps the tensor before it, which ends at 8",
    ),
    (
        "past the data",
        encode({"w": t(offsets=[0, 8])}, bytes(4)),
        "the tensors cover 8 bytes of a 4-byte data area; they run past the end of the file",
    ),
    (
        "bytes left over",
        encode({"w": t()}, bytes(9)),
        "cover 8 bytes of a 9-byte data area; 1 bytes after the last tensor belong to none",
    ),
    ("bytes and no tensors", encode({}, b"x"), "cover 0 bytes of a 1-byte data area"),
    (
        "size mismatch",
        encode({"w": t(shape=[3])}, bytes(8)),
        "holds 8 bytes but shape [3] of F32 needs 12",
    ),
    (
        "element count overflows",
        encode({"w": t(shape=[2**40, 2**40, 0], offsets=[0, 0])}),
        "shape [1099511627776, 1099511627776, 0] of F32 overflows 2**64",
    ),
    (
        "bit count overflows",
        encode({"w": t(dtype="U8", shape=[2**63, 1], offsets=[0, 0])}),
        "of U8 overflows 2**64",
    ),
    (
        "sub-byte tensor not whole bytes",
        encode({"w": t(dtype="F4", shape=[3], offsets=[0, 2])}, bytes(2)),
        "shape [3] of F4 is 12 bits, not a whole number of bytes",
    ),
    (
        "sub-byte scalar",
        encode({"w": t(dtype="F6_E2M3", shape=[], offsets=[0, 1])}, bytes(1)),
        "shape [] of F6_E2M3 is 6 bits",
    ),
    (
        "metadata twice",
        encode(None, raw=b'{"__metadata__":null,"__metadata__":{}}'),
        "__metadata__ appears twice",
    ),
    (
        "metadata not str",
        encode({"__metadata__": {"step": 3}}),
        "__metadata__['step'] is a number, expected a string",
    ),
    (
        "metadata not object",
        encode({"__metadata__": ["x"]}),
        "__metadata__ is an array, expected an object",
    ),
]


@pytest.mark.parametrize(("case", "blob", "message"), MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_headers_are_refused_with_a_clear_message(
    case: str, blob: bytes, message: str
) -> None:
    with pytest.raises(FormatError) as info:
        parse(blob)
    assert message in str(info.value)
    assert str(info.value).startswith("m.safetensors")


@pytest.mark.parametrize(("case", "blob", "message"), MALFORMED, ids=[c[0] for c in MALFORMED])
def test_safetensors_refuses_them_too(case: str, blob: bytes, message: str, tmp_path: Path) -> None:
    assert not safetensors_loads(blob, tmp_path)


# Odd files safetensors reads all the same: refusing them would not be a drop-in.
ACCEPTED = [
    ("whitespace around", encode(None, raw=b" \t\n\r{}\r\n\t ")),
    ("header not padded", encode(None, bytes(8), raw=b"{" + W + b"}}")),
    ("no tensors", encode({})),
    ("metadata null", encode({"__metadata__": None})),
    ("metadata key twice", encode(None, raw=b'{"__metadata__":{"a":"1","a":"2"}}')),
    (
        "tensor named twice",
        encode(
            None,
            bytes(4),
            raw=b'{"w":'
            + json.dumps(t()).encode()
            + b',"w":'
            + json.dumps(t(shape=[1], offsets=[0, 4])).encode()
            + b"}",
        ),
    ),
    ("array entry", encode({"w": ["F32", [2], [0, 8]]}, bytes(8))),
    ("enum-map dtype", encode({"w": t(dtype={"F32": None})}, bytes(8))),  # type: ignore[arg-type]
    ("unknown field", with_field(b'{"a": [1, {"b": null}], "a": 2}')),
    ("nested 127 deep", with_field(nested(MAX_DEPTH - 2))),
    ("-0 where unused", with_field(b"-0")),
    ("long integer where unused", with_field(b"9" * 300)),
    ("surrogate pair", with_field(b'"\\ud83d\\ude00"')),
    (
        "escaped names",
        encode(
            None,
            bytes(8),
            raw=b'{"\\u0077":{"\\u0064type":"F\\u00332","shape":[2],"data_offsets":[0,8]}}',
        ),
    ),
    ("scalar", encode({"w": t(shape=[], offsets=[0, 4])}, bytes(4))),
    (
        "zero-size tensors share an offset",
        encode({"a": t(shape=[0], offsets=[0, 0]), "b": t(shape=[0, 5], offsets=[0, 0])}),
    ),
    ("huge dims, no elements", encode({"w": t(shape=[2**63 - 1, 0, 2**63 - 1], offsets=[0, 0])})),
    ("products in order", encode({"w": t(shape=[0, 2**40, 2**40], offsets=[0, 0])})),
    ("F4, two a byte", encode({"w": t(dtype="F4", shape=[3, 2], offsets=[0, 3])}, bytes(3))),
]


@pytest.mark.parametrize(("case", "blob"), ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_odd_headers_safetensors_reads_are_read(case: str, blob: bytes, tmp_path: Path) -> None:
    header = parse(blob)
    assert sum(x.nbytes for x in header.tensors) == len(blob) - header.data_start
    assert safetensors_loads(blob, tmp_path)


def test_a_tensor_named_twice_is_the_last_one() -> None:
    raw = (
        b'{"w":'
        + json.dumps(t()).encode()
        + b',"w":'
        + json.dumps(t("U8", [4], [0, 4])).encode()
        + b"}"
    )
    (w,) = parse(encode(None, bytes(4), raw=raw)).tensors
    assert (w.dtype, w.shape, w.nbytes) == ("U8", (4,), 4)


def test_a_duplicate_metadata_key_keeps_the_last_value() -> None:
    header = parse(encode(None, raw=b'{"__metadata__":{"a":"1","b":"x","a":"2"}}'))
    assert header.metadata == {"a": "2", "b": "x"}


def test_a_header_length_one_byte_short_is_refused(tmp_path: Path) -> None:
    # safetensors pads its headers with spaces: one byte short is still JSON, but the
    # data area then starts a byte early, and every tensor would be read a byte off.
    good = encode(None, bytes(8), raw=b"{" + W + b"}}" + b"   ")
    (n,) = struct.unpack("<Q", good[:8])
    short = struct.pack("<Q", n - 1) + good[8:]
    assert parse(good).tensors[0].begin == 8 + n
    with pytest.raises(FormatError, match="1 bytes after the last tensor belong to none"):
        parse(short)
    assert not safetensors_loads(short, tmp_path)


def test_a_header_at_the_length_limit_is_read() -> None:
    first8 = struct.pack("<Q", MAX_HEADER_BYTES)
    assert header_length("m", first8, 8 + MAX_HEADER_BYTES) == MAX_HEADER_BYTES


@pytest.mark.parametrize(
    "blob",
    [
        encode(None, raw=b"[" * 50_000),  # json: RecursionError
        with_field(b"7" * 5000),  # int(): ValueError, past its digit limit
        encode({"w": t(shape=[2**63, 0], offsets=[0, 0])}),  # torch: overflow in a shape
        encode({"w": t(shape=[2**40, 2**40, 0], offsets=[0, 0])}),  # overflow in a product
    ],
    ids=["deep nesting", "5000-digit integer", "dim 2**63", "product past 2**64"],
)
def test_what_crashed_the_reader_is_a_format_error(blob: bytes) -> None:
    pytest.importorskip("torch")
    from loaderplug.tensors.format.torch_dtypes import torch_dtypes

    with pytest.raises(FormatError):
        torch_dtypes(parse(blob))


def test_the_dtype_table_is_the_one_safetensors_knows(tmp_path: Path) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    path = tmp_path / "probe.safetensors"
    path.write_bytes(encode({"w": t(dtype="NOT_A_DTYPE")}, bytes(8)))
    with pytest.raises(Exception, match="expected one of") as info:
        safetensors_torch.load_file(str(path))
    known = set(re.findall(r"`(\w+)`", str(info.value).split("expected one of")[1]))
    assert known == set(DTYPES)


def test_sizes_are_in_bits_and_sub_byte_shapes_are_packed_for_torch() -> None:
    assert {d.name: d.bits for d in DTYPES.values() if d.bits < 8} == {
        "F4": 4,
        "F6_E2M3": 6,
        "F6_E3M2": 6,
    }
    f4 = TensorInfo("w", "F4", (3, 4), 0, 6)
    assert f4.nbytes == 6  # the bytes in the file
    assert f4.torch_shape == (3, 2)  # float4_e2m1fn_x2: two values an element
    assert TensorInfo("w", "F32", (3, 4), 0, 48).torch_shape == (3, 4)
    with pytest.raises(ValueError, match="must be divisible by 2"):
        _ = TensorInfo("w", "F4", (2, 3), 0, 3).torch_shape


# -- torch: every dtype safetensors.torch reads, with its shape ------------------------


@pytest.mark.parametrize(
    ("case", "blob", "message"),
    [
        (
            "no torch dtype",
            encode({"w": t(dtype="F6_E2M3", shape=[4], offsets=[0, 3])}, bytes(3)),
            "tensor 'w': dtype F6_E2M3 has no torch dtype",
        ),
        (
            "odd last dim of F4",
            encode({"w": t(dtype="F4", shape=[2, 3], offsets=[0, 3])}, bytes(3)),
            "last dimension of shape [2, 3] must be divisible by 2",
        ),
        (
            "dim past torch's",
            encode({"w": t(shape=[0, 2**63], offsets=[0, 0])}),
            "has a dimension above torch's 9223372036854775807",
        ),
    ],
    ids=["F6", "F4 odd", "2**63"],
)
def test_what_torch_cannot_hold_is_a_format_error_before_any_read(
    case: str, blob: bytes, message: str, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    from loaderplug.tensors.format.torch_dtypes import torch_dtypes

    with pytest.raises(FormatError, match=re.escape(message)):
        torch_dtypes(parse(blob))
    assert not safetensors_loads(blob, tmp_path)


def test_a_dtype_this_torch_lacks_is_a_format_error_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch = pytest.importorskip("torch")
    from loaderplug.tensors.format import torch_dtypes

    old = types.SimpleNamespace(__version__="2.0.0", float32=torch.float32)
    monkeypatch.setattr(torch_dtypes, "torch_module", lambda: old)
    header = parse(encode({"w": t(dtype="F4", shape=[2], offsets=[0, 1])}, bytes(1)))
    with pytest.raises(
        FormatError, match=r"needs torch.float4_e2m1fn_x2, which this torch \(2.0.0\) lacks"
    ):
        torch_dtypes.torch_dtypes(header)


def as_bytes(tensor: Any) -> bytes:
    import torch

    return bytes(tensor.reshape(-1).view(torch.uint8).numpy()) if tensor.numel() else b""


@pytest.mark.parametrize("dtype", [d for d in DTYPES if DTYPES[d].torch_name is not None])
def test_every_dtype_loads_as_safetensors_loads_it(dtype: str, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from loaderplug.tensors.reader import iter_tensors, load_file
    from tests.helpers.tensors import STREAMED

    if not hasattr(torch, DTYPES[dtype].torch_name or ""):
        pytest.skip(f"this torch has no {DTYPES[dtype].torch_name}")
    size = 12 * DTYPES[dtype].bits // 8
    path = tmp_path / "m.safetensors"
    path.write_bytes(encode({"w": t(dtype, [3, 4], [0, size])}, bytes(range(7, 7 + size))))
    expected = safetensors_torch.load_file(str(path))["w"]
    for got in (load_file(path)["w"], dict(iter_tensors([path], **STREAMED))["w"]):
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape)
        assert as_bytes(got) == as_bytes(expected)


def test_f4_loads_with_the_shape_safetensors_gives_it(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from loaderplug.tensors.reader import load_file

    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    packed = torch.arange(8, dtype=torch.uint8).reshape(2, 4).view(torch.float4_e2m1fn_x2)
    path = tmp_path / "f4.safetensors"
    safetensors_torch.save_file({"x": packed, "z": packed[:0]}, str(path))
    assert parse(path.read_bytes()).tensors[0].shape == (2, 8)  # values, as the file says
    got, expected = load_file(path), safetensors_torch.load_file(str(path))
    assert got["x"].shape == expected["x"].shape == (2, 4)
    assert as_bytes(got["x"]) == as_bytes(packed)
    assert got["z"].shape == expected["z"].shape == (0, 4)


def test_a_tensor_of_no_elements_and_huge_dims_loads_as_safetensors_loads_it(
    tmp_path: Path,
) -> None:
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from loaderplug.tensors.reader import load_file

    shape = [0, 2**63 - 1, 2**63 - 1]  # torch.empty(shape) refuses it: its strides overflow
    path = tmp_path / "m.safetensors"
    path.write_bytes(encode({"w": t(shape=shape, offsets=[0, 0])}))
    got, expected = load_file(path)["w"], safetensors_torch.load_file(str(path))["w"]
    assert got.shape == expected.shape == torch.Size(shape)
    assert got.dtype == expected.dtype


def test_a_malformed_file_is_never_read_past_its_header(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from loaderplug.tensors.reader import load_file

    good = encode(None, bytes(range(8)), raw=b"{" + W + b"}}" + b"   ")
    (n,) = struct.unpack("<Q", good[:8])
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", n - 1) + good[8:])
    with pytest.raises(FormatError, match="bytes after the last tensor"):
        load_file(path)


def test_headers_written_by_safetensors_parse_to_its_own_offsets(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.torch import save_file

    tensors = {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.ones(5, dtype=torch.bfloat16),
        "z": torch.empty(0, 7, dtype=torch.int64),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    header = parse(path.read_bytes())
    by_name = {x.name: x for x in header.tensors}
    raw = path.read_bytes()
    for name, tensor in tensors.items():
        info = by_name[name]
        assert info.shape == tuple(tensor.shape)
        assert raw[info.begin : info.end] == tensor.contiguous().view(torch.uint8).numpy().tobytes()
