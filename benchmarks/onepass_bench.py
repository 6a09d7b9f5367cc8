"""Cold start from the throttled volume: hydrate-then-load against one pass.

Three ways to get a ~1 GiB, 4-shard model from the object-store-like test volume into
tensors (every page touched), each in its own process, alternating:

* runpod + safetensors  ``VolumeCache.hydrate`` then ``safetensors.torch.load_file``
* loaderplug hydrate    ``loaderplug.hydrate`` alone (the floor a separate load adds to)
* loaderplug one pass   ``iter_tensors(mirror files, local_dir=...)``: each range read
                        once, written locally and scattered into tensors

    pip install -e '.[bench]' torch==2.13.0 safetensors
    python benchmarks/onepass_bench.py [--quick]

Writes benchmarks/results/onepass.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # benchmarks/ is on sys.path when run
    collect_garbage_before_the_clock,
    compile_loaderplug,
)
from hydrate_bench import PROFILE, ram_dir

from loaderplug.testing.model import write_model
from loaderplug.testing.volume import mounted
from loaderplug.units import GiB, MiB

HERE = Path(__file__).resolve().parent
NAMES = ["runpod + safetensors", "loaderplug hydrate", "loaderplug one pass"]


def child(name: str, mirror: str, local: str, mnt: str) -> dict[str, float]:
    import torch

    from loaderplug import hydrate
    from loaderplug.tensors.reader import iter_tensors

    def touch(t: torch.Tensor) -> None:
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum()

    collect_garbage_before_the_clock()
    started = time.perf_counter()
    first = None
    if name == "runpod + safetensors":
        from runpod.serverless.utils.rp_volume_cache import VolumeCache
        from safetensors.torch import load_file

        VolumeCache(dirs=[local], namespace="bench", volume_path=mnt, best_effort=False).hydrate()
        for f in sorted(Path(local).glob("*.safetensors")):
            for t in load_file(str(f)).values():
                first = first or time.perf_counter() - started
                touch(t)
    elif name == "loaderplug hydrate":
        hydrate(mirror, local, progress=False)
    else:
        files = sorted(Path(mirror).glob("*.safetensors"))
        for _, t in iter_tensors(files, local_dir=local, progress=False):
            first = first or time.perf_counter() - started
            touch(t)
    return {"total_s": time.perf_counter() - started, "first_s": first or 0.0}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--tensors-per-shard",
        type=int,
        default=32,
        help="tensors in each of the 4 shards (real checkpoints hold hundreds; default 32)",
    )
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    return parser.parse_args()


def lay_out_mirror(local: Path, backing: Path, size: int, tensors_per_shard: int) -> None:
    """Write the model to ``local`` and let runpod's own sync lay out its mirror of it,
    straight to the volume's backing folder."""
    from runpod.serverless.utils.rp_volume_cache import VolumeCache

    write_model(local, size, 4, tensors_per_shard=tensors_per_shard)
    backing.mkdir()
    VolumeCache(dirs=[local], namespace="bench", volume_path=backing, best_effort=False).sync(
        background=False
    )


def run_contender(name: str, mirror: Path, local: Path, mnt: Path) -> dict[str, float]:
    """One contender's child, ``local`` emptied first: the figures it printed."""
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True)
    subprocess.run(["sync"], check=True)
    done = subprocess.run(
        [
            sys.executable,
            __file__,
            "--child",
            name,
            str(mirror),
            str(local),
            str(mnt),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def alternate(mirror: Path, local: Path, mnt: Path, rounds: int) -> dict[str, list[dict]]:
    """Every contender once a round, the order turned by one each round."""
    results: dict[str, list[dict[str, float]]] = {n: [] for n in NAMES}
    for round_ in range(rounds):
        for name in NAMES[round_ % 3 :] + NAMES[: round_ % 3]:
            figures = run_contender(name, mirror, local, mnt)
            results[name].append(figures)
            print(f"  round {round_ + 1} {name:22s} {figures['total_s']:.2f} s", flush=True)
    return results


def measure(size: int, rounds: int, tensors_per_shard: int) -> dict[str, list[dict]]:
    """The model behind the throttled volume's mirror, every contender on it."""
    with (
        tempfile.TemporaryDirectory(prefix="onepass-", dir="/var/tmp") as tmp,
        tempfile.TemporaryDirectory(prefix="onepass-", dir=ram_dir()) as ram,
    ):
        local = Path(tmp) / "local" / "model"
        backing = Path(ram) / "backing"
        lay_out_mirror(local, backing, size, tensors_per_shard)
        mnt = Path(tmp) / "mnt"
        mnt.mkdir()
        with mounted(backing, mnt, PROFILE):
            mirror = mnt / ".cache" / "bench" / "big" / str(local).lstrip("/")
            return alternate(mirror, local, mnt, rounds)


def table(results: dict[str, list[dict]]) -> str:
    med = {n: statistics.median(r["total_s"] for r in results[n]) for n in NAMES}
    lines = [
        "| path to tensors | total s (median) | min-max | first tensor s | x runpod+safetensors "
        "| x loaderplug hydrate |",
        "|---|---|---|---|---|---|",
    ]
    for n in NAMES:
        totals = [r["total_s"] for r in results[n]]
        first = statistics.median(r["first_s"] for r in results[n])
        lines.append(
            f"| {n} | {med[n]:.2f} | {min(totals):.2f}-{max(totals):.2f} | "
            f"{first:.2f} | {med[n] / med['runpod + safetensors']:.2f} | "
            f"{med[n] / med['loaderplug hydrate']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    compile_loaderplug()
    args = parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    size = 256 * MiB if args.quick else GiB
    rounds = 1 if args.quick else args.rounds
    text = table(measure(size, rounds, args.tensors_per_shard))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "onepass.md").write_text(
        f"# One pass from the volume\n\n{size >> 20} MiB, 4 shards of "
        f"{args.tensors_per_shard} tensors each; volume as in "
        f"hydrate.md; {rounds} round(s), alternating; wall time inside each process "
        f"(imports excluded). Command: `python benchmarks/onepass_bench.py"
        f"{' --quick' if args.quick else ''}"
        f" --tensors-per-shard {args.tensors_per_shard}`.\n\n{text}\n"
    )
    print(text)


if __name__ == "__main__":
    main()
