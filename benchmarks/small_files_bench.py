"""Small files as fast as big ones: loaderplug against safetensors across shard counts
and model sizes, cold and warm, and what each file costs before its first byte.

Models of 1, 4 and 32 shards at 16 MiB, 128 MiB, 1 GiB and 4 GiB (``--quick``: at 16
and 128 MiB, two rounds) on local disk. Each load runs in a fresh process and touches
every tensor the same way (an integer sum of its bits); the contenders alternate within
each round, and each round gives a ratio (loaderplug's seconds over safetensors' in that
round), so a neighbour that slows the machine for a while weighs on both alike. Cold
runs drop every shard from the page cache first (posix_fadvise DONTNEED).

- ``loaderplug``: ``loaderplug.iter_tensors`` (the public load API);
- ``load_file``: ``safetensors.torch.load_file``;
- ``safe_open``: ``safetensors.safe_open`` + ``get_tensor`` for every key.

The per-file overhead: 32 files of 64 KiB each, warm, loaded in one process many times
over under cProfile; the table gives the milliseconds per file spent in each step.

    python benchmarks/small_files_bench.py [--quick] [--rounds N] [--tree PATH]

``--tree`` loads loaderplug from another checkout (e.g. an export of an earlier commit)
in the children, to set before and after side by side. Writes
benchmarks/results/small_files.{md,json,png}.
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
from common import compile_loaderplug, drop_cache, run_child, run_timed

from loaderplug.units import GiB, MiB

HERE = Path(__file__).resolve().parent
# loaderplug_own: the same files as loaderplug's own local copies (LOADERPLUG_LOCAL_COPIES).
# Both are mapped where they are in memory (a user's files on a local filesystem too, with
# LOADERPLUG_OWNED=auto; benchmarks/owned_bench.py compares that with owning them).
CONTENDERS = ("loaderplug", "loaderplug_own", "load_file", "safe_open")
SHARDS = (1, 4, 32)
SIZES = (16 * MiB, 128 * MiB, GiB, 4 * GiB)
QUICK_SHARDS = SHARDS
QUICK_SIZES = (16 * MiB, 128 * MiB)
TENSORS_PER_SHARD = 8
# The per-file overhead's model: many small files, loaded again and again.
PROFILED_FILES = 32
PROFILED_FILE_BYTES = 64 * 1024
PROFILED_LOADS = 20
# The steps of a load whose time the overhead table shows (cProfile's cumulative time):
# (the module's path ends so, the function's name).
STEPS = {
    "whole load": ("tensors/delivery/load.py", "__next__"),
    "IO policy decision": ("jobs/runner.py", "_policy"),
    "  filesystem type (mounts)": ("storage/mounts.py", "filesystem_type"),
    "  page-cache residency": ("storage/residency.py", "cached_fraction"),
    "  measured policy": ("storage/io_probe.py", "measured_policy"),
    "header read and parse": ("tensors/delivery/choice.py", "_read_header"),
    "  header parse": ("tensors/format/header.py", "parse_header"),
    "map or read decision": ("tensors/delivery/choice.py", "_in_memory"),
    "tensor sink or mapping made": ("tensors/delivery/tensor_sinks.py", "__init__"),
    "engine set up": ("jobs/runner.py", "_engine_for"),
    "tensors from the engine, waits included": (
        "tensors/delivery/hand_over.py",
        "_next_from_engine",
    ),
    "thread start": ("threading.py", "start"),
}


def touch(tensors: list[object]) -> int:
    """Read every byte of every tensor (the same for every contender): an integer sum of
    the float32 tensors' bits, on one thread (random bits make NaNs and denormals, whose
    float sums run at the whim of the CPU; a parallel sum on a busy machine waits for
    the slowest of its threads to be scheduled)."""
    import torch

    torch.set_num_threads(1)
    total = 0
    for tensor in tensors:
        total += int(tensor.view(torch.int32).sum())  # type: ignore[attr-defined]
    return total


def run_one(name: str, files: list[str]) -> dict[str, float]:
    # Imports happen before the clock: torch's import is nobody's load time.
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from loaderplug import iter_tensors
    from loaderplug.plugins.manager import plugin_manager

    # Like an import, once per process: the plugins found and loaded (see the overhead).
    plugin_manager()
    torch.set_num_threads(1)
    started = time.perf_counter()
    if name.startswith("loaderplug"):
        tensors = [t for _, t in iter_tensors(files, progress=False)]
    elif name == "load_file":
        tensors = [t for f in files for t in load_file(f).values()]
    else:
        tensors = []
        for f in files:
            with safe_open(f, framework="pt") as opened:
                tensors += [opened.get_tensor(k) for k in opened.keys()]  # noqa: SIM118
    called = time.perf_counter()
    touch(tensors)
    return {"call_s": called - started, "total_s": time.perf_counter() - started}


def warm_cache(files: list[str]) -> None:
    for f in files:
        with open(f, "rb") as handle:
            while handle.read(16 * MiB):
                pass


def child_env(tree: Path | None) -> dict[str, str]:
    env = {"LOADERPLUG_PROGRESS": "0"}
    if tree is not None:
        env["PYTHONPATH"] = f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return env


def measure(name: str, files: list[str], tree: Path | None) -> dict[str, float]:
    env = child_env(tree)
    if name == "loaderplug_own":
        env["LOADERPLUG_LOCAL_COPIES"] = str(Path(files[0]).parent)
    return run_child([sys.executable, __file__, "--run", name, *files], env)


def size_label(nbytes: int) -> str:
    return f"{nbytes // GiB} GiB" if nbytes >= GiB else f"{nbytes // MiB} MiB"


def run_grid(
    shards: tuple[int, ...], sizes: tuple[int, ...], rounds: int, tree: Path | None
) -> list[dict[str, object]]:
    """Every cell's runs: ``{"cache", "shards", "size", "runs": {contender: [s, ...]}}``."""
    from loaderplug.testing.model import write_model

    cells: list[dict[str, object]] = []
    for size in sizes:
        for count in shards:
            with tempfile.TemporaryDirectory(prefix="loaderplug-small-", dir="/var/tmp") as tmp:
                files = [
                    str(p)
                    for p in write_model(
                        Path(tmp), size, shards=count, tensors_per_shard=TENSORS_PER_SHARD
                    )
                ]
                measure("loaderplug", files, tree)  # untimed: a first load may probe the mount
                cells += run_cell(files, count, size, rounds, tree)
    return cells


