"""A user's own files, warm and cold: loaderplug against safetensors ``load_file``, with
its tensors mapped where the file stays put and with every byte owned.

Models of 1 and 4 shards of 16 MiB and 256 MiB, and 4 shards of 1 GiB (left out with
``--quick``), on local disk. Each load runs in a fresh process and touches every tensor
the same way (an integer sum of its bits, as benchmarks/small_files_bench.py does); the
contenders alternate within each round, whose order rotates, and each round gives each
loaderplug contender a ratio (its seconds over ``load_file``'s in that round), so a
neighbour that slows the machine for a while weighs on all of them alike. Cold runs
drop every shard from the page cache first (posix_fadvise DONTNEED).

- ``auto``: ``loaderplug.iter_tensors`` with ``LOADERPLUG_OWNED=auto`` (the default:
  a warm file on a local filesystem mapped, as safetensors does; a cold one read into
  memory of the load's own);
- ``owned``: the same with ``LOADERPLUG_OWNED=on`` (every byte owned: safe against a
  file changed under the load);
- ``load_file``: ``safetensors.torch.load_file``.

    python benchmarks/owned_bench.py [--quick] [--rounds N] [--tree PATH]

``--tree`` loads loaderplug from another checkout in the children (before and after
side by side). Writes benchmarks/results/owned.{md,json,png}.
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
CONTENDERS = ("auto", "owned", "load_file")
OURS = ("auto", "owned")
# (shards, bytes per shard)
CELLS = ((1, 16 * MiB), (4, 16 * MiB), (1, 256 * MiB), (4, 256 * MiB), (4, GiB))
QUICK_CELLS = CELLS[:-1]
TENSORS_PER_SHARD = 8
TARGET = 1.0  # loaderplug's seconds over load_file's, warm and cold, on local files
# Models this small load in a few hundredths of a second, where a process that happens
# to share its core with a neighbour takes twice as long: they run this many times the
# rounds, so a median means something.
SMALL_MODEL = 64 * MiB
SMALL_ROUNDS = 3


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
    if name == "load_file":
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


def child_env(name: str, tree: Path | None) -> dict[str, str]:
    env = {"LOADERPLUG_PROGRESS": "0", "LOADERPLUG_OWNED": "on" if name == "owned" else "auto"}
    if tree is not None:
        env["PYTHONPATH"] = f"{tree}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return env


def measure(name: str, files: list[str], tree: Path | None) -> tuple[float, list[str]]:
    """The child's seconds, and how loaderplug read the files (mapped, read ...)."""
    figures: dict[str, object] = dict(
        run_child([sys.executable, __file__, "--run", name, *files], child_env(name, tree))
    )
    seconds, modes = figures["total_s"], figures["modes"]
    assert isinstance(seconds, float) and isinstance(modes, list)
    return seconds, modes


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
            measure("auto", files, tree)  # untimed: a first load may probe the mount
            scaled = rounds * SMALL_ROUNDS if count * size <= SMALL_MODEL else rounds
            results += run_cell(files, count, size, scaled, tree)
    return results


