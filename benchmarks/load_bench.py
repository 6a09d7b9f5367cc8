"""Load a ~1 GiB multi-shard safetensors model from local disk, cold and warm.

loaderplug's streaming reader against ``safetensors.torch.load_file`` (its ``mmap`` and
``pread`` backends) and fastsafetensors (``device="cpu", nogds=True``), plus a raw probe
of the disk: parallel O_DIRECT reads of the same bytes into one buffer. Each run is its
own process; contenders alternate round by round. A load is timed until every tensor is
materialised and each of its pages touched once (a cheap checksum), so lazily mapped
tensors pay for their page faults like everyone else; the bare call time is beside it.
Cold runs drop every shard from the page cache first (posix_fadvise DONTNEED).

    pip install -e '.[bench]' torch==2.13.0 safetensors fastsafetensors
    python benchmarks/load_bench.py [--quick]

Writes benchmarks/results/load.md and load.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import compile_loaderplug, drop_cache, run_child, run_parallel, write_results

from loaderplug.units import GiB, MiB

HERE = Path(__file__).resolve().parent
CONTENDERS = ("loaderplug", "safetensors mmap", "safetensors pread", "fastsafetensors", "probe")


def touch(tensors: object) -> int:
    """Read one byte of every page of every tensor; returns a checksum."""
    import torch

    total = 0
    for tensor in tensors:  # type: ignore[attr-defined]
        if tensor.numel():
            flat = tensor.reshape(-1).view(torch.uint8)
            total += int(flat[::4096].sum())
    return total


def run_one(name: str, files: list[str]) -> dict[str, float]:
    # Imports happen before the clock starts: torch's import is nobody's load time.
    import torch  # noqa: F401
    from fastsafetensors import fastsafe_open
    from safetensors.torch import load_file

    from loaderplug.tensors.reader import iter_tensors

    started = time.perf_counter()
    if name == "loaderplug":
        tensors = [t for _, t in iter_tensors(files, progress=False)]
    elif name.startswith("safetensors"):
        backend = name.split()[1]
        tensors = [t for f in files for t in load_file(f, backend=backend).values()]
    elif name == "fastsafetensors":
        with fastsafe_open(files, device="cpu", nogds=True) as f:
            tensors = [f.get_tensor(k) for k in f.keys()]  # noqa: SIM118
    else:
        tensors = [probe(files)]
    called = time.perf_counter()
    touch(tensors)
    return {"call_s": called - started, "total_s": time.perf_counter() - started}


def probe(files: list[str], workers: int = 8, chunk: int = 16 * MiB) -> object:
    """Parallel O_DIRECT reads of every file into one buffer: the disk's own pace."""
    import mmap

    import torch

    sizes = [os.path.getsize(f) for f in files]
    buffer = mmap.mmap(-1, sum(-(-s // chunk) * chunk for s in sizes))
    view = memoryview(buffer)
    spans, base = [], 0
    for f, size in zip(files, sizes, strict=True):
        spans += [(f, off, base + off) for off in range(0, size, chunk)]
        base += -(-size // chunk) * chunk

    def read(span: tuple[str, int, int]) -> None:
        f, off, at = span
        fd = os.open(f, os.O_RDONLY | os.O_DIRECT)
        try:
            os.preadv(fd, [view[at : at + chunk]], off)
        finally:
            os.close(fd)

    run_parallel(spans, workers, read)
    return torch.frombuffer(buffer, dtype=torch.uint8)


def warm_cache(files: list[str]) -> None:
    for f in files:
        with open(f, "rb") as handle:
            while handle.read(16 * MiB):
                pass


def measure(name: str, files: list[str]) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--run", name, *files]
    return run_child(cmd, {"LOADERPLUG_PROGRESS": "0"})


def main() -> None:
    compile_loaderplug()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB, one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("files", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    if args.run:
        print(json.dumps(run_one(args.run, args.files)))
        return
    from loaderplug.storage.residency import cached_fraction
    from loaderplug.testing.model import write_model

    size = 256 * MiB if args.quick else GiB
    rounds = 1 if args.quick else args.rounds
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    resident_after_direct: list[float] = []
    with tempfile.TemporaryDirectory(prefix="loaderplug-load-", dir="/var/tmp") as tmp:
        files = [str(p) for p in write_model(Path(tmp), size, shards=4)]
        total = sum(os.path.getsize(f) for f in files)
        for round_ in range(rounds):
            order = CONTENDERS[round_ % 5 :] + CONTENDERS[: round_ % 5]
            for state in ("cold", "warm"):
                for name in order:
                    drop_cache(files) if state == "cold" else warm_cache(files)
                    figures = measure(name, files)
                    results.setdefault((state, name), []).append(figures)
                    if state == "cold" and name == "loaderplug":
                        resident_after_direct.append(max(cached_fraction(f) or 0.0 for f in files))
                    print(
                        f"  round {round_ + 1} {state:4s} {name:18s} "
                        f"{total / MiB / figures['total_s']:7.0f} MiB/s",
                        flush=True,
                    )
    text = table(results, total, resident_after_direct)
    header = (
        f"# Load benchmark\n\n{total / MiB:.0f} MiB, 4 shards of float32 on local disk; "
        f"{rounds} round(s) alternating, one process per run. `total` = load and touch "
        f"every page; `call` = the load call alone. Command: "
        f"`python benchmarks/load_bench.py{' --quick' if args.quick else ''}`.\n\n"
    )
    raw = {f"{s}/{n}": v for (s, n), v in results.items()}
    write_results(args.out, "load", header, text, raw)


def table(
    results: dict[tuple[str, str], list[dict[str, float]]], total: int, resident: list[float]
) -> str:
    lines = [
        "| cache | reader | MiB/s (median, total) | total s (min-max) | call s | "
        "x fastest peer | x probe | peak RSS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for state in ("cold", "warm"):
        med = {
            name: statistics.median(r["total_s"] for r in results[(state, name)])
            for name in CONTENDERS
        }
        peers = [n for n in CONTENDERS if n not in ("loaderplug", "probe")]
        fastest = min(med[n] for n in peers)
        for name in CONTENDERS:
            runs = results[(state, name)]
            totals = [r["total_s"] for r in runs]
            lines.append(
                f"| {state} | {name} | {total / MiB / med[name]:.0f} | "
                f"{med[name]:.2f} ({min(totals):.2f}-{max(totals):.2f}) | "
                f"{statistics.median(r['call_s'] for r in runs):.2f} | "
                f"{fastest / med[name]:.2f} | {med['probe'] / med[name]:.2f} | "
                f"{max(r['rss'] for r in runs) / MiB:.0f} MiB |"
            )
    lines.append("")
    lines.append(
        f"After each cold loaderplug load, at most {max(resident):.1%} of any shard was in "
        f"the page cache (cachestat)."
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