def run_cell(
    files: list[str], count: int, size: int, rounds: int, tree: Path | None
) -> list[dict[str, object]]:
    runs: dict[str, dict[str, list[float]]] = {"cold": {}, "warm": {}}
    for round_ in range(rounds):
        turn = round_ % len(CONTENDERS)
        order = CONTENDERS[turn:] + CONTENDERS[:turn]
        for state in ("cold", "warm"):
            for name in order:
                drop_cache(files) if state == "cold" else warm_cache(files)
                seconds = measure(name, files, tree)["total_s"]
                runs[state].setdefault(name, []).append(seconds)
        print(
            f"  {count:2d} shards {size_label(size):>7s} round {round_ + 1}: "
            + "  ".join(
                f"{state} {name} {runs[state][name][-1]:.3f}s"
                for state in runs
                for name in CONTENDERS
            ),
            flush=True,
        )
    return [
        {"cache": state, "shards": count, "size": size, "runs": runs[state]}
        for state in ("cold", "warm")
    ]


def ratios(cell: dict[str, object], peer: str, ours: str = "loaderplug") -> list[float]:
    """``ours``'s seconds over ``peer``'s, round by round."""
    runs = cell["runs"]
    assert isinstance(runs, dict)
    return [a / b for a, b in zip(runs[ours], runs[peer], strict=True)]


