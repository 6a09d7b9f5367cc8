"""A prepared check for a machine with a GPU: loaderplug to ``cuda`` against the others.

    pip install -e '.[bench]' safetensors fastsafetensors   # with the host's CUDA torch
    python benchmarks/gpu_check.py [--size-mib 1024] [--dir /local/nvme/tmp] [--ranks]
        [--page-cache-ranks]

1. Equality: every tensor from ``loaderplug.iter_tensors(device="cuda")`` equals
   ``safetensors.torch.load_file(device="cuda")`` and fastsafetensors' (``nogds=True``).
2. Time to all tensors on the GPU, cold (files dropped from the page cache) and warm,
   for the three, and loaderplug's time to first tensor.
3. The host-to-device ceiling measured in the same run: one pinned-memory copy of the
   model's size, timed with CUDA events.
4. Ranks (``--ranks``): one process per GPU, in an NCCL group. With one GPU, the pinned
   path under a group of one (which loads as no group); with two or more, the shared
   load: each rank reads its share of the files into pinned buffers and broadcasts
   its tensors from its device copy. Every rank checks every tensor against
   safetensors' on its own GPU; the table gives each rank's GB/s (model bytes over the
   time until it held every tensor).
5. Ranks sharing one host's page cache (``--page-cache-ranks``): two processes in a gloo
   group, both on GPU 0 (so one GPU is enough), with ``LOADERPLUG_RANK_SHARING`` forced
   to ``pagecache`` and then ``stream``: each rank reads half the files through pinned
   buffers and takes the other half from its mapping of the page cache, copied to its
   GPU. Then ``stream`` in a one pass into a local copy (what ``auto`` does for CPU
   tensors from a network mirror): the copy's pages leave the page cache as the ranks
   are done with them, and the copy must come out byte-identical. Each rank checks every
   tensor against safetensors' and gives its GB/s.

Prints markdown tables; exits 1 if any tensor differs, 2 if there is no GPU.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (  # benchmarks/ is on sys.path when this runs as a script
    compile_loaderplug,
    drop_cache,
)

from loaderplug.units import MiB


def same_bytes(a: Any, b: Any) -> bool:
    """Whether two tensors hold the same bytes: ``torch.equal`` calls two NaNs
    different, and a model of random bytes has NaNs."""
    import torch

    flat = (t.reshape(-1).view(torch.uint8) for t in (a, b))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(*flat)


def warm_cache(files: list[str]) -> None:
    """Read the files whole through the page cache, so the next load finds them there."""
    for f in files:
        with open(f, "rb") as src:
            while src.read(64 * MiB):
                pass


LOADERS = ("loaderplug", "safetensors", "fastsafetensors")


def load_with(loader: str, files: list[str], device: str) -> tuple[dict[str, Any], float]:
    """Every tensor of ``files`` on ``device``, by one of :data:`LOADERS`, and the time
    to the first (loaderplug's; 0 for the others, which hand over all at once)."""
    started, first = time.perf_counter(), 0.0
    if loader == "loaderplug":
        from loaderplug.tensors.reader import iter_tensors

        got = {}
        for name, tensor in iter_tensors(files, device=device, progress=False):
            first = first or time.perf_counter() - started
            got[name] = tensor
        return got, first
    if loader == "safetensors":
        from safetensors.torch import load_file

        return {k: v for f in files for k, v in load_file(f, device=device).items()}, 0.0
    from fastsafetensors import fastsafe_open

    where = "cuda:0" if device == "cuda" else device  # fastsafetensors wants an index
    with fastsafe_open(files, device=where, nogds=True) as f:
        return {k: f.get_tensor(k).clone() for k in f.keys()}, 0.0  # noqa: SIM118


def rank_main(rank: int, world: int, init: str, files: list[str]) -> int:
    """One rank of ``--ranks`` (an NCCL group, a GPU per rank) or of
    ``--page-cache-ranks`` (``LOADERPLUG_RANK_SHARING`` set: a gloo group on GPU 0):
    load over the group, compare, print figures."""
    import datetime
    import json

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from loaderplug.tensors.reader import iter_tensors

    on_one_gpu = "LOADERPLUG_RANK_SHARING" in os.environ
    gpu = 0 if on_one_gpu else rank
    torch.cuda.set_device(gpu)
    dist.init_process_group(
        "gloo" if on_one_gpu else "nccl",
        init_method=f"file://{init}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    device = f"cuda:{gpu}"
    local = os.environ.get("GPU_CHECK_LOCAL_DIR") or None  # a one pass into that copy
    dist.barrier()
    started = time.perf_counter()
    load = iter_tensors(
        files, device=device, local_dir=local, group=dist.group.WORLD, progress=False
    )
    got = dict(load)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    want = {k: v for f in files for k, v in load_file(f, device=device).items()}
    bad = [k for k, v in want.items() if k not in got or not same_bytes(got[k], v)]
    if local is not None:
        bad += [
            f"the copy of {os.path.basename(f)}"
            for f in files
            if not filecmp.cmp(f, os.path.join(local, os.path.basename(f)), shallow=False)
        ]
    total = sum(os.path.getsize(f) for f in files)
    print(json.dumps({"rank": rank, "seconds": seconds, "gbps": total / seconds / 1e9,
                      "bad": bad[:5], "tensors": len(got), "sharing": load.sharing,
                      "devices": sorted({str(t.device) for t in got.values()})}))  # fmt: skip
    dist.destroy_process_group()
    return 1 if bad else 0


def ranks_check(
    files: list[str], tmp: str, sharing: str | None = None, local: str | None = None
) -> int:
    """Start one process per GPU for :func:`rank_main` (or, with ``sharing``, two on GPU
    0 sharing the page cache that way; with ``local``, in a one pass into that folder);
    print their table."""
    import json
    import subprocess

    import torch

    world = torch.cuda.device_count() if sharing is None else 2
    init = os.path.join(tmp, f"init-{sharing or 'nccl'}-{'copy' if local else 'in-place'}")
    env = {**os.environ, **({"LOADERPLUG_RANK_SHARING": sharing} if sharing else {})}
    if local is not None:
        env["GPU_CHECK_LOCAL_DIR"] = local
    drop_cache(files)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank-child", str(r), str(world), init, *files],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    rows = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    if sharing is not None:
        copy = ", one pass into a local copy" if local else ""
        mode = f"{sharing}{copy}, 2 ranks on GPU 0"
    else:
        mode = "pinned path, group of one" if world == 1 else f"NCCL broadcast, {world} ranks"
    print(f"\n| rank ({mode}) | shared by | s | GB/s | tensors | equal to safetensors |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        same = "yes" if not row["bad"] else f"NO: {row['bad']}"
        if any(not d.startswith("cuda") for d in row["devices"]):
            same = f"NO: tensors on {row['devices']}"
            row["bad"] = row["bad"] or row["devices"]
        figures = f"{row['seconds']:.2f} | {row['gbps']:.2f} | {row['tensors']}"
        print(f"| {row['rank']} | {row['sharing'] or '-'} | {figures} | {same} |")
    return 1 if any(row["bad"] for row in rows) else 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--ranks", action="store_true", help="also the ranks check (4.)")
    parser.add_argument(
        "--page-cache-ranks", action="store_true", help="also the page-cache ranks check (5.)"
    )
    return parser.parse_args()


def time_loaders(
    files: list[str],
) -> tuple[list[tuple[str, str, float, float]], dict[str, dict[str, Any]], dict[str, str]]:
    """Each of :data:`LOADERS` to ``cuda``, cold then warm: the timed rows, the tensors
    each loader gave (its warm load's), and the loaders that failed with why."""
    import torch

    rows, results, failed = [], {}, {}
    for state in ("cold", "warm"):
        for name in LOADERS:
            if name in failed:
                continue
            if state == "cold":
                drop_cache(files)
            else:  # whatever the loader before read with (O_DIRECT leaves nothing)
                warm_cache(files)
            torch.cuda.synchronize()
            started = time.perf_counter()
            try:
                tensors, first = load_with(name, files, "cuda")
            except Exception as exc:  # a comparison's failure must not hide the rest
                if name in ("loaderplug", "safetensors"):  # the one and the reference
                    raise
                failed[name] = f"{type(exc).__name__}: {exc}"
                continue
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            results[name] = tensors
            rows.append((state, name, seconds, first))
    return rows, results, failed


def unequal_tensors(results: dict[str, dict[str, Any]]) -> list[tuple[str, str]]:
    """(loader, tensor) for every tensor that differs from safetensors' own."""
    reference = results["safetensors"]
    return [
        (who, k)
        for who in results
        for k, v in reference.items()
        if not same_bytes(results[who][k], v)
    ]


def loader_figures(
    files: list[str],
) -> tuple[list[tuple[str, str, float, float]], dict[str, str], list[tuple[str, str]]]:
    """Checks 1 and 2: the timed rows, the failed loaders, the tensors that differ. The
    loaded tensors go with this call's return, so the GPU's memory is back before the
    copy of :func:`pinned_h2d_mib_per_s`."""
    rows, results, failed = time_loaders(files)
    return rows, failed, unequal_tensors(results)


def pinned_h2d_mib_per_s(total: int) -> float:
    """Check 3: one pinned-memory copy of ``total`` bytes to the GPU, timed with CUDA
    events."""
    import torch

    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(total, dtype=torch.uint8, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    device.copy_(host, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    return total / MiB / (start.elapsed_time(end) / 1000)


def print_loader_table(
    rows: list[tuple[str, str, float, float]],
    failed: dict[str, str],
    bad: list[tuple[str, str]],
    total: int,
    h2d: float,
) -> None:
    print(f"| cache | loader | s | MiB/s | x pinned H2D ({h2d:.0f} MiB/s) | first tensor s |")
    print("|---|---|---|---|---|---|")
    for state, name, seconds, first in rows:
        speed = total / MiB / seconds
        print(
            f"| {state} | {name} | {seconds:.2f} | {speed:.0f} | {speed / h2d:.2f} | {first:.3f} |"
        )
    for name, error in failed.items():
        print(f"| - | {name} | failed: {error} | | | |")
    print("\nequal to safetensors:", "yes" if not bad else f"NO: {bad[:5]}")


def model_files(tmp: str, size_mib: int) -> list[str]:
    from loaderplug.testing.model import write_model

    return [str(p) for p in write_model(Path(tmp), size_mib * MiB, shards=4)]


def ranks_checks(args: argparse.Namespace) -> int:
    """Checks 4 and 5, those the options ask for, each on a model of its own; the worst
    exit status."""
    status = 0
    if args.ranks:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            files = model_files(tmp, args.size_mib)
            status = max(status, ranks_check(files, tmp))
    if args.page_cache_ranks:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            files = model_files(tmp, args.size_mib)
            for sharing in ("pagecache", "stream"):
                status = max(status, ranks_check(files, tmp, sharing))
            local = os.path.join(tmp, "local")
            status = max(status, ranks_check(files, tmp, "stream", local=local))
    return status


def main() -> int:
    compile_loaderplug()
    if len(sys.argv) > 1 and sys.argv[1] == "--rank-child":
        rank, world, init, *files = sys.argv[2:]
        return rank_main(int(rank), int(world), init, files)
    args = parse_args()

    import torch

    if not torch.cuda.is_available():
        print("no CUDA device here: run this on a GPU machine", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        files = model_files(tmp, args.size_mib)
        total = sum(os.path.getsize(f) for f in files)
        rows, failed, bad = loader_figures(files)
        h2d = pinned_h2d_mib_per_s(total)
    print_loader_table(rows, failed, bad, total, h2d)
    status = 1 if bad else 0
    return max(status, ranks_checks(args))


if __name__ == "__main__":
    raise SystemExit(main())
