"""A user's own files, warm and cold: loaderplug against safetensors ``load_file``.

Two measures, both on local disk:

- the fixed cost of a load: :data:`FIXED_LOADS` warm loads of one file of
  :data:`FIXED_SIZE`, ``loaderplug.load_file`` and ``safetensors.torch.load_file`` in
  the same process, alternating (ABBA), each timed alone; a contender's median, and
  loaderplug's fixed cost a file, its median less safetensors' (both map the file and
  make the same tensors; what is left is what loaderplug does around that). With
  ``--before PATH`` the same is measured of the loaderplug checked out there, in the
  same run;
- load and touch of models of 1 x 16 MiB, 4 x 16 MiB, 4 x 128 MiB and 4 x 1 GiB (left
  out with ``--quick``), warm and cold: each load in a fresh process touching every
  tensor the same way (an integer sum of its bits, as benchmarks/small_files_bench.py
  does), ``loaderplug.iter_tensors`` as it is by default and ``load_file`` in ABBA
  order, round after round; each round gives a speed (``load_file``'s seconds over
  loaderplug's: 1.0 or more is the target), so a neighbour that slows the machine for
  a while weighs on both alike. Cold runs drop every shard from the page cache first
  (posix_fadvise DONTNEED).

    python benchmarks/owned_bench.py [--quick] [--rounds N] [--before PATH] [--tree PATH]

``--tree`` loads loaderplug from another checkout in the children. Writes
benchmarks/results/owned.{md,json,png}.
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
from common import collect_garbage_before_the_clock, compile_loaderplug, drop_cache, run_child
from small_files_bench import size_label, touch, warm_cache

from loaderplug.units import GiB, MiB

HERE = Path(__file__).resolve().parent
OURS, THEIRS = "loaderplug", "load_file"
# (shards, bytes per shard)
CELLS = ((1, 16 * MiB), (4, 16 * MiB), (4, 128 * MiB), (4, GiB))
QUICK_CELLS = CELLS[:-1]
TENSORS_PER_SHARD = 8
TARGET = 1.0  # load_file's seconds over loaderplug's, warm and cold, on local files
# Models this small load in a few hundredths of a second, where a process that happens
# to share its core with a neighbour takes twice as long: they run this many times the
# rounds, so a median means something.
SMALL_MODEL = 64 * MiB
SMALL_ROUNDS = 3
# The fixed cost: warm loads of one file this size, each contender this many times.
FIXED_SIZE = MiB
FIXED_LOADS = 200
# And in loads of many small files, as a model of many shards is (per file).
MANY_FILES = 40
MANY_BYTES = 64 * 1024
FIXED_TARGET_MS = 0.2


def run_one(name: str, files: list[str]) -> dict[str, object]:
    # Imports happen before the clock: torch's import is nobody's load time.
    import torch
    from safetensors.torch import load_file

    from loaderplug import iter_tensors
    from loaderplug.plugins.manager import plugin_manager

    plugin_manager()  # like an import, once per process
    torch.set_num_threads(1)
    collect_garbage_before_the_clock()  # torch's import leaves a collection due
    started = time.perf_counter()
    if name == THEIRS:
        tensors = [t for f in files for t in load_file(f).values()]
        modes = ["safetensors"]
    else:
        load = iter_tensors(files, progress=False)
        tensors = [t for _, t in load]
        modes = sorted({mode.split(" (")[0] for mode in load.io_modes.values()})
    called = time.perf_counter()
    touch(tensors)
    ended = time.perf_counter()
    return {"call_s": called - started, "total_s": ended - started, "modes": modes}


def run_fixed(files: list[str]) -> dict[str, object]:
    """Warm loads of ``files`` (one load of them all) by each contender, ABBA, as many as
    make :data:`FIXED_LOADS` loads of a file: every load's seconds a file."""
    import torch
    from safetensors.torch import load_file

    from loaderplug import iter_tensors
    from loaderplug.plugins.manager import plugin_manager

    plugin_manager()
    torch.set_num_threads(1)

    def ours() -> object:
        return dict(iter_tensors(files))

    def theirs() -> object:
        return {name: t for f in files for name, t in load_file(f).items()}

    loaders = {OURS: ours, THEIRS: theirs}
    for _ in range(20):  # the first loads import and warm up what the rest reuse
        for load in loaders.values():
            load()
    collect_garbage_before_the_clock()
    seconds: dict[str, list[float]] = {OURS: [], THEIRS: []}
    for i in range(max(FIXED_LOADS // len(files), 20)):
        for name in (OURS, THEIRS) if i % 2 == 0 else (THEIRS, OURS):
            started = time.perf_counter()
            tensors = loaders[name]()
            seconds[name].append((time.perf_counter() - started) / len(files))
            del tensors  # they go before the next load, as in a loop over models
    return {"seconds": seconds}


def child_env(tree: Path | None) -> dict[str, str]:
    env = {"LOADERPLUG_PROGRESS": "0"}
    if tree is not None:
        env["PYTHONPATH"] = f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return env


def measure(name: str, files: list[str], tree: Path | None) -> tuple[float, list[str]]:
    """The child's seconds, and how loaderplug read the files (mapped, read ...)."""
    figures: dict[str, object] = dict(
        run_child([sys.executable, __file__, "--run", name, *files], child_env(tree))
    )
    seconds, modes = figures["total_s"], figures["modes"]
    assert isinstance(seconds, float) and isinstance(modes, list)
    return seconds, modes


def fixed_cost(trees: dict[str, Path | None]) -> list[dict[str, object]]:
    """The fixed cost a file of the loaderplug of each tree (None: this one): in loads of
    one file of :data:`FIXED_SIZE`, and in loads of :data:`MANY_FILES` small files."""
    from loaderplug.testing.model import write_model

    results = []
    with tempfile.TemporaryDirectory(prefix="loaderplug-fixed-", dir="/var/tmp") as tmp:
        one = [
            str(f)
            for f in write_model(Path(tmp) / "one", FIXED_SIZE, shards=1, tensors_per_shard=8)
        ]
        many = [
            str(f)
            for f in write_model(
                Path(tmp) / "many", MANY_FILES * MANY_BYTES, shards=MANY_FILES, tensors_per_shard=8
            )
        ]
        warm_cache(one + many)
        for label, tree in trees.items():
            for files in (one, many):
                cmd = [sys.executable, __file__, "--fixed", *files]
                seconds = run_child(cmd, child_env(tree))["seconds"]
                assert isinstance(seconds, dict)
                ours, theirs = statistics.median(seconds[OURS]), statistics.median(seconds[THEIRS])
                row = {"of": label, "files": len(files), "ours_s": ours, "theirs_s": theirs}
                results.append({**row, "load": os.getloadavg()[0]})
                print(
                    f"  fixed cost ({label}, {len(files)} files a load): loaderplug "
                    f"{ours * 1e3:.3f} ms, load_file {theirs * 1e3:.3f} ms a file",
                    flush=True,
                )
    return results


def cell_label(shards: int, size: int) -> str:
    return f"{shards} x {size_label(size)}"


def run_cells(
    cells: tuple[tuple[int, int], ...], rounds: int, tree: Path | None
) -> list[dict[str, object]]:
    """Every cell's runs: ``{"cache", "shards", "size", "runs": {contender: [s, ...]},
    "load": [load average at each round's end]}``."""
    from loaderplug.testing.model import write_model

    results: list[dict[str, object]] = []
    for count, size in cells:
        with tempfile.TemporaryDirectory(prefix="loaderplug-owned-", dir="/var/tmp") as tmp:
            files = [
                str(p)
                for p in write_model(
                    Path(tmp), size * count, shards=count, tensors_per_shard=TENSORS_PER_SHARD
                )
            ]
            drop_cache(files)
            measure(OURS, files, tree)  # untimed: a first load may probe the mount
            scaled = rounds * SMALL_ROUNDS if count * size <= SMALL_MODEL else rounds
            results += run_cell(files, count, size, scaled, tree)
    return results


def run_cell(
    files: list[str], count: int, size: int, rounds: int, tree: Path | None
) -> list[dict[str, object]]:
    runs: dict[str, dict[str, list[float]]] = {"cold": {}, "warm": {}}
    modes: dict[str, list[str]] = {"cold": [], "warm": []}
    loads: list[float] = []
    for round_ in range(rounds):
        # ABBA: each contender goes first every other round.
        order = (OURS, THEIRS) if round_ % 2 == 0 else (THEIRS, OURS)
        for state in ("cold", "warm"):
            for name in order:
                drop_cache(files) if state == "cold" else warm_cache(files)
                seconds, said = measure(name, files, tree)
                runs[state].setdefault(name, []).append(seconds)
                if name == OURS:
                    modes[state] = said
        loads.append(os.getloadavg()[0])
        print(
            f"  {cell_label(count, size):>12s} round {round_ + 1}: "
            + "  ".join(
                f"{state} {name} {runs[state][name][-1]:.3f}s"
                for state in runs
                for name in (OURS, THEIRS)
            )
            + f"  (load {loads[-1]:.1f})",
            flush=True,
        )
    return [
        {
            "cache": state,
            "shards": count,
            "size": size,
            "runs": runs[state],
            "modes": modes[state],
            "load": loads,
            "rounds": rounds,
        }
        for state in ("cold", "warm")
    ]


def speeds(cell: dict[str, object]) -> list[float]:
    """``load_file``'s seconds over loaderplug's, round by round (above 1: loaderplug is
    faster)."""
    runs = cell["runs"]
    assert isinstance(runs, dict)
    return [b / a for a, b in zip(runs[OURS], runs[THEIRS], strict=True)]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def verdict(values: list[float]) -> str:
    return "met" if statistics.median(values) >= TARGET else "**missed**"


def fixed_table(fixed: list[dict[str, object]]) -> str:
    lines = [
        f"| loaderplug | files a load | load_file ms a file | loaderplug ms a file | "
        f"fixed cost ms a file | < {FIXED_TARGET_MS} ms | load average |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in fixed:
        ours, theirs = float(row["ours_s"]) * 1e3, float(row["theirs_s"]) * 1e3  # type: ignore[arg-type]
        met = "met" if ours - theirs < FIXED_TARGET_MS else "**missed**"
        lines.append(
            f"| {row['of']} | {row['files']} | {theirs:.3f} | {ours:.3f} | {ours - theirs:.3f} "
            f"| {met} | {float(row['load']):.1f} |"  # type: ignore[arg-type]
        )
    return "\n".join(lines)


def table(cells: list[dict[str, object]]) -> str:
    lines = [
        "| cache | model | rounds | load_file s | loaderplug s | speed (median, min-max) "
        "| 1.0x | load average |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell in sorted(cells, key=lambda c: (c["cache"], c["size"], c["shards"])):  # type: ignore[return-value]
        runs = cell["runs"]
        assert isinstance(runs, dict)
        med = {name: statistics.median(runs[name]) for name in (OURS, THEIRS)}
        loads = cell["load"]
        assert isinstance(loads, list)
        lines.append(
            f"| {cell['cache']} | {cell_label(cell['shards'], cell['size'])} | "  # type: ignore[arg-type]
            f"{cell['rounds']} | {med[THEIRS]:.3f} | {med[OURS]:.3f} | "
            f"{spread(speeds(cell))} | {verdict(speeds(cell))} | "
            f"{min(loads):.1f}-{max(loads):.1f} |"
        )
    return "\n".join(lines)


def modes_note(cells: list[dict[str, object]]) -> str:
    """How loaderplug read the files, warm and cold (its last round's ``io_modes``, less
    the policy's reason)."""
    seen: dict[str, set[str]] = {}
    for cell in cells:
        modes = cell["modes"]
        assert isinstance(modes, list)
        seen.setdefault(str(cell["cache"]), set()).update(modes)
    said = "; ".join(
        f"{cache}: {', '.join(sorted(found))}" for cache, found in sorted(seen.items())
    )
    return f"How loaderplug read the files: {said}."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="no 4 x 1 GiB model")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tree", type=Path, help="load loaderplug from this checkout")
    parser.add_argument("--before", type=Path, help="a checkout whose fixed cost to show too")
    parser.add_argument("--label", default="", help="what the results are of (before, after)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--fixed", help=argparse.SUPPRESS)
    parser.add_argument("files", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(run_one(args.run, args.files)))
        return
    if args.fixed:
        print(json.dumps(run_fixed([args.fixed, *args.files])))
        return
    compile_loaderplug()
    started, load_before = time.monotonic(), os.getloadavg()[0]
    trees: dict[str, Path | None] = {"this tree": args.tree}
    if args.before is not None:
        trees = {"before": args.before, **trees}
    fixed = fixed_cost(trees)
    cells = run_cells(QUICK_CELLS if args.quick else CELLS, args.rounds, args.tree)
    write(args, fixed, cells, load_before, time.monotonic() - started)


def write(
    args: argparse.Namespace,
    fixed: list[dict[str, object]],
    cells: list[dict[str, object]],
    load_before: float,
    seconds: float,
) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    name = "owned" + (f"_{args.label}" if args.label else "")
    command = (
        f"python benchmarks/owned_bench.py{' --quick' if args.quick else ''} "
        f"--rounds {args.rounds}{' --before PATH' if args.before else ''}"
    )
    header = (
        f"# A user's own files{f' ({args.label})' if args.label else ''}\n\n"
        f"Command: `{command}` ({seconds / 60:.0f} min on {os.cpu_count()} cores shared "
        f"with other work; load average {load_before:.1f} at the start, each row's below). "
        "Local disk: ext4 on a virtio disk.\n\n"
        f"The fixed cost of a load: {FIXED_LOADS} warm loads of one file of "
        f"{size_label(FIXED_SIZE)} (8 float32 tensors) by `loaderplug.iter_tensors` and "
        "by safetensors `load_file`, in one process, alternating (ABBA), and as many "
        f"files in loads of {MANY_FILES} files of {MANY_BYTES // 1024} KiB (8 tensors "
        "each, as a model of many shards), a time a file; each contender's median, and "
        "loaderplug's fixed cost a file: its median less safetensors' (both map the file "
        "and make the same tensors). `before`: the loaderplug checked out at `--before` "
        "(the last commit), measured in the same run.\n\n"
    )
    second = (
        f"\n\nLoad and touch (an integer sum of every tensor's bits) of models of "
        f"{TENSORS_PER_SHARD} float32 tensors a shard, warm and cold, one process per load, "
        f"loaderplug as it is by default and safetensors `load_file` in ABBA order, "
        f"{args.rounds} rounds ({args.rounds * SMALL_ROUNDS} for models of "
        f"{SMALL_MODEL // MiB} MiB or less). Speed = `load_file`'s seconds over "
        "loaderplug's, per round (1.0 or more: loaderplug is as fast or faster; the "
        "target); seconds are medians.\n\n"
    )
    body = fixed_table(fixed) + second + table(cells) + "\n\n" + modes_note(cells)
    (args.out / f"{name}.md").write_text(header + body + "\n")
    (args.out / f"{name}.json").write_text(
        json.dumps({"fixed": fixed, "cells": cells, "rounds": args.rounds}, indent=1)
    )
    print(body)
    draw(cells, args.out / f"{name}.png", args.label)


def draw(cells: list[dict[str, object]], out: Path, label: str) -> None:
    """Each cell's speed (median, whiskers min-max), cold and warm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, state in zip(axes, ("cold", "warm"), strict=True):
        mine = sorted(
            (c for c in cells if c["cache"] == state),
            key=lambda c: (c["size"], c["shards"]),  # type: ignore[return-value]
        )
        values = [statistics.median(speeds(c)) for c in mine]
        lows = [v - min(speeds(c)) for v, c in zip(values, mine, strict=True)]
        highs = [max(speeds(c)) - v for v, c in zip(values, mine, strict=True)]
        bars = ax.bar(range(len(mine)), values, 0.6, color="#d9480f", yerr=[lows, highs], capsize=3)
        ax.bar_label(bars, fmt="%.2f", padding=2, fontsize=7)
        ax.axhline(TARGET, color="#343a40", linewidth=1, linestyle="--")
        names = [cell_label(c["shards"], c["size"]) for c in mine]  # type: ignore[arg-type]
        ax.set_xticks(range(len(mine)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{state} page cache")
    axes[0].set_ylabel("safetensors load_file s / loaderplug s (higher is better)")
    fig.suptitle(f"A user's own files, load and touch{f' ({label})' if label else ''}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