def grid_table(cells: list[dict[str, object]]) -> str:
    lines = [
        "| cell | loaderplug s | load_file s | safe_open s | x load_file (median, min-max) | "
        "x safe_open | own copy s | own copy x load_file (median, min-max) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell in sorted(cells, key=lambda c: (c["cache"], c["shards"], c["size"])):  # type: ignore[return-value]
        runs = cell["runs"]
        assert isinstance(runs, dict)
        med = {name: statistics.median(runs[name]) for name in CONTENDERS}
        by_file, by_open = ratios(cell, "load_file"), ratios(cell, "safe_open")
        own = ratios(cell, "load_file", ours="loaderplug_own")
        label = f"{cell['cache']} {cell['shards']} shards {size_label(cell['size'])}"  # type: ignore[arg-type]
        lines.append(
            f"| {label} | {med['loaderplug']:.3f} | {med['load_file']:.3f} | "
            f"{med['safe_open']:.3f} | {statistics.median(by_file):.2f} "
            f"({min(by_file):.2f}-{max(by_file):.2f}) | {statistics.median(by_open):.2f} | "
            f"{med['loaderplug_own']:.3f} | {statistics.median(own):.2f} "
            f"({min(own):.2f}-{max(own):.2f}) |"
        )
    return "\n".join(lines)


# -- the per-file overhead ---------------------------------------------------------------


def profile_overhead() -> dict[str, dict[str, float]]:
    """Cold and warm: milliseconds per file spent in each of :data:`STEPS`, loading
    :data:`PROFILED_FILES` files :data:`PROFILED_LOADS` times under cProfile, and the
    per-file time of the same loads unprofiled."""
    import torch  # noqa: F401

    from loaderplug import iter_tensors
    from loaderplug.testing.model import write_model

    with tempfile.TemporaryDirectory(prefix="loaderplug-overhead-", dir="/var/tmp") as tmp:
        files = write_model(Path(tmp), PROFILED_FILES * PROFILED_FILE_BYTES, shards=PROFILED_FILES)
        paths = [str(f) for f in files]
        warm_cache(paths)
        started = time.perf_counter()
        touch([t for _, t in iter_tensors(paths, progress=False)])
        first = time.perf_counter() - started  # imports, plugins, the mount's first look
        figures = {state: profiled_steps(paths, state) for state in ("cold", "warm")}
        later = figures["warm"]["load and touch, unprofiled"] * PROFILED_FILES / 1000
        figures["process"] = {"first load's extra ms (once a process)": (first - later) * 1000}
        return figures


def timed_loads(files: list[str], state: str, profiler: object) -> float:
    """Seconds :data:`PROFILED_LOADS` loads took (the page cache set to ``state`` before
    each, outside the clock), profiled by ``profiler`` if not None."""
    from loaderplug import iter_tensors

    took = 0.0
    for _ in range(PROFILED_LOADS):
        drop_cache(files) if state == "cold" else warm_cache(files)
        started = time.perf_counter()
        if profiler is not None:
            profiler.enable()  # type: ignore[attr-defined]
        touch([t for _, t in iter_tensors(files, progress=False)])
        if profiler is not None:
            profiler.disable()  # type: ignore[attr-defined]
        took += time.perf_counter() - started
    return took


def profiled_steps(files: list[str], state: str) -> dict[str, float]:
    import cProfile
    import pstats

    per_file = 1000 / (PROFILED_FILES * PROFILED_LOADS)
    figures = {"load and touch, unprofiled": timed_loads(files, state, None) * per_file}
    profiler = cProfile.Profile()
    timed_loads(files, state, profiler)
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    for step, (module, function) in STEPS.items():
        figures[step] = per_file * sum(
            cumulative
            for (path, _line, func), (_cc, _nc, _tt, cumulative, _callers) in stats.items()
            if func == function and path.endswith(module)
        )
    return figures


def overhead_table(figures: dict[str, dict[str, float]]) -> str:
    lines = ["| step | cold: ms per file | warm: ms per file |", "|---|---|---|"]
    for step in figures["warm"]:
        lines.append(f"| {step} | {figures['cold'][step]:.3f} | {figures['warm'][step]:.3f} |")
    for step, ms in figures.get("process", {}).items():
        lines.append(f"| {step} | | {ms:.1f} |")
    return "\n".join(lines)


# -- main ------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 and 128 MiB, two rounds")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tree", type=Path, help="load loaderplug from this checkout")
    parser.add_argument("--label", default="", help="what the results are of (before, after)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--overhead", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("files", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(run_one(args.run, args.files)))
        return
    if args.overhead:
        print(json.dumps(profile_overhead()))
        return
    compile_loaderplug()
    shards, sizes = (QUICK_SHARDS, QUICK_SIZES) if args.quick else (SHARDS, SIZES)
    rounds = 2 if args.quick else args.rounds
    started = time.monotonic()
    _s, _rss, out = run_timed([sys.executable, __file__, "--overhead"], child_env(args.tree))
    overhead = json.loads(out.strip().splitlines()[-1])
    print(overhead_table(overhead), flush=True)
    cells = run_grid(shards, sizes, rounds, args.tree)
    write(args, cells, overhead, rounds, time.monotonic() - started)


def write(
    args: argparse.Namespace,
    cells: list[dict[str, object]],
    overhead: dict[str, dict[str, float]],
    rounds: int,
    seconds: float,
) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    name = "small_files" + (f"_{args.label}" if args.label else "")
    load = os.getloadavg()[0]
    header = (
        f"# Small files{f' ({args.label})' if args.label else ''}\n\n"
        f"Load and touch (an integer sum of every tensor's bits) of models of {TENSORS_PER_SHARD} "
        f"float32 tensors a shard on local disk; {rounds} round(s), contenders alternating, "
        "one process per load. `x load_file` = loaderplug's seconds over safetensors "
        "`load_file`'s, per round (below 1: loaderplug is faster). Command: "
        f"`python benchmarks/small_files_bench.py{' --quick' if args.quick else ''}` "
        f"({seconds / 60:.0f} min; load average {load:.1f} on {os.cpu_count()} cores at the "
        "end).\n\n"
    )
    table = grid_table(cells)
    overhead_md = (
        f"\n\n## Per-file overhead\n\n{PROFILED_FILES} warm files of "
        f"{PROFILED_FILE_BYTES // 1024} KiB, loaded {PROFILED_LOADS} times in one process "
        "under cProfile (cumulative time of each step in the "
        "caller's thread, per file; indented: part of the step above).\n\n"
        + overhead_table(overhead)
        + "\n"
    )
    (args.out / f"{name}.md").write_text(header + table + overhead_md)
    raw = {"cells": cells, "overhead_ms_per_file": overhead, "rounds": rounds}
    (args.out / f"{name}.json").write_text(json.dumps(raw, indent=1))
    print(table)
    draw(cells, args.out / f"{name}.png", args.label)


def draw(cells: list[dict[str, object]], out: Path, label: str) -> None:
    """Each cell's ratio (median, whiskers min-max), cold and warm side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, state in zip(axes, ("cold", "warm"), strict=True):
        mine = sorted(
            (c for c in cells if c["cache"] == state),
            key=lambda c: (c["shards"], c["size"]),  # type: ignore[return-value]
        )
        values = [statistics.median(ratios(c, "load_file")) for c in mine]
        lows = [v - min(ratios(c, "load_file")) for v, c in zip(values, mine, strict=True)]
        highs = [max(ratios(c, "load_file")) - v for v, c in zip(values, mine, strict=True)]
        names = [f"{c['shards']} x {size_label(c['size'])}" for c in mine]  # type: ignore[arg-type]
        colors = ["#d9480f" if v <= 1.0 else "#868e96" for v in values]
        bars = ax.bar(range(len(mine)), values, color=colors, yerr=[lows, highs], capsize=3)
        ax.bar_label(bars, fmt="%.2f", padding=2, fontsize=7)
        ax.axhline(1.0, color="#343a40", linewidth=1, linestyle="--")
        ax.set_xticks(range(len(mine)), names, rotation=60, ha="right", fontsize=8)
        ax.set_title(f"{state} page cache")
    axes[0].set_ylabel("loaderplug s / safetensors load_file s (lower is better)")
    fig.suptitle(f"Load and touch every tensor{f' ({label})' if label else ''}: shards x size")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
