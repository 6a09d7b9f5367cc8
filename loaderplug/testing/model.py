"""Synthetic models for demos, tests and benchmarks: real safetensors files, no torch.

Weights are pseudo-random bytes (fast to make, incompressible, so a copy that drops or
reorders a range is caught by a byte comparison).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from loaderplug.units import MiB


def write_shard(path: Path, tensor_bytes: list[int], first_tensor: int, seed: int) -> list[str]:
    """One safetensors shard of float32 tensors of ``tensor_bytes`` each (multiples of 4),
    named ``model.layers.<first_tensor + i>.weight``, filled with seeded random bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    names, offset = [], 0
    for i, nbytes in enumerate(tensor_bytes):
        name = f"model.layers.{first_tensor + i}.weight"
        header[name] = {
            "dtype": "F32",
            "shape": [nbytes // 4],
            "data_offsets": [offset, offset + nbytes],
        }
        names.append(name)
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # data starts 8-byte aligned, as safetensors does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        remaining, block = offset, 0
        while remaining:
            n = min(remaining, 8 * MiB)
            # randbytes is quick and different per block; seeded for reproducibility.
            f.write(_random_bytes(seed * 1_000_003 + block, n))
            remaining -= n
            block += 1
    return names


def _random_bytes(seed: int, n: int) -> bytes:
    import random

    return random.Random(seed).randbytes(n)


def write_model(
    folder: str | os.PathLike[str],
    total_bytes: int,
    shards: int = 4,
    *,
    tensors_per_shard: int = 4,
    seed: int = 0,
) -> list[Path]:
    """Write a sharded safetensors model of about ``total_bytes`` plus its index and config.

    Returns the shard paths. Tensor sizes are multiples of 4 bytes (float32).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    per_tensor = max(4, total_bytes // shards // tensors_per_shard // 4 * 4)
    weight_map: dict[str, str] = {}
    paths = []
    for shard in range(shards):
        name = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        path = folder / name
        sizes = [per_tensor] * tensors_per_shard
        # A ragged last tensor so a file's size is rarely a multiple of the range size.
        sizes[-1] += 4 * (shard + 1)
        for tensor in write_shard(path, sizes, shard * tensors_per_shard, seed + shard):
            weight_map[tensor] = name
        paths.append(path)
    index = {
        "metadata": {"total_size": sum(p.stat().st_size for p in paths)},
        "weight_map": weight_map,
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (folder / "config.json").write_text(json.dumps({"model_type": "synthetic"}))
    return paths
