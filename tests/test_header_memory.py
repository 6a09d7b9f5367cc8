"""Parsing a safetensors header takes memory in proportion to the header, measured with
tracemalloc: within MEMORY_FACTOR times its size for a header as safetensors writes it
(one of 20 MB is ten thousands of tensors: a large mixture of experts), within
MOST_MEMORY_FACTOR times for any header, however it is built."""

from __future__ import annotations

import json
import tracemalloc
from collections.abc import Callable

import pytest

from loaderplug.tensors.format.header import (
    LENGTH_BYTES,
    MEMORY_FACTOR,
    MOST_MEMORY_FACTOR,
    Header,
    parse_header,
)

# What a parse holds whatever the header: the patterns, a few buffers.
SLACK = 1 << 20


def peak_of_parse(raw: bytes, data_size: int) -> tuple[int, Header]:
    tracemalloc.start()
    try:
        header = parse_header("m.safetensors", raw, LENGTH_BYTES + len(raw) + data_size)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return peak, header


def as_safetensors_writes(target: int) -> tuple[bytes, int]:
    """A header of about ``target`` bytes as safetensors writes one: metadata, then each
    tensor's entry in the order of its offsets, no spaces."""
    entries = ['"__metadata__":{"format":"pt"}']
    offset = size = 0
    while size < target:
        name = f"model.layers.{len(entries) // 256}.mlp.experts.{len(entries) % 256}.w2.weight"
        entry = {"dtype": "BF16", "shape": [2, 3], "data_offsets": [offset, offset + 12]}
        entries.append(f'"{name}":{json.dumps(entry, separators=(",", ":"))}')
        offset += 12
        size += len(entries[-1]) + 1
    return ("{" + ",".join(entries) + "}").encode(), offset


@pytest.mark.slow("parses a 20 MB header under tracemalloc")
def test_a_20_mb_header_as_safetensors_writes_it_parses_within_twice_its_size() -> None:
    raw, data_size = as_safetensors_writes(20_000_000)
    peak, header = peak_of_parse(raw, data_size)
    assert peak <= MEMORY_FACTOR * len(raw), f"{peak / len(raw):.1f}x the header"
    assert len(header.tensors) == data_size // 12
    last = header.tensors[-1]
    assert (last.dtype, last.shape, last.end) == ("BF16", (2, 3), header.size)
    assert header.metadata == {"format": "pt"}


def _entry(name: str, extra: str = "", shape: str = "[0]") -> str:
    return f'"{name}":{{"dtype":"F32","shape":{shape},"data_offsets":[0,0]{extra}}}'


def _header(*entries: str) -> bytes:
    return ("{" + ",".join(entries) + "}").encode()


def _many(count: int, make: Callable[[int], str]) -> str:
    return ",".join(make(i) for i in range(count))


# Headers built to cost the most to parse, each of a megabyte or two (the bound is a
# ratio).
HOSTILE: dict[str, bytes] = {
    "an unknown field of numbers": _header(_entry("w", ',"x":[' + _many(10**6, str) + "]")),
    "an unknown field of small objects": _header(
        _entry("w", ',"x":[' + _many(100_000, lambda i: '{"a":[1]}') + "]")
    ),
    "an unknown field nested deep and wide": _header(
        _entry("w", ',"x":[' + _many(20_000, lambda i: "[[[[[[[[1]]]]]]]]") + "]")
    ),
    "a shape of a million dimensions": _header(_entry("w", shape="[" + _many(10**6, str) + "]")),
    "metadata of many keys": _header(
        '"__metadata__":{' + _many(100_000, lambda i: f'"{i}":""') + "}", _entry("w")
    ),
    "a long metadata value, escaped": _header(
        '"__metadata__":{"k":"' + "\\u00e9\\ud83d\\ude00" * 100_000 + '"}', _entry("w")
    ),
    "a long name, past Latin-1": _header(_entry("a" * 2_000_000 + "\U0001f600")),
    "many names, each given twice": _header(
        _many(50_000, lambda i: f'"{i}":["F32",[0],[0,0]],"{i}":["F32",[0],[0,0]]')
    ),
    "many tensors out of order": _header(
        _many(
            40_000,
            lambda i: f'"t{i}":["U8",[1],[{40_000 - 1 - i},{40_000 - i}]]',
        )
    ),
}
HOSTILE_DATA = {"many tensors out of order": 40_000}


@pytest.mark.slow("parses headers of megabytes under tracemalloc")
@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_header_built_to_cost_the_most_stays_within_the_bound(case: str) -> None:
    raw = HOSTILE[case]
    peak, header = peak_of_parse(raw, HOSTILE_DATA.get(case, 0))
    assert peak <= MOST_MEMORY_FACTOR * len(raw) + SLACK, f"{peak / len(raw):.1f}x the header"
    assert len(header.tensors) >= 1
