"""Safetensors header validation: every rule, with the message a user sees."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from loaderplug.errors import FormatError
from loaderplug.header import MAX_HEADER_BYTES, header_length, parse_header


def encode(header: object, data: bytes = b"", *, raw: bytes | None = None) -> bytes:
    body = raw if raw is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(body)) + body + data


def parse(blob: bytes) -> object:
    n = header_length("m.safetensors", blob[:8], len(blob))
    return parse_header("m.safetensors", blob[8 : 8 + n], len(blob))


def t(dtype: str = "F32", shape: list[int] | None = None, offsets: list[int] | None = None) -> dict:
    return {"dtype": dtype, "shape": shape or [2], "data_offsets": offsets or [0, 8]}


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
    assert [x.name for x in header.tensors] == ["a", "b", "empty"]  # type: ignore[attr-defined]
    first = header.tensors[0]  # type: ignore[attr-defined]
    assert (first.begin, first.end) == (header.data_start, header.data_start + 8)  # type: ignore[attr-defined]
    assert header.metadata == {"format": "pt"}  # type: ignore[attr-defined]


MALFORMED = [
    ("too short", b"\x01\x02", "too short for a safetensors header"),
    (
        "huge length",
        struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}",
        "exceeds the 100000000-byte limit",
    ),
    ("length past end", struct.pack("<Q", 500) + b"{}", "header length 500 runs past the end"),
    ("not utf-8", encode(None, raw=b"\xff\xfe{}"), "not valid UTF-8 JSON"),
    ("not json", encode(None, raw=b"{nope"), "not valid UTF-8 JSON"),
    ("not an object", encode([1, 2]), "header is list, expected a JSON object"),
    ("entry not object", encode({"w": 3}), "tensor 'w': entry is int, expected an object"),
    ("unknown dtype", encode({"w": t(dtype="F17")}, bytes(8)), "unknown dtype 'F17'"),
    (
        "missing dtype",
        encode({"w": {"shape": [1], "data_offsets": [0, 4]}}, bytes(4)),
        "unknown dtype None",
    ),
    (
        "negative dim",
        encode({"w": t(shape=[-2])}, bytes(8)),
        "must be a list of non-negative integers",
    ),
    (
        "float dim",
        encode({"w": t(shape=[2.0])}, bytes(8)),
        "must be a list of non-negative integers",
    ),  # type: ignore[list-item]
    (
        "bool dim",
        encode({"w": t(shape=[True])}, bytes(8)),
        "must be a list of non-negative integers",
    ),  # type: ignore[list-item]
    (
        "shape not list",
        encode({"w": {"dtype": "F32", "shape": 2, "data_offsets": [0, 8]}}, bytes(8)),
        "must be a list",
    ),
    ("three offsets", encode({"w": t(offsets=[0, 4, 8])}, bytes(8)), "must be two integers"),
    ("offsets not ints", encode({"w": t(offsets=["0", "8"])}, bytes(8)), "must be two integers"),  # type: ignore[list-item]
    (
        "end before begin",
        encode({"w": t(offsets=[8, 0])}, bytes(8)),
        "fall outside the data region",
    ),
    (
        "past the data",
        encode({"w": t(offsets=[0, 8])}, bytes(4)),
        "fall outside the data region of 4 bytes",
    ),
    ("negative begin", encode({"w": t(offsets=[-8, 0])}, bytes(8)), "fall outside the data region"),
    (
        "size mismatch",
        encode({"w": t(shape=[3])}, bytes(8)),
        "holds 8 bytes but shape [3] of F32 needs 12",
    ),
    (
        "overlap",
        encode({"a": t(offsets=[0, 8]), "b": t(offsets=[4, 12])}, bytes(12)),
        "tensor 'b' overlaps 'a'",
    ),
    (
        "metadata not str",
        encode({"__metadata__": {"step": 3}}),
        "__metadata__ must map strings to strings",
    ),
    (
        "metadata not object",
        encode({"__metadata__": ["x"]}),
        "__metadata__ must map strings to strings",
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


def test_zero_size_tensors_may_share_an_offset() -> None:
    blob = encode({"a": t(shape=[0], offsets=[0, 0]), "b": t(shape=[0, 5], offsets=[0, 0])})
    assert len(parse(blob).tensors) == 2  # type: ignore[attr-defined]


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
    by_name = {x.name: x for x in header.tensors}  # type: ignore[attr-defined]
    raw = path.read_bytes()
    for name, tensor in tensors.items():
        info = by_name[name]
        assert info.shape == tuple(tensor.shape)
        assert raw[info.begin : info.end] == tensor.contiguous().view(torch.uint8).numpy().tobytes()
