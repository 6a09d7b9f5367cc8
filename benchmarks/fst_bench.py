"""fastsafetensors through loaderplug against plain fastsafetensors.

Two places, a ~1 GiB, 4-shard model each, every run in its own process, alternating:

* local disk, cold (each file dropped from the page cache first): loaderplug's
  ``fastsafe_open`` (the policy-aware copier, ``local_files`` finding nothing to
  hydrate) against fastsafetensors' own ``fastsafe_open``. Target: >= 0.95x, no overhead.
* the throttled test volume (as in hydrate.md): loaderplug's ``fastsafe_open`` over the
  mount's files (hydrated to an empty local folder first, then read from local disk)
  against fastsafetensors reading the mount. Target: >= 2x.

Both sides run with ``device="cpu", nogds=True`` and touch every page of every tensor.

    pip install -e '.[bench]' torch==2.13.0 fastsafetensors
    python benchmarks/fst_bench.py [--quick] [--rounds N]

Writes benchmarks/results/fst.md and fst.json.
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
from common import compile_loaderplug, drop_cache, run_child, write_results
from hydrate_bench import PROFILE, ram_dir

from loaderplug.units import GiB, MiB

HERE = Path(__file__).resolve().parent
CONTENDERS = ("loaderplug + fastsafetensors", "fastsafetensors")


def child(name: str, files: list[str]) -> dict[str, float]:
    import torch

    from loaderplug.integrations import fastsafetensors as lp_fst

    if name == "loaderplug + fastsafetensors":
        lp_fst.install()
        opener = lp_fst.fastsafe_open
    else:
        from fastsafetensors import fastsafe_open as opener
    started = time.perf_counter()
    total = 0
    with opener(files, device="cpu", nogds=True) as f:
        for key in f.keys():  # noqa: SIM118 - not a mapping
            tensor = f.get_tensor(key)
            if tensor.numel():
                total += int(tensor.reshape(-1).view(torch.uint8)[::4096].sum())
    return {"total_s": time.perf_counter() - started}


def measure(name: str, files: list[Path], env: dict[str, str]) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", name, *map(str, files)]
    return run_child(cmd, {"LOADERPLUG_PROGRESS": "0", **env})


def main() -> None:
    compile_loaderplug()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 MiB, one round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1:])))
        return
    from loaderplug.testing.model import write_model
    from loaderplug.testing.volume import mounted

    size = 256 * MiB if args.quick else GiB
    rounds = 1 if args.quick else args.rounds
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="fst-bench-", dir="/var/tmp") as tmp,
        tempfile.TemporaryDirectory(prefix="fst-bench-", dir=ram_dir()) as ram,
    ):
        local_model = Path(tmp) / "model"
        files = write_model(local_model, size, shards=4)
        backing = Path(ram) / "model"
        shutil.copytree(local_model, backing)
        copies = Path(tmp) / "copies"
        with mounted(backing, Path(tmp) / "mnt", PROFILE) as vol:
            on_mount = sorted(vol.mountpoint.glob("*.safetensors"))
            for round_ in range(rounds):
                order = CONTENDERS if round_ % 2 == 0 else CONTENDERS[::-1]
                for name in order:
                    drop_cache(files)
                    figures = measure(name, files, {})
                    results.setdefault(("local disk, cold", name), []).append(figures)
                    report(round_, "local", name, figures)
                for name in order:
                    shutil.rmtree(copies, ignore_errors=True)
                    subprocess.run(["sync"], check=True)
                    env = {"LOADERPLUG_LOCAL_COPIES": str(copies)}
                    figures = measure(name, on_mount, env)
                    results.setdefault(("test volume", name), []).append(figures)
                    report(round_, "volume", name, figures)
    text = table(results, size)
    header = (
        f"# fastsafetensors through loaderplug\n\n{size / MiB:.0f} MiB, 4 shards of float32; "
        f"`fastsafe_open(device='cpu', nogds=True)`, every page of every tensor touched; "
        f"{rounds} round(s) alternating, one process per run. Local disk: files dropped "
        f"from the page cache before each run. Test volume: the object-store profile of "
        f"hydrate.md (40 MiB/s per stream, 320 MiB/s per mount, 2 ms per request, "
        f"backing folder in memory); loaderplug hydrates into an empty local folder each "
        f"run, then fastsafetensors reads the local copy; plain fastsafetensors reads the "
        f"mount. Command: `python benchmarks/fst_bench.py{_flags(args)}`."
        f"\n\n"
    )
    raw = {f"{place}/{name}": v for (place, name), v in results.items()}
    write_results(args.out, "fst", header, text, raw)


def _flags(args: argparse.Namespace) -> str:
    if args.quick:
        return " --quick"
    return f" --rounds {args.rounds}" if args.rounds != 3 else ""


def report(round_: int, place: str, name: str, figures: dict[str, float]) -> None:
    print(f"  round {round_ + 1} {place:6s} {name:30s} {figures['total_s']:6.2f} s", flush=True)


def table(results: dict[tuple[str, str], list[dict[str, float]]], total: int) -> str:
    lines = [
        "| place | reader | total s (median) | min-max | MiB/s | x plain fastsafetensors "
        "| peak RSS |",
        "|---|---|---|---|---|---|---|",
    ]
    for place in ("local disk, cold", "test volume"):
        plain = statistics.median(r["total_s"] for r in results[(place, "fastsafetensors")])
        for name in CONTENDERS:
            runs = results[(place, name)]
            seconds = [r["total_s"] for r in runs]
            median = statistics.median(seconds)
            rss = max(r["rss"] for r in runs)
            lines.append(
                f"| {place} | {name} | {median:.2f} | {min(seconds):.2f}-{max(seconds):.2f} "
                f"| {total / MiB / median:.0f} | {plain / median:.2f} | {rss / MiB:.0f} MiB |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
