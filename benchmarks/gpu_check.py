"""A prepared check for a machine with a GPU: loaderplug to ``cuda`` against the others.

    pip install -e '.[bench]' safetensors fastsafetensors   # with the host's CUDA torch
    python benchmarks/gpu_check.py [--size-mib 1024] [--dir /local/nvme/tmp]

1. Equality: every tensor from ``loaderplug.iter_tensors(device="cuda")`` equals
   ``safetensors.torch.load_file(device="cuda")`` and fastsafetensors' (``nogds=True``).
2. Time to all tensors on the GPU, cold (files dropped from the page cache) and warm,
   for the three, and loaderplug's time to first tensor.
3. The host-to-device ceiling measured in the same run: one pinned-memory copy of the
   model's size, timed with CUDA events.

Prints a markdown table; exits 1 if any tensor differs, 2 if there is no GPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from common import drop_cache  # benchmarks/ is on sys.path when this runs as a script

from loaderplug.units import MiB


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device here: run this on a GPU machine", file=sys.stderr)
        return 2
    from fastsafetensors import fastsafe_open
    from safetensors.torch import load_file

    from loaderplug.reader import iter_tensors
    from loaderplug.testing.model import write_model

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        files = [str(p) for p in write_model(Path(tmp), args.size_mib * MiB, shards=4)]
        total = sum(os.path.getsize(f) for f in files)

        def with_loaderplug() -> tuple[dict[str, torch.Tensor], float]:
            started, first, out = time.perf_counter(), 0.0, {}
            for name, tensor in iter_tensors(files, device="cuda", progress=False):
                first = first or time.perf_counter() - started
                out[name] = tensor
            return out, first

        def with_safetensors() -> tuple[dict[str, torch.Tensor], float]:
            return {k: v for f in files for k, v in load_file(f, device="cuda").items()}, 0.0

        def with_fastsafetensors() -> tuple[dict[str, torch.Tensor], float]:
            with fastsafe_open(files, device="cuda:0", nogds=True) as f:
                return {k: f.get_tensor(k).clone() for k in f.keys()}, 0.0  # noqa: SIM118

        loaders = {
            "loaderplug": with_loaderplug,
            "safetensors": with_safetensors,
            "fastsafetensors": with_fastsafetensors,
        }
        rows, results = [], {}
        for state in ("cold", "warm"):
            for name, load in loaders.items():
                if state == "cold":
                    drop_cache(files)
                torch.cuda.synchronize()
                started = time.perf_counter()
                tensors, first = load()
                torch.cuda.synchronize()
                seconds = time.perf_counter() - started
                results[name] = tensors
                rows.append((state, name, seconds, first))
        reference = results["safetensors"]
        bad = [
            (who, k)
            for who in ("loaderplug", "fastsafetensors")
            for k, v in reference.items()
            if not torch.equal(results[who][k], v)
        ]

        host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
        device = torch.empty(total, dtype=torch.uint8, device="cuda")
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device.copy_(host, non_blocking=True)
        end.record()
        torch.cuda.synchronize()
        h2d = total / MiB / (start.elapsed_time(end) / 1000)

    print(f"| cache | loader | s | MiB/s | x pinned H2D ({h2d:.0f} MiB/s) | first tensor s |")
    print("|---|---|---|---|---|---|")
    for state, name, seconds, first in rows:
        speed = total / MiB / seconds
        print(
            f"| {state} | {name} | {seconds:.2f} | {speed:.0f} | {speed / h2d:.2f} | {first:.3f} |"
        )
    print("\nequal to safetensors:", "yes" if not bad else f"NO: {bad[:5]}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
