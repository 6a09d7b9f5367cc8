"""Loads to a GPU in fresh processes, alternating: loaderplug against safetensors and
fastsafetensors, cold and warm.

    python benchmarks/gpu_processes.py [--size-mib 4096] [--rounds 3] [--dir /nvme/tmp]
        [--baseline /path/to/other/checkout] [--device cuda]

Each run is a process of its own, as a cold start is: torch imported and the device's
context made before the clock, then every tensor of the model (8 shards) loaded to the
device (loaderplug's ``iter_tensors``, safetensors' ``load_file``, fastsafetensors'
``fastsafe_open(nogds=True)`` with a clone of each tensor), then a synchronize. Cold:
the files dropped from the page cache before the run; warm: read through it first. The
order of the loaders turns round each round. loaderplug measures the mount's IO policy
once before the runs, not counted (a fresh host pays it on its first load).
``--baseline`` times another loaderplug checkout beside this one (its root goes first
on the child's ``PYTHONPATH``): a change's A/B in one run. ``--device cpu`` tries the
script without a GPU. Prints a markdown table; :mod:`gpu_check` checks the tensors.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (  # benchmarks/ is on sys.path when this runs as a script
    compile_loaderplug,
    drop_cache,
)
from gpu_check import LOADERS, load_with, warm_cache

from loaderplug.testing.model import write_model
from loaderplug.units import MiB

ROOT = Path(__file__).resolve().parent.parent


def child(loader: str, device: str, files: list[str]) -> None:
    """One timed load; prints its seconds (and loaderplug's first tensor) as JSON."""
    import torch

    torch.empty(1, device=device)  # the device's context, before the clock
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else lambda: None
    synchronize()
    started = time.perf_counter()
    got, first = load_with(loader.split()[0], files, device)
    synchronize()
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "first": first, "tensors": len(got)}))


def timed(loader: str, device: str, files: list[str], baseline: str | None) -> float | str:
    """Seconds of one child, or its error's last line."""
    # This checkout's loaderplug, or the baseline's, whatever else is installed.
    first = baseline if loader == "loaderplug (baseline)" else str(ROOT)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [first, os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, __file__, "--child", loader, device, *files],
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or ["failed"])[-1]
    seconds: float = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
    return seconds


def main() -> int:
    compile_loaderplug()
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        loader, device, *files = sys.argv[2:]
        child(loader, device, files)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--baseline", help="another loaderplug checkout's root, timed too")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    loaders = list(LOADERS)
    compileall.compile_dir(str(ROOT / "loaderplug"), quiet=1)  # the one the children get
    if args.baseline:
        loaders.insert(1, "loaderplug (baseline)")
        compileall.compile_dir(str(Path(args.baseline) / "loaderplug"), quiet=1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        files = [str(p) for p in write_model(Path(tmp), args.size_mib * MiB, shards=8)]
        drop_cache(files)
        timed("loaderplug", args.device, files, None)  # the mount's IO policy, measured
        runs: dict[tuple[str, str], list[float | str]] = {}
        for state in ("cold", "warm"):
            for round_ in range(args.rounds):
                for loader in loaders if round_ % 2 == 0 else loaders[::-1]:
                    if state == "cold":
                        drop_cache(files)
                    else:
                        warm_cache(files)
                    seconds = timed(loader, args.device, files, args.baseline)
                    runs.setdefault((state, loader), []).append(seconds)
    print(
        f"\n{args.size_mib} MiB in 8 shards to {args.device}, {args.rounds} rounds, a process each"
    )
    print("\n| cache | loader | s (each run) | median | x safetensors |")
    print("|---|---|---|---|---|")
    for (state, loader), seconds in runs.items():
        ok = [s for s in seconds if isinstance(s, float)]
        theirs = [s for s in runs[(state, "safetensors")] if isinstance(s, float)]
        each = ", ".join(f"{s:.2f}" if isinstance(s, float) else f"failed: {s}" for s in seconds)
        median = statistics.median(ok) if ok else None
        ratio = f"{median / statistics.median(theirs):.2f}" if median and theirs else "-"
        print(f"| {state} | {loader} | {each} | {f'{median:.2f}' if median else '-'} | {ratio} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
