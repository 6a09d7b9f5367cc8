"""What knowing a file by its identity costs a load: this checkout against an earlier one.

A load holds each file it maps open from its header to its last tensor, checks the file
before each tensor (an ``fstat``) and compares device and ctime with size, mtime and
inode wherever it checks a file. This runs the same loads with this checkout and with
``--before`` (a git revision, checked out in a temporary worktree) side by side: a warm
model of 4 x 128 MiB (mapped, as a user's warm local file is) and a cold one of
4 x 1 GiB (read from the disk), each load in a fresh process, timed from the call to
the last tensor touched (an integer sum of its bits). The two trees alternate within
each round, whose order flips, and each round gives a ratio (this checkout's seconds
over the earlier one's), so a neighbour that slows the machine weighs on both alike.

    python benchmarks/identity_bench.py [--before REV] [--rounds N] [--quick]

Writes benchmarks/results/identity.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import drop_cache, run_child, write_results

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MiB = 1 << 20
# (cache, shards, bytes per shard, rounds scale)
CELLS = (("warm", 4, 128 * MiB), ("cold", 4, 1024 * MiB))
TARGET = 1.02


def child(files: list[str]) -> None:
    """One load of ``files`` with the loaderplug on PYTHONPATH; prints its seconds."""
    import torch

    import loaderplug

    started = time.perf_counter()
    total = 0
    for _name, tensor in loaderplug.iter_tensors(files, progress=False):
        total += int(tensor.view(-1).view(torch.uint8)[::4096].sum())
    seconds = time.perf_counter() - started
    print(json.dumps({"seconds": seconds, "checksum": total}))


def measure(tree: Path, files: list[str], cold: bool) -> float:
    if cold:
        drop_cache(files)
    env = {"PYTHONPATH": str(tree), "LOADERPLUG_IO_PROBE": "0"}
    return run_child([sys.executable, __file__, "--run", *files], env)["seconds"]


def run_cell(
    trees: dict[str, Path], files: list[str], cold: bool, rounds: int
) -> dict[str, list[float]]:
    runs: dict[str, list[float]] = {name: [] for name in trees}
    for tree in trees.values():  # untimed: each tree's first load of the files
        measure(tree, files, cold)
    for round_ in range(rounds):
        order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
        for name in order:
            runs[name].append(measure(trees[name], files, cold))
    return runs


def write_model(folder: Path, shards: int, size: int) -> list[str]:
    from loaderplug.testing.model import write_model as write

    return [str(p) for p in write(folder, size * shards, shards=shards, tensors_per_shard=16)]


def worktree(rev: str, into: Path) -> Path:
    subprocess.run(
        ["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(into), rev], check=True
    )
    return into


def report(cells: list[dict[str, object]], before: str, after: str) -> str:
    lines = [
        f"| cache | model | rounds | {before} s | this checkout s | ratio (median, min-max) "
        f"| <= {TARGET} |",
        "|---|---|---|---|---|---|---|",
    ]
    for cell in cells:
        runs = cell["runs"]
        assert isinstance(runs, dict)
        ratio = [a / b for a, b in zip(runs["after"], runs["before"], strict=True)]
        med = statistics.median(ratio)
        lines.append(
            f"| {cell['cache']} | {cell['model']} | {len(ratio)} | "
            f"{statistics.median(runs['before']):.3f} | {statistics.median(runs['after']):.3f} | "
            f"{med:.3f} ({min(ratio):.3f}-{max(ratio):.3f}) | "
            f"{'met' if med <= TARGET else '**missed**'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="594003a", help="the revision to compare with")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--quick", action="store_true", help="the warm model only")
    parser.add_argument("--cold-rounds", type=int, help="rounds of the cold model (rounds / 3)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("files", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        child(args.files)
        return
    with tempfile.TemporaryDirectory(dir=REPO.parent) as tmp:
        trees = {"before": worktree(args.before, Path(tmp) / "before"), "after": REPO}
        try:
            cells = []
            for cache, shards, size in CELLS[:1] if args.quick else CELLS:
                files = write_model(Path(tmp) / f"{cache}-model", shards, size)
                cold_rounds = args.cold_rounds or max(3, args.rounds // 3)
                rounds = args.rounds if cache == "warm" else cold_rounds
                runs = run_cell(trees, files, cache == "cold", rounds)
                cells.append(
                    {"cache": cache, "model": f"{shards} x {size // MiB} MiB", "runs": runs}
                )
        finally:
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(trees["before"])],
                check=False,
            )
    header = (
        "# What knowing a file by its identity costs a load\n\n"
        f"`python benchmarks/identity_bench.py`: this checkout against `{args.before}` "
        f"(before a mapped file was held open and checked before each tensor), each load "
        f"in a fresh process, the trees alternating within each round. Load average "
        f"{os.getloadavg()[0]:.1f} at the end.\n\n"
    )
    write_results(args.out, "identity", header, report(cells, args.before, "after"), cells)


if __name__ == "__main__":
    main()
