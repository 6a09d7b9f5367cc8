"""Load safetensors files with fastsafetensors, through loaderplug: files on the mirror
are hydrated first, and every file is read direct or buffered as its mount wants.

    LOADERPLUG_MIRROR=/mnt/volume python load.py FILE.safetensors [...]
"""

from __future__ import annotations

import sys
import time


def main(paths: list[str]) -> None:
    import torch

    from loaderplug.integrations import fastsafetensors as lp_fst

    lp_fst.install()
    gpu = torch.cuda.is_available()
    started = time.monotonic()
    with lp_fst.fastsafe_open(paths, device="cuda:0" if gpu else "cpu", nogds=not gpu) as f:
        tensors = {name: f.get_tensor(name).clone() for name in f.keys()}  # noqa: SIM118
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"loaded {len(tensors)} tensors ({nbytes >> 20} MiB) from {len(paths)} file(s) "
          f"in {time.monotonic() - started:.2f} s")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
