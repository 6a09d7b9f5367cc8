"""A fastsafetensors user's script, reading through loaderplug.

    LOADERPLUG_MIRROR=/mnt/volume python examples/fastsafetensors_user.py \
        /mnt/volume/models/llama/*.safetensors [--device cuda:0]

The only change from a plain fastsafetensors script is the import (and install()): the
shards are hydrated from the mirror to local disk first (a later run finds them
current), and fastsafetensors' pread path reads them direct or buffered as loaderplug's
IO policy decides. With GPUDirect Storage (nogds=False) fastsafetensors reads the local
copies through cuFile.
"""

from __future__ import annotations

import argparse
import time

from loaderplug.integrations import fastsafetensors as lp_fst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shards", nargs="+")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    lp_fst.install()
    started = time.monotonic()
    nogds = args.device == "cpu"
    with lp_fst.fastsafe_open(args.shards, device=args.device, nogds=nogds) as f:
        weights = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    size = sum(t.numel() * t.element_size() for t in weights.values())
    took = time.monotonic() - started
    print(f"{len(weights)} tensors, {size / 2**20:.0f} MiB in {took:.2f} s")


if __name__ == "__main__":
    main()
