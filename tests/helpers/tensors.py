"""Small safetensors models, tensor comparisons and where a tensor's bytes live, shared
by the reader's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Freshly written files sit in the page cache, where the reader would map them; forcing
# direct reads makes it stream them range by range, in 4 KiB ranges.
STREAMED: dict[str, Any] = {
    "span_bytes": "4K",
    "split_threshold_bytes": 0,
    "direct_io": "on",
    "progress": False,
}


def same(a: Any, b: Any) -> bool:
    """Equal dtype, shape and bytes (NaNs included)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(a.contiguous().view(torch.uint8).equal(b.contiguous().view(torch.uint8)))


def write_shards(folder: Path, count: int = 3) -> list[Path]:
    """``count`` shards of six float32 weights each, plus an empty float16 tensor."""
    import torch
    from safetensors.torch import save_file

    paths = []
    for shard in range(count):
        tensors = {f"s{shard}.w{i}": torch.randn(97, 53 + i) for i in range(6)} | {
            f"s{shard}.zero": torch.empty(0, 9, dtype=torch.float16)
        }
        path = folder / f"model-{shard}.safetensors"
        save_file(tensors, str(path))
        paths.append(path)
    return paths


def reference(paths: list[Path]) -> dict[str, Any]:
    """Every tensor of ``paths`` as safetensors loads it."""
    from safetensors.torch import load_file

    out: dict[str, Any] = {}
    for p in paths:
        out |= load_file(str(p))
    return out


def file_mappings() -> list[tuple[int, int, str]]:
    """This process's mappings of files: (start, end, path)."""
    found = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                found.append((start, end, fields[5].strip()))
    return found


def mapped_from(tensor: Any) -> str | None:
    """The file ``tensor``'s bytes are a mapping of, or None (memory of its own)."""
    address = tensor.data_ptr()
    for start, end, path in file_mappings():
        if start <= address < end:
            return path
    return None