def run_cell(
    files: list[str], count: int, size: int, rounds: int, tree: Path | None
) -> list[dict[str, object]]:
    runs: dict[str, dict[str, list[float]]] = {"cold": {}, "warm": {}}
    modes: dict[str, dict[str, list[str]]] = {"cold": {}, "warm": {}}
    loads: list[float] = []
    for round_ in range(rounds):
        turn = round_ % len(CONTENDERS)
        order = CONTENDERS[turn:] + CONTENDERS[:turn]
        for state in ("cold", "warm"):
            for name in order:
                drop_cache(files) if state == "cold" else warm_cache(files)
                seconds, modes[state][name] = measure(name, files, tree)
                runs[state].setdefault(name, []).append(seconds)
        loads.append(os.getloadavg()[0])
        print(
            f"  {cell_label(count, size):>12s} round {round_ + 1}: "
            + "  ".join(
                f"{state} {name} {runs[state][name][-1]:.3f}s"
                for state in runs
                for name in CONTENDERS
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


def ratios(cell: dict[str, object], ours: str) -> list[float]:
    """``ours``'s seconds over ``load_file``'s, round by round."""
    runs = cell["runs"]
    assert isinstance(runs, dict)
    return [a / b for a, b in zip(runs[ours], runs["load_file"], strict=True)]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def verdict(values: list[float]) -> str:
    return "met" if statistics.median(values) <= TARGET else "**missed**"


def table(cells: list[dict[str, object]]) -> str:
    lines = [
        "| cache | model | rounds | load_file s | auto s | owned s | auto x load_file "
        "(median, min-max) | 1.0x | owned x load_file (median, min-max) | load average |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell in sorted(cells, key=lambda c: (c["cache"], c["size"], c["shards"])):  # type: ignore[return-value]
        runs = cell["runs"]
        assert isinstance(runs, dict)
        med = {name: statistics.median(runs[name]) for name in CONTENDERS}
        auto, owned = ratios(cell, "auto"), ratios(cell, "owned")
        loads = cell["load"]
        assert isinstance(loads, list)
        lines.append(
            f"| {cell['cache']} | {cell_label(cell['shards'], cell['size'])} | "  # type: ignore[arg-type]
            f"{cell['rounds']} | {med['load_file']:.3f} | {med['auto']:.3f} | {med['owned']:.3f} | "
            f"{spread(auto)} | {verdict(auto)} | {spread(owned)} | "
            f"{min(loads):.1f}-{max(loads):.1f} |"
        )
    return "\n".join(lines)


def modes_note(cells: list[dict[str, object]]) -> str:
    """How each loaderplug contender read the files, warm and cold (its last round's
    ``io_modes``, less the policy's reason)."""
    seen: dict[tuple[str, str], set[str]] = {}
    for cell in cells:
        modes = cell["modes"]
        assert isinstance(modes, dict)
        for name in OURS:
            seen.setdefault((str(cell["cache"]), name), set()).update(modes.get(name, []))
    said = "; ".join(
        f"{name} {cache}: {', '.join(sorted(found))}"
        for (cache, name), found in sorted(seen.items())
    )
    return f"How loaderplug read the files: {said}."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="no 4 x 1 GiB model")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tree", type=Path, help="load loaderplug from this checkout")
    parser.add_argument("--label", default="", help="what the results are of (before, after)")
    parser.add_argument("--out", type=Path, default=HERE / "results")
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("files", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        print(json.dumps(run_one(args.run, args.files)))
        return
    compile_loaderplug()
    started, load_before = time.monotonic(), os.getloadavg()[0]
    cells = run_cells(QUICK_CELLS if args.quick else CELLS, args.rounds, args.tree)
    write(args, cells, load_before, time.monotonic() - started)


def write(
    args: argparse.Namespace, cells: list[dict[str, object]], load_before: float, seconds: float
) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    name = "owned" + (f"_{args.label}" if args.label else "")
    header = (
        f"# A user's own files{f' ({args.label})' if args.label else ''}\n\n"
        f"Load and touch (an integer sum of every tensor's bits) of models of "
        f"{TENSORS_PER_SHARD} float32 tensors a shard on local disk (ext4 on a virtio "
        f"disk), {args.rounds} rounds ({args.rounds * SMALL_ROUNDS} for models of "
        f"{SMALL_MODEL // MiB} MiB or less), contenders alternating, one process per load. "
        "`auto`: loaderplug as it is by default (`LOADERPLUG_OWNED=auto`: a local file "
        "mapped where it is read through the page cache, a cold one with its pages asked "
        "for ahead by the readers); `owned`: `LOADERPLUG_OWNED=on` (every byte owned). "
        "`x load_file` = loaderplug's seconds over safetensors `load_file`'s, per round "
        "(below 1: loaderplug is faster); the target is 1.0 or less for `auto`. "
        f"Command: `python benchmarks/owned_bench.py"
        f"{' --quick' if args.quick else ''} --rounds {args.rounds}` ({seconds / 60:.0f} "
        f"min on {os.cpu_count()} cores shared with other work; load average "
        f"{load_before:.1f} at the start, each cell's range at its rounds' ends "
        "below).\n\n"
    )
    body = table(cells) + "\n\n" + modes_note(cells)
    (args.out / f"{name}.md").write_text(header + body + "\n")
    (args.out / f"{name}.json").write_text(
        json.dumps({"cells": cells, "rounds": args.rounds}, indent=1)
    )
    print(body)
    draw(cells, args.out / f"{name}.png", args.label)


def draw(cells: list[dict[str, object]], out: Path, label: str) -> None:
    """Each cell's ratios (median, whiskers min-max), auto and owned, cold and warm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, state in zip(axes, ("cold", "warm"), strict=True):
        mine = sorted(
            (c for c in cells if c["cache"] == state),
            key=lambda c: (c["size"], c["shards"]),  # type: ignore[return-value]
        )
        width = 0.38
        for shift, ours, color in (
            (-width / 2, "auto", "#d9480f"),
            (width / 2, "owned", "#1c7ed6"),
        ):
            values = [statistics.median(ratios(c, ours)) for c in mine]
            lows = [v - min(ratios(c, ours)) for v, c in zip(values, mine, strict=True)]
            highs = [max(ratios(c, ours)) - v for v, c in zip(values, mine, strict=True)]
            xs = [i + shift for i in range(len(mine))]
            bars = ax.bar(xs, values, width, color=color, yerr=[lows, highs], capsize=3, label=ours)
            ax.bar_label(bars, fmt="%.2f", padding=2, fontsize=7)
        ax.axhline(TARGET, color="#343a40", linewidth=1, linestyle="--")
        names = [cell_label(c["shards"], c["size"]) for c in mine]  # type: ignore[arg-type]
        ax.set_xticks(range(len(mine)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(f"{state} page cache")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("loaderplug s / safetensors load_file s (lower is better)")
    fig.suptitle(f"A user's own files, load and touch{f' ({label})' if label else ''}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
